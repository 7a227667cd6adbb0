"""Torch references for sparse MLA (absorbed, MQA over the 576-wide latent) on the FP8 tile-128 latent cache.

Cache row (656 bytes/token, FlashMLA "fp8 with scale", optimizations.md §3.4): bytes [0, 512) E4M3FN codes of c_kv,
[512, 528) four float32 scales (one per 128-element tile, power of two 2^ceil(log2(max(amax, 1e-4) / 448))),
[528, 656) 64 bf16 k_pe values. The cache is paged: [num_blocks, block_size, 656] uint8 plus a block table.

Attention for query row r (decode: one row per sequence; prefill: one row per query token): over the selected
positions idx[r, :] (token positions within the sequence; -1 = unused),
    score_j = (q[r, :, :512] . c_kv_j + q[r, :, 512:] . k_pe_j) * sm_scale,  p = softmax_j(score),
    out[r] = sum_j p_j c_kv_j  -> [H, 512].
A row with no valid index outputs zeros.
"""

from __future__ import annotations

import torch

D_LATENT, D_PE, ROW_BYTES = 512, 64, 656
E4M3_MAX = 448.0


def mla_fp8_quantize_ref(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """c_kv [N, 512], k_pe [N, 64] (finite) -> rows [N, 656] uint8 (ue8m0 tile scales, exact exponent rule)."""
    N = c_kv.shape[0]
    xb = c_kv.float().reshape(N, 4, 128)
    amax = xb.abs().amax(-1).clamp_min(1e-4)
    m, ex = torch.frexp(amax.double())
    e = ex.long() - 1 - 8 + (2 * m > 1.75).long()  # smallest e with amax <= 448 * 2^e
    scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), e.double()).float()
    codes = (xb / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty(N, ROW_BYTES, dtype=torch.uint8, device=c_kv.device)
    out[:, :512] = codes.reshape(N, 512)
    out[:, 512:528] = scale.contiguous().view(torch.uint8).reshape(N, 16)
    out[:, 528:] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(N, 128)
    return out


def mla_fp8_dequantize_ref(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., 656] uint8 -> (c_kv float64 [..., 512], k_pe float64 [..., 64])."""
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
