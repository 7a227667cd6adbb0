"""FlashKDA's sm90 chunked KDA forward (flash_kda.fwd): the gated delta rule over chunks of 16 with its own L2 norm
of q and k, safe gate and beta sigmoid, head dim 128, bf16 in and out.

Inputs as flash_kda.fwd takes them: q, k, v, g [B, T, H, 128] bf16 (q, k before the L2 norm; g the gate before
activation: g = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h])), natural log), beta [B, T, H] bf16 logits,
A_log [H] fp32, dt_bias [H, 128] fp32, scale (q's), states [N, H, V, K] bf16 or fp32 (ours are [B, H, K, V]: pass
state.transpose(-1, -2).contiguous()), cu_seqlens [N + 1] int64 with B == 1 for packed sequences. This is the
math of our kimi.KDA (plugins/kda/__init__.py) between the convolutions and the output norm.
"""

from __future__ import annotations

import torch

from . import call, lib, ptr, stream


def flashkda_prefill(q, k, v, g, beta, scale: float, A_log, dt_bias, lower_bound: float, initial_state=None,
                     final_state=None, cu_seqlens=None, out=None, workspace=None) -> torch.Tensor:
    """out [B, T, H, 128] bf16 (and final_state written in place when given). beta is transposed to [H, B*T] in the
    call, as flash_kda.fwd does; `workspace` (uint8, flashkda_workspace_bytes) may be reused across calls."""
    b, t, h, d = q.shape
    if d != 128 or any(x.dtype != torch.bfloat16 for x in (q, k, v, g, beta)):
        raise ValueError(f"flashkda: q, k, v, g [B, T, H, 128] and beta [B, T, H] bf16; got q {tuple(q.shape)}")
    if cu_seqlens is not None and (b != 1 or cu_seqlens.dtype != torch.int64):
        raise ValueError("flashkda: cu_seqlens int64 [N + 1] needs B == 1")
    n = cu_seqlens.numel() - 1 if cu_seqlens is not None else b
    states = [s for s in (initial_state, final_state) if s is not None]
    if any(s.shape != (n, h, d, d) or not s.is_contiguous() for s in states) or len({s.dtype for s in states}) > 1:
        raise ValueError(f"flashkda: states [N, H, V, K] contiguous, one dtype; N = {n}")
    out = torch.empty_like(v) if out is None else out
    workspace = torch.empty(flashkda_workspace_bytes(b * t, h, n), dtype=torch.uint8, device=q.device) \
        if workspace is None else workspace
    beta_t = beta.reshape(b * t, h).t().contiguous()
    fp32 = int(bool(states) and states[0].dtype == torch.float32)
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    a_log, dt_bias = A_log.float().contiguous(), dt_bias.float().contiguous()  # held until the launch is queued
    if a_log.shape != (h,) or dt_bias.shape != (h, d) or out.shape != v.shape or not out.is_contiguous():
        raise ValueError(f"flashkda: A_log [H], dt_bias [H, 128], out like v contiguous; got {tuple(a_log.shape)}, "
                         f"{tuple(dt_bias.shape)}, {tuple(out.shape)}")
    call("flashkda", "flashkda_fwd", ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta_t), scale, ptr(out), ptr(workspace),
         ptr(a_log), ptr(dt_bias), lower_bound, ptr(initial_state),
         ptr(final_state), fp32, ptr(cu_seqlens), n, b, t, h, stream())
    return out


def flashkda_workspace_bytes(t_total: int, h: int, n: int = 1) -> int:
    return lib("flashkda").flashkda_workspace_size(t_total, h, n)
