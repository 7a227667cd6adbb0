"""kimi.KDA (Kimi Delta Attention): the one oracle, as a numpy twin (the whole op, as its ONNX body computes it) and
torch twins (the recurrent step, the sequential scan, and the fused prefill pre/post work that the GPU kernels run).

Contract shared by both twins: the recurrent state S is [B, H, Dk, Dv] float32 (fla's K-first layout), g is the log
decay per key channel, and one step is
    S = diag(exp(g_t)) S;  S = S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale * q_t);
outputs come in the order (output, state): the numpy twin `kda` returns the op's (out, new_conv_state, new_state),
the torch twins (o, final state). Padding rows (t >= lengths[b]) leave the state untouched (g = beta = 0); no
masking value is visible in any output. The numpy twin computes in fp64 and returns float32; the torch `*_ref`
twins compute in float64 (the step and the scan) or float32 (the fused pre/post pieces). `kda_decode_eager` is the
unfused baseline that bench/gpu_kernels.py times.

Torch twins: q, k are L2-normalised and q scaled by Dk^-0.5 upstream unless the fused paths below do it (fla
naive_recurrent_kda, optimizations.md §1.1). Fused prefill pre-work (kimi_k3_spec.md §2.4): per channel causal
depthwise conv, kernel 4, no bias, zero history, y[t, c] = silu(sum_j w[c, j] x[t - 3 + j, c]); q, k = L2norm(y) per
head (eps 1e-6 inside the sqrt), q *= scale; g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, :]));
beta = sigmoid(b). Post-work: out = RMSNorm_D(o) * weight * sigmoid(gate) per head.
Torch is imported inside the torch twins only, so the numpy twin (and the op registry) never imports it.
"""

from __future__ import annotations

import numpy as np


# ---------------------------------------------------------------- numpy twin: the registered reference of the op
def kda(x, conv_state, state, lengths, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b, w_b, w_g, A_log, dt_bias,
        o_norm, w_o, lower_bound=-5.0, scale=1.0, l2_eps=1e-6, eps=1e-5, chunk_size=0):
    """kimi.KDA in numpy, fp64 (the recurrence step by step; chunk_size does not change the math)."""
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    x, conv_state, S = f64(x), f64(conv_state), f64(state).copy()
    B, T, _ = x.shape
    H, D = np.size(A_log), np.size(o_norm)
    P, W = H * D, np.shape(conv_q)[-1]
    u = np.concatenate([x @ f64(w_q), x @ f64(w_k), x @ f64(w_v)], axis=-1)
    cat = np.concatenate([conv_state, u], axis=1)  # [B, W-1+T, 3P]
    cw = np.concatenate([f64(conv_q), f64(conv_k), f64(conv_v)], axis=0)[:, 0, :]  # [3P, W]
    y = sum(cat[:, j:j + T] * cw[:, j] for j in range(W))
    y = y / (1.0 + np.exp(-y))
    y = y.reshape(B, T, 3, H, D)
    q, k, v = y[:, :, 0], y[:, :, 1], y[:, :, 2]
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + l2_eps) * scale
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + l2_eps)
    f = (x @ f64(w_f_a) @ f64(w_f_b)).reshape(B, T, H, D) + f64(dt_bias).reshape(H, D)
    g = lower_bound / (1.0 + np.exp(-np.exp(f64(A_log)).reshape(H, 1) * f))
    beta = 1.0 / (1.0 + np.exp(-(x @ f64(w_b))))
    valid = (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)
    g, beta = g * valid[:, :, None, None], beta * valid[:, :, None]
    o = np.zeros((B, T, H, D))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None]
        kv = np.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + k[:, t][..., None] * ((v[:, t] - kv) * beta[:, t][..., None])[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    on = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * f64(o_norm)
    gate = 1.0 / (1.0 + np.exp(-(x @ f64(w_g)).reshape(B, T, H, D)))
    out = (on * gate).reshape(B, T, P) @ f64(w_o)
    rows = np.asarray(lengths)[:, None] + np.arange(W - 1)[None, :]
    new_conv = np.take_along_axis(cat, rows[:, :, None], axis=1)
    return out.astype(np.float32), new_conv.astype(np.float32), S.astype(np.float32)


# ---------------------------------------------------------------- torch twins: the oracle of the kernels
def kda_step_ref(q, k, v, g, beta, state, scale: float = 1.0):
    """One step, float64 math on copies. q,k,v,g [B, H, D], beta [B, H], state [B, H, K, V] -> (o [B,H,V], new state)."""
    import torch

    S = state.double().clone()
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    S = S * torch.exp(g)[..., None]
    u = (v - torch.einsum("bhkv,bhk->bhv", S, k)) * beta[..., None]
    S = S + k[..., None] * u[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", S, q * scale)
    return o, S


def kda_recurrent_ref(q, k, v, g, beta, initial_state=None, scale: float = 1.0):
    """Sequential scan. q,k,v,g [B, T, H, D], beta [B, T, H] -> (o float64 [B, T, H, V], final state float64)."""
    import torch

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
    import torch

    H, D = f.shape[-2:]
    return lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * (f.float() + dt_bias.float().view(H, D)))


def short_conv_silu_ref(x, w):
    """x [B, T, C], w [C, 4] -> silu(causal depthwise conv) float32, zero history."""
    import torch.nn.functional as F

    C = x.shape[-1]
    y = F.conv1d(F.pad(x.float().transpose(1, 2), (3, 0)), w.float()[:, None, :], groups=C)
    return F.silu(y).transpose(1, 2)


def l2norm_ref(x, eps: float = 1e-6):
    import torch

    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_prefill_preprocess_ref(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, lower_bound=-5.0, scale=None):
    """Projection outputs -> (q, k, v, g, beta) float32 ready for the delta rule. x* [B, T, H*D], f [B, T, H*D], b [B, T, H]."""
    import torch

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
    import torch

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
    import torch

    state.mul_(torch.exp(g.float())[..., None])
    u = (v.float() - torch.einsum("bhkv,bhk->bhv", state, k.float())) * beta.float()[..., None]
    state.add_(k.float()[..., None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q.float() * scale).to(v.dtype)
