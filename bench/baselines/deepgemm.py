"""DeepGEMM's sm90 paged FP8 MQA logits (fp8_paged_mqa_logits with get_paged_mqa_logits_metadata; the DeepSeek V3.2
indexer's scores): logits[b, s] = sum_h w[b, h] * relu(q[b, h] . k[s]) * scale[s] over the cache rows of sequence b
(positions s < context_lens[b]), 64 heads of dim 128, 64-token pages, next_n 1, fp32 logits. Top-k follows in torch.

Their inputs: q [B, 1, 64, 128] E4M3 without scale, weights [B, 64] fp32, a fused cache [NB, 64, 1, 132] uint8 (per
block: 64 x 128 E4M3 codes, then 64 fp32 per-token scales), block_table [B, MB] int32, context_lens [B, 1] int32.
Ours (plugins/indexer_topk/triton.py): q bf16 and an E8M0 scale per 32 dims of K. Both need requantizing, once,
outside timing: `to_deepgemm_cache` takes each token's largest group scale 2^e_max as its scale (exact for the codes
of that group, the other groups' values re-rounded to E4M3 at that scale, lossy only when their scale is far below);
`to_deepgemm_q` rounds q to E4M3 at a power-of-two scale per (token, head), folded into the weights (exact: relu
commutes with a positive scale). So DeepGEMM's logits differ from ours by those roundings (compare top-k overlap).
"""

from __future__ import annotations

import torch

from . import call, lib, ptr, stream
from .flashmla import e8m0_to_float

HEADS, HEAD_DIM, BLOCK_KV = 64, 128, 64


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:  # smallest power of two s with amax / s <= 448
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(1e-30) / 448.0)))


def to_deepgemm_cache(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Our index-K pools (codes [NB, 64, 128] uint8/e4m3, E8M0 bytes [NB, 64, 4], one per 32 dims) -> DeepGEMM's fused
    FP8 cache [NB, 64, 1, 132] uint8 with one fp32 scale per token (its largest group scale)."""
    nb, bs = codes.shape[:2]
    if bs != BLOCK_KV or codes.shape[-1] != HEAD_DIM:
        raise ValueError(f"deepgemm: needs 64-token pages of dim 128, got codes {tuple(codes.shape)}")
    group = e8m0_to_float(scales)                                        # [NB, BS, 4]
    vals = codes.view(torch.float8_e4m3fn).float().view(nb, bs, 4, 32) * group[..., None]
    tok = group.amax(-1)                                                 # [NB, BS] power of two
    requant = (vals.view(nb, bs, HEAD_DIM) / tok[..., None]).to(torch.float8_e4m3fn)
    fused = torch.empty(nb, bs * (HEAD_DIM + 4), dtype=torch.uint8, device=codes.device)
    fused[:, :bs * HEAD_DIM] = requant.view(torch.uint8).view(nb, -1)
    fused[:, bs * HEAD_DIM:] = tok.contiguous().view(torch.uint8).view(nb, -1)
    return fused.view(nb, bs, 1, HEAD_DIM + 4)


def to_deepgemm_q(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our q [B, 1, 64, 128] bf16 and weights [B, 1, 64] -> (q E4M3 [B, 1, 64, 128], weights fp32 [B, 64]) with a
    power-of-two scale per (token, head) moved from q into the weights."""
    b = q.shape[0]
    s = _pow2_scale(q.abs().amax(-1, keepdim=True))                     # [B, 1, H, 1]
    q8 = (q.float() / s).to(torch.float8_e4m3fn).contiguous()
    w = (weights.float().reshape(b, 1, HEADS) * s[..., 0]).reshape(b, HEADS).contiguous()
    return q8, w


def deepgemm_plan(context_lens: torch.Tensor) -> torch.Tensor:
    """get_paged_mqa_logits_metadata: the schedule [num_sms + 1, 2] int32 for context_lens [B] or [B, 1] int32."""
    lib("deepgemm")
    lens = context_lens.to(torch.int32).reshape(-1, 1).contiguous()
    sms = torch.cuda.get_device_properties(lens.device).multi_processor_count
    meta = torch.empty(sms + 1, 2, dtype=torch.int32, device=lens.device)
    call("deepgemm", "deepgemm_paged_mqa_logits_metadata", ptr(lens), ptr(meta), lens.shape[0], sms, stream())
    return meta


def deepgemm_paged_mqa_logits(q: torch.Tensor, kv: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                              block_table: torch.Tensor, schedule_meta: torch.Tensor, max_context_len: int,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_paged_mqa_logits(q, kv, weights, context_lens, block_table, schedule_meta, max_context_len,
    clean_logits=False): logits [B, max_context_len] fp32 (a view of a [B, stride] buffer; `out` reuses one).
    Positions at or past context_lens[b] are not cleaned: mask them before top-k when lengths differ."""
    b = q.shape[0]
    if q.shape[1:] != (1, HEADS, HEAD_DIM) or q.dtype != torch.float8_e4m3fn or kv.shape[1:] != (BLOCK_KV, 1, 132):
        raise ValueError(f"deepgemm: expects q [B, 1, 64, 128] e4m3 and kv [NB, 64, 1, 132] uint8, got q "
                         f"{tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)}")
    if kv.stride(1) != 132 or kv.stride(3) != 1 or weights.shape != (b, HEADS) or block_table.dtype != torch.int32 \
            or block_table.stride(1) != 1:
        raise ValueError("deepgemm: kv rows contiguous within a block, weights [B, 64], block_table int32 with "
                         "contiguous rows")
    stride = lib("deepgemm").deepgemm_logits_stride(max_context_len)
    out = torch.empty(b, stride, dtype=torch.float32, device=q.device) if out is None else out
    lens = context_lens.to(torch.int32).reshape(-1).contiguous()
    w32 = weights.float().contiguous()  # held until the launch is queued
    call("deepgemm", "deepgemm_fp8_paged_mqa_logits", ptr(q), ptr(kv), kv.shape[0], kv.stride(0) * kv.element_size(),
         ptr(w32), ptr(lens), ptr(out), stride, ptr(block_table), block_table.stride(0),
         ptr(schedule_meta), b, schedule_meta.shape[0] - 1, stream())
    return out[:, :max_context_len]
