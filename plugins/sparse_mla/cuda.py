"""cuda backend kernel for kimi.SparseMLA: absorbed MLA over the selected positions of the paged latent cache.

Default on the GPU: the Triton kernel (plugins/sparse_mla/triton.py) over the quantized latent layout the quantize
pass writes (E4M3 codes [NB,BS,512] + one E8M0 scale byte per 128-value tile [NB,BS,4] + the 64 RoPE dims kept in
bf16 [NB,BS,64]), with the absorbed projections (q_nope . W_UK, o_lat . W_UV^T) as batched GEMMs around it.
Fallback (other layouts and sizes, the CPU): the op's definition in torch over the gathered rows.
"""

from __future__ import annotations

import torch

from kimi_compile.lowering import FP8_CAPABILITY, Kernel

HEAD_BLOCK = 64  # the Triton kernel's heads per program


def _rows(pool: torch.Tensor, bt: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows [B, T, k, D] of a paged pool at sequence positions idx [B, T, k] (-1 -> row 0 of the null block)."""
    BS = pool.shape[1]
    safe = idx.clamp_min(0)
    blk = torch.gather(bt, 1, (safe // BS).reshape(bt.shape[0], -1)).reshape(idx.shape)
    flat = (blk * BS + safe % BS).reshape(-1)
    raw = pool.view(torch.uint8) if pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else pool
    rows = raw.reshape(-1, pool.shape[-1]).index_select(0, flat).reshape(*idx.shape, pool.shape[-1])
    return rows.view(pool.dtype)


def _dequant(codes: torch.Tensor, scale: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    from kimi_compile.plugins.quant.cuda import _scale_e8m0

    s = _scale_e8m0(scale) if fmt == "mxfp8" else scale.float()
    c = codes.view(torch.float8_e4m3fn) if codes.dtype == torch.uint8 else codes
    return (c.float().reshape(*c.shape[:-1], -1, group) * s.unsqueeze(-1)).reshape(c.shape)


def sparse_mla_torch(x, a):
    q_nope, q_pe, kv_pool, bt, idx, w_uk, w_uv = x[:7]
    scale_pool, rope_pool, rope_scale_pool = (list(x[7:]) + [None, None, None])[:3]
    R = int(a["kv_lora_rank"])
    if a["kv_format"] == "float":
        rows = _rows(kv_pool, bt, idx).float()
        c, pe = rows[..., :R], rows[..., R:]
    else:
        c = _dequant(_rows(kv_pool, bt, idx), _rows(scale_pool, bt, idx), a["kv_format"], a["tile"])
        pe = _rows(rope_pool, bt, idx)
        pe = pe.float() if a["rope_format"] == "float" else _dequant(pe, _rows(rope_scale_pool, bt, idx),
                                                                       a["rope_format"], a["rope_tile"])
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_uk.float())
    s = (torch.einsum("bthr,btkr->bthk", q_lat, c) + torch.einsum("bthd,btkd->bthk", q_pe.float(), pe)) * a["scale"]
    s = torch.where((idx >= 0).unsqueeze(2), s, torch.full_like(s, float("-inf")))
    p = torch.softmax(s, -1)
    o_lat = torch.einsum("bthk,btkr->bthr", p, c)
    return (torch.einsum("bthr,hvr->bthv", o_lat, w_uv.float()).to(q_nope.dtype),)


def _triton_supports(values, attrs) -> str | None:
    from kimi_compile.plugins.sparse_mla import triton as tk

    if attrs.get("kv_format") != "mxfp8" or attrs.get("tile") != 128 or attrs.get("rope_format") != "float":
        return "the Triton kernel reads E4M3 codes with one E8M0 scale per 128 values and a bf16 RoPE pool"
    dr = values[1].shape[-1] if values[1] is not None and values[1].shape is not None else None
    if attrs.get("kv_lora_rank") != 512 or (isinstance(dr, int) and dr != 64):
        return "the Triton kernel is built for kv_lora_rank 512 and 64 RoPE dims"
    if values[8] is None or values[8].dtype is None or values[8].dtype.name != "BFLOAT16":
        return "the Triton kernel reads the RoPE pool in bf16"
    if getattr(tk, "triton", None) is None:
        return "triton is not installed"
    return None


def sparse_mla_triton(x, a):
    from kimi_compile.plugins.sparse_mla.triton import sparse_mla

    q_nope, q_pe, codes, bt, idx, w_uk, w_uv, scales, rope = x[:9]
    B, T, H, _ = q_nope.shape
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk.to(q_nope.dtype))
    q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], -1).to(torch.bfloat16)
    Hp = -(-H // HEAD_BLOCK) * HEAD_BLOCK  # the kernel works on blocks of 64 heads: pad (the KV bytes read are
    if Hp != H:                             # the same; the padded heads' scores are discarded)
        q = torch.cat([q, q.new_zeros(B, T, Hp - H, q.shape[-1])], 2)
    o_lat = sparse_mla(q, codes.view(torch.uint8), scales, rope, bt, idx, float(a["scale"]))[:, :, :H]
    return (torch.einsum("bthr,hvr->bthv", o_lat.to(q_nope.dtype), w_uv.to(q_nope.dtype)),)


CUDA = {
    "SparseMLA": Kernel(sparse_mla_triton, supports=_triton_supports, devices=("cuda",), name="triton.sparse_mla",
                        min_capability=FP8_CAPABILITY,
                        fallback=Kernel(sparse_mla_torch, devices=("cuda", "cpu"), name="torch.sparse_mla")),
}
