"""cuda backend kernel for kimi.IndexerTopK: the Triton/Gluon paged MXFP8 indexer (plugins/indexer_topk/triton.py:
score, ReLU, head weights, causal mask and top-k in one pass over the paged cache, lengths read on the device) where
it applies; elsewhere (float index-K pools, other head dims, the CPU) a torch composition of the op's definition over
the gathered keys, materializing the [B, T, H, S] scores (small shapes only)."""

from __future__ import annotations

import torch

from kimi_compile.lowering import FP8_CAPABILITY, Kernel, out_slot, warn_fallback_once

MASKED = -1e30


def _keys(pool: torch.Tensor, bt: torch.Tensor, scale_pool: torch.Tensor | None, block: int) -> torch.Tensor:
    """[B, MB*BS, D] float32 keys of every sequence (dequantized per `block` with E8M0 scales when given)."""
    B, MB = bt.shape
    raw = pool.view(torch.uint8) if pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else pool
    k = raw.index_select(0, bt.reshape(-1)).view(pool.dtype).float()
    if scale_pool is not None:
        from kimi_compile.plugins.quant.cuda import _scale_e8m0

        s = _scale_e8m0(scale_pool.index_select(0, bt.reshape(-1)))
        k = (k.reshape(*k.shape[:-1], -1, block) * s.unsqueeze(-1)).reshape(k.shape)
    return k.reshape(B, MB * pool.shape[1], pool.shape[-1])


def sort_attr(a) -> bool:
    """The op's `sorted` attribute (1: the contract's order, 0: any order) as the kernels' `sort`; other values are
    refused with the attribute named."""
    v = a.get("sorted", 1)
    if v not in (0, 1):
        raise ValueError(f"kimi.IndexerTopK: attribute 'sorted' must be 0 or 1, got {v!r}")
    return bool(v)


def indexer_topk_torch(x, a):
    sort_attr(a)  # the torch form always sorts (a valid result for either value)
    q, w, pool, bt, start, lengths = x[:6]
    scale_pool = x[6] if len(x) > 6 else None
    B, T = q.shape[:2]
    keys = _keys(pool, bt, scale_pool if a["k_format"] == "mxfp8" else None, a["block"])
    S = keys.shape[1]
    s = torch.einsum("bthd,bsd->bths", q.float(), keys).relu()
    score = torch.einsum("bths,bth->bts", s, w.float())
    pos = torch.arange(S, device=q.device).reshape(1, 1, S)
    qpos = start.reshape(B, 1, 1) + torch.arange(T, device=q.device).reshape(1, T, 1)
    visible = (pos <= qpos) & (pos < (start + lengths).reshape(B, 1, 1))
    score = torch.where(visible, score, torch.full_like(score, float("-inf")))
    k = int(a["topk"])
    if S < k:
        score = torch.cat([score, score.new_full((B, T, k - S), float("-inf"))], -1)
    vals, idx = torch.sort(score, dim=-1, descending=True, stable=True)  # ties -> lower position
    vals, idx = vals[..., :k], idx[..., :k]
    ok = vals > float("-inf")
    return (torch.where(ok, idx, torch.full_like(idx, -1)),
            torch.where(ok, vals, torch.full_like(vals, MASKED)))


def _dim(v, i: int) -> int | None:
    """A static dim of a graph value, None when not known at build time (the kernel then checks at run time)."""
    if v is None or v.shape is None:
        return None
    d = v.shape[i]
    return d if isinstance(d, int) else None


def _triton_supports(values, attrs) -> str | None:
    from kimi_compile.plugins.indexer_topk import triton as tk

    q, pool = values[0], values[2]
    if attrs.get("k_format") != "mxfp8" or attrs.get("elem", "e4m3") != "e4m3" or attrs.get("block") != 32:
        return "the Triton indexer reads MXFP8 E4M3 index-K pools with 32-element blocks"
    d = _dim(q, -1) or _dim(pool, -1)
    if d is not None and d != 128:
        return f"the Triton indexer needs index_head_dim 128, got {d}"
    bs = _dim(pool, 1)
    if bs is not None and bs not in (16, 32, 64, 128, 256):
        return f"the Triton indexer needs a power-of-two page of 16..256 tokens, got {bs}"
    if getattr(tk, "triton", None) is None:
        return "triton is not installed"
    return None


def indexer_topk_triton(x, a, out=None):
    """out: the executor's slots for (indices, scores), written in place when both are the op's contiguous
    [B, T, topk] int64 / float32 (else the kernel allocates and the executor copies)."""
    from kimi_compile.plugins.indexer_topk import triton as tk

    q, w, pool, bt, start, lengths, scale_pool = x
    codes = pool.view(torch.uint8) if pool.dtype != torch.uint8 else pool
    topk = int(a["topk"])
    why = tk.unsupported(q, w.float(), codes, scale_pool, bt, start, lengths, topk)
    if why is not None:  # a shape the build could not see: say so once, run the fallback kernel
        warn_fallback_once("kimi.IndexerTopK", why, "torch.indexer_topk")
        return indexer_topk_torch(x, a)
    shape = (*q.shape[:2], topk)
    slots = (out_slot(out, 0, shape, torch.int64), out_slot(out, 1, shape, torch.float32))
    return tk.indexer_topk(q, w.float(), codes, scale_pool, bt, start, lengths, topk,
                           out=slots if None not in slots else None, sort=sort_attr(a))




CUDA = {
    "IndexerTopK": Kernel(indexer_topk_triton, supports=_triton_supports, devices=("cuda",), out=True,
                          name="triton.indexer_topk", min_capability=FP8_CAPABILITY,
                          fallback=Kernel(indexer_topk_torch, devices=("cuda", "cpu"), name="torch.indexer_topk")),
}
