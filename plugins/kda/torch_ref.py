"""Torch references for KDA (Kimi Delta Attention): recurrent step, sequential scan, fused prefill pre/post work.

State S [B, H, Dk, Dv] float32 (fla's K-first layout). Per step (optimizations.md §1.1, fla naive_recurrent_kda):
    S = diag(exp(g_t)) S;  S = S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t)
q, k are L2-normalised and q scaled by Dk^-0.5 upstream unless the fused paths below do it.

Fused prefill pre-work (kimi_k3_spec.md §2.4): per channel causal depthwise conv, kernel 4, no bias, zero history,
y[t, c] = silu(sum_j w[c, j] x[t - 3 + j, c]); q, k = L2norm(y) per head (eps 1e-6 inside the sqrt), q *= scale;
g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, :])); beta = sigmoid(b).
Post-work: out = RMSNorm_D(o) * weight * sigmoid(gate) per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_step_ref(q, k, v, g, beta, state, scale: float = 1.0):
    """One step, float64 math on copies. q,k,v,g [B, H, D], beta [B, H], state [B, H, K, V] -> (o [B,H,V], new state)."""
    S = state.double().clone()
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    S = S * torch.exp(g)[..., None]
    u = (v - torch.einsum("bhkv,bhk->bhv", S, k)) * beta[..., None]
    S = S + k[..., None] * u[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", S, q * scale)
    return o, S


def kda_recurrent_ref(q, k, v, g, beta, initial_state=None, scale: float = 1.0):
    """Sequential scan. q,k,v,g [B, T, H, D], beta [B, T, H] -> (o float64 [B, T, H, V], final state float64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=torch.float64, device=q.device) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        o, S = kda_step_ref(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, scale)
        outs.append(o)
    return torch.stack(outs, 1), S


def kda_gate_ref(f, A_log, dt_bias, lower_bound: float):
    """f [B, T, H, D] -> g float32 = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, :]))."""
    H, D = f.shape[-2:]
    return lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * (f.float() + dt_bias.float().view(H, D)))


def short_conv_silu_ref(x, w):
    """x [B, T, C], w [C, 4] -> silu(causal depthwise conv) float32, zero history."""
    C = x.shape[-1]
    y = F.conv1d(F.pad(x.float().transpose(1, 2), (3, 0)), w.float()[:, None, :], groups=C)
    return F.silu(y).transpose(1, 2)


def l2norm_ref(x, eps: float = 1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_prefill_preprocess_ref(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, lower_bound=-5.0, scale=None):
    """Projection outputs -> (q, k, v, g, beta) float32 ready for the delta rule. x* [B, T, H*D], f [B, T, H*D], b [B, T, H]."""
    B, T, H = b.shape
    D = xq.shape[-1] // H
    scale = D ** -0.5 if scale is None else scale
    q = l2norm_ref(short_conv_silu_ref(xq, wq).view(B, T, H, D)) * scale
    k = l2norm_ref(short_conv_silu_ref(xk, wk).view(B, T, H, D))
    v = short_conv_silu_ref(xv, wv).view(B, T, H, D)
    g = kda_gate_ref(f.view(B, T, H, D), A_log, dt_bias, lower_bound)
    return q, k, v, g, torch.sigmoid(b.float())


def kda_output_norm_ref(o, gate, weight, eps: float = 1e-5):
    """o [B, T, H, D], gate [B, T, H*D] -> RMSNorm_D(o) * weight * sigmoid(gate), float32 [B, T, H*D]."""
    B, T, H, D = o.shape
    o = o.float()
    y = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float().view(B, T, H, D))).reshape(B, T, H * D)


def kda_prefill_fused_ref(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, gate, o_weight, lower_bound=-5.0,
                          scale=None, eps: float = 1e-5, initial_state=None):
    q, k, v, g, beta = kda_prefill_preprocess_ref(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, lower_bound, scale)
    o, S = kda_recurrent_ref(q, k, v, g, beta, initial_state, scale=1.0)
    return kda_output_norm_ref(o, gate, o_weight, eps), S


# eager unfused baselines (bench): the same math as separate torch ops
def kda_decode_eager(q, k, v, g, beta, state, scale: float = 1.0):
    """In-place eager step in float32: 6 separate kernels or so. Returns o [B, H, V] (dtype of v)."""
    state.mul_(torch.exp(g.float())[..., None])
    u = (v.float() - torch.einsum("bhkv,bhk->bhv", state, k.float())) * beta.float()[..., None]
    state.add_(k.float()[..., None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q.float() * scale).to(v.dtype)
