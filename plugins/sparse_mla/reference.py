"""kimi.SparseMLA: the one oracle, as a numpy twin (the op, as its ONNX body computes it) and torch twins (the GPU
kernels' decode and prefill entry points over the FP8 latent cache).

Contract shared by both twins: one output, o, the attention over the selected positions only; an index -1 selects
nothing; a query row with no valid index outputs zeros (no masking value is visible in the output). Scores are
(q_lat . c_j + q_pe . pe_j) * scale, p = softmax over the selected j, o = sum_j p_j c_j (then . w_uv^T in the op).
The numpy twin `sparse_mla` is the registered reference (absorbed form with w_uk / w_uv, any kv_format, float32
output computed in fp64). The torch twins `*_ref` compute in float64 on the kernels' cache layout and return the
latent output [.., H, 512]; `sparse_mla_decode_eager` is the unfused bf16 baseline that bench/gpu_kernels.py times.

Torch-twin cache row (656 bytes/token, FlashMLA "fp8 with scale", optimizations.md §3.4): bytes [0, 512) E4M3FN
codes of c_kv, [512, 528) four float32 scales (one per 128-element tile, power of two
2^ceil(log2(max(amax, 1e-4) / 448))), [528, 656) 64 bf16 k_pe values. The cache is paged: [num_blocks, block_size,
656] uint8 plus a block table. Attention for query row r (decode: one row per sequence; prefill: one row per query
token) runs over the selected positions idx[r, :] (token positions within the sequence; -1 = unused):
    score_j = (q[r, :, :512] . c_kv_j + q[r, :, 512:] . k_pe_j) * sm_scale,  p = softmax_j(score),
    out[r] = sum_j p_j c_kv_j  -> [H, 512].
Torch is imported inside the torch twins only, so the numpy twin (and the op registry) never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kimi_compile.plugins.quant.reference import fp8_tile_dequantize, fp8_tile_quantize_torch, mx_dequantize

if TYPE_CHECKING:
    import torch

D_LATENT, D_PE, ROW_BYTES = 512, 64, 656


# ---------------------------------------------------------------- numpy twin: the registered reference of the op
def _dequant(fmt, codes, scale, tile, elem):
    if fmt == "float":
        return np.asarray(codes, dtype=np.float32)
    if fmt == "mxfp8":
        return mx_dequantize(codes, scale, block=tile, elem=elem)
    return fp8_tile_dequantize(codes, scale, tile=tile)


def sparse_mla(q_nope, q_pe, kv_pool, block_table, indices, w_uk, w_uv, kv_scale_pool=None, kv_rope_pool=None,
               kv_rope_scale_pool=None, *, scale: float, kv_lora_rank: int, kv_format: str = "float",
               rope_format: str = "float", elem: str = "e4m3", tile: int = 128, rope_tile: int = 128):
    """kimi.SparseMLA in numpy, fp64, one (b, t, head) at a time."""
    if kv_format != "float":
        kv_pool = np.concatenate([_dequant(kv_format, kv_pool, kv_scale_pool, tile, elem),
                                  _dequant(rope_format, kv_rope_pool, kv_rope_scale_pool, rope_tile, elem)], -1)
    B, T, H, _ = q_nope.shape
    BS, C = kv_pool.shape[1], kv_pool.shape[2]
    R = kv_lora_rank
    keys = kv_pool[block_table.reshape(-1)].reshape(B, -1, C).astype(np.float64)
    o = np.zeros((B, T, H, w_uv.shape[1]))
    for b in range(B):
        for t in range(T):
            sel = [int(j) for j in indices[b, t] if j >= 0]
            if not sel:
                continue
            rows = keys[b, sel]
            for h in range(H):
                q_lat = q_nope[b, t, h].astype(np.float64) @ w_uk[h]
                s = (rows[:, :R] @ q_lat + rows[:, R:] @ q_pe[b, t, h]) * scale
                p = np.exp(s - s.max())
                p /= p.sum()
                o[b, t, h] = w_uv[h] @ (p @ rows[:, :R])
    return o.astype(np.float32)


# ---------------------------------------------------------------- torch twins: the oracle of the kernels
def mla_fp8_quantize_ref(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """c_kv [N, 512], k_pe [N, 64] (finite) -> rows [N, 656] uint8: c_kv by plugins/quant/reference.py's FP8 tile
    quantizer (tile 128, ue8m0: power-of-two float32 scales, exact exponent rule), k_pe as bf16."""
    import torch

    N = c_kv.shape[0]
    codes, scale = fp8_tile_quantize_torch(c_kv, tile=128, scale_fmt="ue8m0")
    out = torch.empty(N, ROW_BYTES, dtype=torch.uint8, device=c_kv.device)
    out[:, :512] = codes.reshape(N, 512)
    out[:, 512:528] = scale.contiguous().view(torch.uint8).reshape(N, 16)
    out[:, 528:] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(N, 128)
    return out


def mla_fp8_dequantize_ref(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., 656] uint8 -> (c_kv float64 [..., 512], k_pe float64 [..., 64])."""
    import torch

    shp = rows.shape[:-1]
    rows = rows.reshape(-1, ROW_BYTES).contiguous()
    codes = rows[:, :512].contiguous().view(torch.float8_e4m3fn).double().reshape(-1, 4, 128)
    scale = rows[:, 512:528].contiguous().view(torch.float32).double()
    c_kv = (codes * scale[..., None]).reshape(*shp, 512)
    k_pe = rows[:, 528:].contiguous().view(torch.bfloat16).double().reshape(*shp, 64)
    return c_kv, k_pe


def write_mla_cache_ref(c_kv, k_pe, slot_mapping, kv_cache) -> None:
    rows = mla_fp8_quantize_ref(c_kv, k_pe)
    keep = slot_mapping >= 0
    kv_cache.view(-1, ROW_BYTES)[slot_mapping[keep].long()] = rows[keep]


def _attend_rows(q, kv_cache, block_table, row_seq, indices, sm_scale):
    import torch

    q, kv, bt, idx = q.cpu().double(), kv_cache.cpu(), block_table.cpu().long(), indices.cpu().long()
    R, H, _ = q.shape
    bs = kv.shape[1]
    out = torch.zeros(R, H, 512, dtype=torch.float64)
    for r in range(R):
        sel = idx[r][idx[r] >= 0]
        if sel.numel() == 0:
            continue
        seq = int(row_seq[r])
        rows = kv[bt[seq, sel // bs], sel % bs]
        c_kv, k_pe = mla_fp8_dequantize_ref(rows)
        s = (q[r, :, :512] @ c_kv.T + q[r, :, 512:] @ k_pe.T) * sm_scale  # [H, n]
        out[r] = torch.softmax(s, -1) @ c_kv
    return out


def sparse_mla_decode_ref(q, kv_cache, block_table, indices, sm_scale: float) -> torch.Tensor:
    """q [B, H, 576], indices [B, topk] positions in sequence b -> out float64 [B, H, 512]."""
    return _attend_rows(q, kv_cache, block_table, range(q.shape[0]), indices, sm_scale)


def sparse_mla_prefill_ref(q, kv_cache, block_table_row, indices, sm_scale: float) -> torch.Tensor:
    """q [T, H, 576], indices [T, topk] (each query token its own selected set) in one sequence -> [T, H, 512]."""
    return _attend_rows(q, kv_cache, block_table_row[None], [0] * q.shape[0], indices, sm_scale)


def sparse_mla_decode_eager(q, kv_cache, block_table, indices, sm_scale: float) -> torch.Tensor:
    """Eager unfused baseline: gather rows, dequantize to bf16, bf16 matmuls, fp32 softmax -> [B, H, 512] bf16."""
    import torch

    B, H, _ = q.shape
    bs = kv_cache.shape[1]
    valid = indices >= 0
    idx = indices.clamp_min(0).long()
    blk = torch.gather(block_table.long(), 1, idx // bs)
    rows = kv_cache.view(-1, ROW_BYTES)[blk * bs + idx % bs]  # [B, K, 656]
    codes = rows[..., :512].contiguous().view(torch.float8_e4m3fn).float().reshape(B, -1, 4, 128)
    scale = rows[..., 512:528].contiguous().view(torch.float32)
    c_kv = (codes * scale[..., None]).reshape(B, -1, 512).bfloat16()
    k_pe = rows[..., 528:].contiguous().view(torch.bfloat16)
    kfull = torch.cat([c_kv, k_pe], -1)  # [B, K, 576]
    s = torch.bmm(q, kfull.transpose(1, 2)).float() * sm_scale  # [B, H, K]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.bmm(p.bfloat16(), c_kv)
