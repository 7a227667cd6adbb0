"""kimi.SparseMLA: the one oracle, as a numpy twin (the op, as its ONNX body computes it) and a torch twin (the GPU
kernel's contract on the quantize pass's latent-cache pools).

Contract shared by both twins: one output, the attention over the selected positions only; an index -1 selects
nothing; a query row with no valid index outputs zeros (no masking value is visible in the output). Scores are
(q_lat . c_j + q_pe . pe_j) * scale, p = softmax over the selected j, o_lat = sum_j p_j c_j.
The numpy twin `sparse_mla` is the registered reference (absorbed form: q_lat = q_nope . w_uk, o = o_lat . w_uv^T;
any kv_format; float32 output computed in fp64). The torch twin `sparse_mla_pools_ref` computes o_lat in float64 on
the kernel's layout, which is the quantize pass's: three paged pools, c codes [NB, BS, 512] (E4M3 bytes), one E8M0
byte per 128 values [NB, BS, 4] (2^(b-127), the fp8_tile ue8m0 rule), RoPE dims [NB, BS, 64] (bf16); q_lat is
[B, T, H, 576] (the absorbed latent query then q_pe). The numpy twin reads the same pools with kv_format "mxfp8",
tile 128, rope_format "float" and identity W_UK / W_UV.
Torch is imported inside the torch twin only, so the numpy twin (and the op registry) never imports it.
"""

from __future__ import annotations

import numpy as np

from kimi_compile.plugins.quant.reference import fp8_tile_dequantize, mx_dequantize, mx_dequantize_torch


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


# ---------------------------------------------------------------- torch twin: the oracle of the kernel
def sparse_mla_pools_ref(q_lat, codes, scales, rope, block_table, indices, sm_scale: float):
    """q_lat [B, T, H, 576], codes [NB, BS, 512] uint8, scales [NB, BS, 4] uint8 (E8M0), rope [NB, BS, 64],
    block_table [B, MB], indices [B, T, k] (positions in sequence b, -1 = none) -> o_lat float64 [B, T, H, 512]."""
    import torch

    bs = codes.shape[1]
    c = mx_dequantize_torch(codes.cpu().reshape(-1, 512), scales.cpu().reshape(-1, 4), block=128)
    pe, q, bt, idx = rope.cpu().reshape(-1, 64).double(), q_lat.cpu().double(), block_table.cpu().long(), \
        indices.cpu().long()
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, 512, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            sel = idx[b, t][idx[b, t] >= 0]
            if sel.numel() == 0:
                continue
            rows = bt[b][sel // bs] * bs + sel % bs
            s = (q[b, t, :, :512] @ c[rows].T + q[b, t, :, 512:] @ pe[rows].T) * sm_scale  # [H, n]
            out[b, t] = torch.softmax(s, -1) @ c[rows]
    return out
