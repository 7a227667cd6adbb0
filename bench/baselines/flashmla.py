"""FlashMLA's sm90 sparse FP8 decode (flash_mla_with_kvcache with indices and is_fp8_kvcache, V3.2 layout): absorbed
MLA of q [B, s_q, H, 576] bf16 (H 64 or 128) over topk cache rows per query, out [B, s_q, H, 512] bf16.

Their cache: [NB, BS, 1, 656] uint8 per token = 512 E4M3 codes of the latent, 4 fp32 scales (one per 128-wide tile),
64 bf16 rope values; rows of a block contiguous (656 bytes apart). Their indices: int32 global cache rows
(block * BS + row), -1 none, topk a multiple of 64. Ours (plugins/sparse_mla/triton.py): codes [NB, BS, 512],
E8M0 bytes [NB, BS, 4], rope [NB, BS, 64] bf16 and positions within a sequence through a block table; the E8M0 scales
are powers of two, so `to_flashmla_cache` is exact and both kernels attend over the same values.
"""

from __future__ import annotations

import torch

from . import call, lib, ptr, stream

BYTES_PER_TOKEN = 656


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(b - 127), exactly (0: 2^-127, a subnormal; 255: NaN)."""
    b = b.to(torch.int32)
    bits = torch.where(b == 0, 0x400000, torch.where(b == 255, 0x7FC00000, b << 23))
    return bits.view(torch.float32)


def to_flashmla_cache(codes: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Our latent pools (codes [NB, BS, 512] uint8/e4m3, E8M0 scales [NB, BS, 4] uint8, rope [NB, BS, 64] bf16) ->
    FlashMLA's V3.2 FP8 cache [NB, BS, 1, 656] uint8."""
    nb, bs = codes.shape[:2]
    kv = torch.empty(nb, bs, BYTES_PER_TOKEN, dtype=torch.uint8, device=codes.device)
    kv[..., :512] = codes.view(torch.uint8)
    kv[..., 512:528] = e8m0_to_float(scales).contiguous().view(torch.uint8)
    kv[..., 528:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return kv.unsqueeze(2)


def to_flashmla_indices(indices: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Our positions indices [B, T, k] (within sequence b, -1 none) -> FlashMLA's global rows [B, T, k] int32."""
    valid = indices >= 0
    pos = indices.clamp_min(0).long()
    blk = torch.gather(block_table.long(), 1, (pos // block_size).flatten(1)).view_as(pos)
    return torch.where(valid, blk * block_size + pos % block_size, -1).to(torch.int32).contiguous()


class FlashMLAPlan:
    """The split-KV schedule and workspaces for B x s_q queries of H heads over topk rows (get_mla_metadata): once
    per decode step in a model, shared by its layers."""

    def __init__(self, b: int, s_q: int, h_q: int, topk: int, device="cuda"):
        handle = lib("flashmla")
        self.shape = (b, s_q, h_q, topk)
        self.parts = handle.flashmla_num_sm_parts(h_q, s_q)
        if self.parts <= 0:
            raise RuntimeError(f"flashmla_num_sm_parts: {handle.flashmla_last_error().decode()}")
        i32, f32 = dict(dtype=torch.int32, device=device), dict(dtype=torch.float32, device=device)
        self.sched_meta = torch.empty(self.parts, handle.flashmla_sched_meta_ints(), **i32)
        self.num_splits = torch.empty(b + 1, **i32)
        self.lse_accum = torch.empty(b + self.parts, s_q, h_q, **f32)
        self.o_accum = torch.empty(b + self.parts, s_q, h_q, 512, **f32)
        call("flashmla", "flashmla_sparse_decode_plan", ptr(self.sched_meta), ptr(self.num_splits), b, s_q, topk,
             self.parts, stream())


def flashmla_plan(b: int, s_q: int, h_q: int, topk: int, device="cuda") -> FlashMLAPlan:
    return FlashMLAPlan(b, s_q, h_q, topk, device)


def flashmla_sparse_decode(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                           plan: FlashMLAPlan | None = None, out: torch.Tensor | None = None):
    """(out [B, s_q, H, 512] bf16, lse [B, s_q, H] fp32) of q [B, s_q, H, 576] bf16 over FlashMLA's cache kv
    [NB, BS, 1, 656] uint8 at global rows indices [B, s_q, topk] int32. Without `plan` the schedule is computed in
    the call (as flash_mla_with_kvcache does when given no metadata)."""
    b, s_q, h_q, d = q.shape
    topk = indices.shape[-1]
    nb, bs = kv.shape[:2]
    if d != 576 or kv.shape[-1] != BYTES_PER_TOKEN or kv.stride(1) != BYTES_PER_TOKEN or topk % 64:
        raise ValueError(f"flashmla: expects q [..., 576], kv [NB, BS, 1, 656] with contiguous rows, topk % 64 == 0; "
                         f"got q {tuple(q.shape)}, kv {tuple(kv.shape)} strides {kv.stride()}, topk {topk}")
    plan = plan or FlashMLAPlan(b, s_q, h_q, topk, q.device)
    if plan.shape != (b, s_q, h_q, topk):
        raise ValueError(f"flashmla: plan for {plan.shape}, call for {(b, s_q, h_q, topk)}")
    q, indices = q.contiguous(), indices.to(torch.int32).contiguous()
    out = torch.empty(b, s_q, h_q, 512, dtype=torch.bfloat16, device=q.device) if out is None else out
    lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=q.device)
    call("flashmla", "flashmla_sparse_decode", ptr(q), ptr(kv), ptr(indices), ptr(out), ptr(lse), ptr(plan.sched_meta),
         ptr(plan.num_splits), ptr(plan.lse_accum), ptr(plan.o_accum), b, s_q, h_q, nb, bs, topk,
         kv.stride(0) * kv.element_size(), sm_scale, plan.parts, stream())
    return out, lse
