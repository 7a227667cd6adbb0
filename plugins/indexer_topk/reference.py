"""kimi.IndexerTopK: the one oracle, as a numpy twin (the op, as its ONNX body computes it) and torch twins (the GPU
kernels' decode and prefill entry points over the MXFP8 index-K cache).

Contract shared by both twins:
- outputs in the order (indices, scores) [+ the full score rows when asked];
- indices are token positions within the sequence; a slot with no visible position holds index -1 and score
  MASKED (-1e30, finite: the value the ONNX body writes); masked positions of a full score row hold MASKED too;
- score I[s] = sum_h w[h] * relu(q[h] . k[s]) over the visible positions s (decode: s < length; prefill: causal,
  s <= start + t); quantized keys are dequantized exactly (MXFP8, plugins/quant/reference.py).
The numpy twin `indexer_topk` is the registered reference: int64 indices sorted by score, ties to the lower
position, float32 scores. The torch twins `*_ref` compute in float64 and return int32 indices in an unspecified
order (compare as sets up to ties with `check_topk`). `indexer_topk_decode_eager` is the unfused bf16 baseline that
bench/gpu_kernels.py times (eager and torch.compile'd), under the same contract.

Torch-twin cache layout (the kernels'): codes [num_blocks, block_size, D] uint8 (E4M3FN bytes), scales
[num_blocks, block_size, D // 32] uint8 (E8M0 bytes, value 2^(b-127)); token p of sequence b lives at block
block_table[b, p // block_size], row p % block_size. Torch is imported inside the torch twins only, so the numpy
twin (and the op registry) never imports it.
"""

from __future__ import annotations

import builtins

import numpy as np

from kimi_compile.onnx_body import MASKED  # the score of a slot or position no query may see (twins, body, kernels)
from kimi_compile.plugins.quant.reference import mx_dequantize, mx_dequantize_torch, mx_quantize_torch


# ---------------------------------------------------------------- numpy twin: the registered reference of the op
def indexer_topk(q, w, index_pool, block_table, start, lengths, topk: int = 2048, *, index_scale_pool=None,
                 k_format: str = "float", block: int = 32, elem: str = "e4m3", sorted: int = 1):  # noqa: A002
    """kimi.IndexerTopK in numpy: loops written from the definition (ties to the lower position). The result is
    sorted whatever `sorted` says (sorted=0 allows any order, and this one is among them)."""
    B, T, H, D = q.shape
    BS = index_pool.shape[1]
    S = block_table.shape[1] * BS
    pool = index_pool
    if k_format == "mxfp8":
        pool = mx_dequantize(index_pool, index_scale_pool, block=block, elem=elem)
    keys = pool[block_table.reshape(-1)].reshape(B, S, D)
    indices = np.full((B, T, topk), -1, dtype=np.int64)
    scores = np.full((B, T, topk), MASKED, dtype=np.float32)
    for b in range(B):
        for t in range(T):
            hi = min(int(start[b]) + t + 1, int(start[b] + lengths[b]))
            if hi <= 0:
                continue
            dots = np.maximum(q[b, t].astype(np.float64) @ keys[b, :hi].T.astype(np.float64), 0)  # [H, hi]
            s = (w[b, t].astype(np.float64)[:, None] * dots).sum(0)
            order = builtins.sorted(range(hi), key=lambda j: (-s[j], j))[:topk]  # `sorted` is the attribute here
            indices[b, t, : len(order)] = order
            scores[b, t, : len(order)] = s[order]
    return indices, scores


# ---------------------------------------------------------------- torch twins: MXFP8 cache helpers
def mxfp8_quantize_ref(x, rounding: str = "floor"):
    """x [..., D] (D % 32 == 0), finite -> (codes uint8 [..., D], scales uint8 E8M0 [..., D // 32]): the E4M3 MXFP8
    quantizer of plugins/quant/reference.py (block 32, `rounding` floor | ceil)."""
    return mx_quantize_torch(x, block=32, elem="e4m3", rounding=rounding)


def mxfp8_dequantize_ref(codes, scales):
    """codes uint8 [..., D], scales uint8 [..., D // 32] -> float64 [..., D] (exact)."""
    return mx_dequantize_torch(codes, scales, block=32, elem="e4m3")


def write_index_cache_ref(k, slot_mapping, codes_cache, scales_cache, rounding: str = "floor") -> None:
    """Quantize k [N, D] to MXFP8 and write token n at flat slot slot_mapping[n] (slots < 0 are skipped)."""
    codes, scales = mxfp8_quantize_ref(k, rounding)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    codes_cache.view(-1, codes_cache.shape[-1])[slots] = codes[keep]
    scales_cache.view(-1, scales_cache.shape[-1])[slots] = scales[keep]


def gather_paged(cache, block_table_row, length: int):
    """Rows [length, ...] of one sequence from a paged cache [num_blocks, block_size, ...]."""
    import torch

    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table_row.long()[pos // bs]
    return cache[blocks, pos % bs]


# ---------------------------------------------------------------- torch twins: the oracle of the kernels
def _topk_rows(scores, lengths: list[int], topk: int):
    import torch

    R = scores.shape[0]
    idx = torch.full((R, topk), -1, dtype=torch.int32)
    val = torch.full((R, topk), MASKED, dtype=torch.float64)
    for r in range(R):
        n = min(topk, lengths[r])
        if n == 0:
            continue
        v, i = torch.topk(scores[r, : lengths[r]], n)
        idx[r, :n] = i.to(torch.int32)
        val[r, :n] = v
    return idx, val


def indexer_scores_ref(q, w, k):
    """q [H, D], w [H], k [L, D] -> scores [L] float64."""
    logits = k.double() @ q.double().T  # [L, H]
    return (logits.clamp_min(0) * w.double()[None, :]).sum(-1)


def indexer_topk_decode_ref(q, w, k_codes, k_scales, block_table, context_lens, topk: int = 2048,
                            return_all_scores: bool = False):
    """q [B, H, D] (bf16/float), w [B, H] -> (indices [B, topk] int32, scores [B, topk] float64) [+ full scores]."""
    import torch

    q, w = q.cpu(), w.cpu()
    lens = [int(x) for x in context_lens.cpu()]
    B = q.shape[0]
    Lmax = max(lens) if lens else 0
    full = torch.full((B, max(Lmax, 1)), MASKED, dtype=torch.float64)
    codes, scales, bt = k_codes.cpu(), k_scales.cpu(), block_table.cpu()
    for b in range(B):
        if lens[b] == 0:
            continue
        k = mxfp8_dequantize_ref(gather_paged(codes, bt[b], lens[b]), gather_paged(scales, bt[b], lens[b]))
        full[b, : lens[b]] = indexer_scores_ref(q[b], w[b], k)
    idx, val = _topk_rows(full, lens, topk)
    return (idx, val, full) if return_all_scores else (idx, val)


def indexer_topk_prefill_ref(q, w, k_codes, k_scales, block_table_row, start_pos: int, topk: int = 2048,
                             return_all_scores: bool = False):
    """Causal prefill: q [T, H, D], w [T, H]; query t sees positions s <= start_pos + t of the one sequence."""
    import torch

    T = q.shape[0]
    L = start_pos + T
    k = mxfp8_dequantize_ref(gather_paged(k_codes.cpu(), block_table_row.cpu(), L),
                             gather_paged(k_scales.cpu(), block_table_row.cpu(), L))
    logits = torch.einsum("ld,thd->tlh", k, q.cpu().double())
    full = (logits.clamp_min(0) * w.cpu().double()[:, None, :]).sum(-1)  # [T, L]
    lens = [start_pos + t + 1 for t in range(T)]
    causal = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
    full = full.masked_fill(~causal, MASKED)
    idx, val = _topk_rows(full, lens, topk)
    return (idx, val, full) if return_all_scores else (idx, val)


def check_topk(idx, val, full_ref, lengths, topk: int, rtol: float = 1e-3) -> dict:
    """Compare a kernel's (indices, scores) with the float64 scores as sets up to ties.

    Per row: exactly min(topk, len) valid, distinct, in-range indices then -1 padding; every selected index has
    ref score >= (k-th largest ref score) - tol, with tol = rtol * max|ref score| of the row (ties and the bf16
    query leave near-equal scores interchangeable); returned scores match the ref scores at those indices to tol.
    Returns {"ok": bool, "max_rank_violation": float, "max_score_err": float, "bad_rows": [...]}.
    """
    import torch

    idx, val, full_ref = idx.cpu().long(), val.cpu().double(), full_ref.cpu().double()
    bad, worst_gap, worst_err = [], 0.0, 0.0
    for r in range(idx.shape[0]):
        L = int(lengths[r])
        n = min(topk, L)
        row = idx[r]
        sel, pad = row[:n], row[n:]
        ok = bool((pad == -1).all()) and bool(((sel >= 0) & (sel < L)).all()) and sel.unique().numel() == n
        if n and ok:
            ref = full_ref[r, :L]
            tol = rtol * float(ref.abs().max().clamp_min(1e-30))
            kth = float(torch.topk(ref, n).values[-1])
            gap = max(0.0, kth - float(ref[sel].min()))
            err = float((val[r, :n] - ref[sel]).abs().max())
            worst_gap, worst_err = max(worst_gap, gap / tol), max(worst_err, err / tol)
            ok = gap <= tol and err <= tol
        if not ok:
            bad.append(r)
    return {"ok": not bad, "max_rank_violation": worst_gap, "max_score_err": worst_err, "bad_rows": bad[:8]}


# ---------------------------------------------------------------- eager unfused baseline (timed, and torch.compile'd)
def indexer_topk_decode_eager(q, w, k_codes, k_scales, block_table, context_lens, topk: int = 2048,
                              max_context_len: int | None = None):
    """Eager unfused bf16: gather pages, dequantize to bf16, bmm, relu, weight, head-sum, mask, torch.topk."""
    import torch

    B, H, D = q.shape
    bs = k_codes.shape[1]
    L = max_context_len if max_context_len is not None else block_table.shape[1] * bs
    nblk = (L + bs - 1) // bs
    bt = block_table[:, :nblk].long()
    codes = k_codes[bt].reshape(B, nblk * bs, D)[:, :L]  # [B, L, D]
    scales = k_scales[bt].reshape(B, nblk * bs, -1)[:, :L]
    s = torch.exp2(scales.float() - 127.0)
    k = (codes.view(torch.float8_e4m3fn).float().reshape(B, L, -1, 32) * s[..., None]).reshape(B, L, D).bfloat16()
    logits = torch.bmm(k, q.transpose(1, 2))  # [B, L, H]
    scores = (logits.float().relu() * w[:, None, :].float()).sum(-1)
    pos = torch.arange(L, device=q.device)
    scores = scores.masked_fill(pos[None, :] >= context_lens[:, None], MASKED)
    vals, idx = torch.topk(scores, min(topk, L), dim=-1)
    idx = torch.where(vals <= MASKED, torch.full_like(idx, -1), idx)
    return idx.int(), vals
