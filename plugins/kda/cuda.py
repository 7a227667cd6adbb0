"""cuda backend kernel for kimi.KDA (one whole KDA layer), composed from GEMMs, a depthwise conv over the carried
window, and the gated delta rule: on the GPU one token runs `decode_fused` (the projections, then three Triton
kernels from plugins/kda/triton.py: the pre-work, the decode step with the state updated in place, the output norm
and gate) and longer steps `prefill_fused` (the projections, the Triton pre-kernel, the chunked core: fla-core's
gate and intra-chunk kernels, then our fused state/output recurrence, the output norm-and-gate kernel); the torch
form (`prepare`, the recurrence, the torch post-work) where those kernels do not apply; on the CPU the reference
model's torch recurrences.

Padding rows (t >= lengths[b]) get g = 0 and beta = 0, so the state is untouched there, exactly as the op's
contract says; the conv window and the state are written in place (outputs 1 and 2 alias inputs 1 and 2).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kimi_compile.lowering import Kernel, out_slot

# (ids of the parts, dim) -> (weak references to the parts, their concatenation): made once per weight set (outside
# any CUDA-graph capture). Keyed by every part: a weight stored once may be a part of several sets (the artifact
# stores equal bytes once). A miss first drops the entries whose weights died (a session unloaded), so their
# concatenations do not outlive them, and an id reused by a new tensor never finds a stale entry
_FUSED: dict[tuple, tuple[tuple, torch.Tensor]] = {}


def _cat_once(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    key = (*map(id, parts), dim)
    hit = _FUSED.get(key)
    if hit is None or any(r() is not t for r, t in zip(hit[0], parts)):
        for k in [k for k, (refs, _) in _FUSED.items() if any(r() is None for r in refs)]:
            del _FUSED[k]
        hit = _FUSED[key] = (tuple(weakref.ref(t) for t in parts), torch.cat(parts, dim))
    return hit[1]


def fla_chunk_applies(dtype: torch.dtype) -> bool:
    """Whether fla-core's chunk_kda may run the chunked recurrence of activations of `dtype`. Not for float32: fla's
    kernels multiply float32 operands in TF32 (Triton's default dot precision), about 1e-3 relative error in
    kimi-k3-tiny's logits (docs/cuda_backend.md), ten times what a float32 graph promises; float32 takes the chunked
    form in torch (its GEMMs in FP32: the executor turns TF32 off)."""
    return dtype != torch.float32


def _recurrence(q, k, v, g, beta, state):
    """o [B,T,H,D]; state [B,H,D,D] fp32 updated in place."""
    T = q.shape[1]
    if state.is_cuda and T == 1:
        from kimi_compile.plugins.kda.triton import kda_decode_step

        o = kda_decode_step(q[:, 0].float(), k[:, 0].float(), v[:, 0].float(), g[:, 0].float(),
                            beta[:, 0].float(), state)
        return o.unsqueeze(1)
    if state.is_cuda and fla_chunk_applies(v.dtype):
        from fla.ops.kda import chunk_kda

        o, final = chunk_kda(q.to(v.dtype), k.to(v.dtype), v, g.float(), beta.float(), scale=1.0,
                             initial_state=state, output_final_state=True)
        state.copy_(final)
        return o
    from kimi_compile.model.primitives import kda_chunked, kda_recurrent

    o, S = kda_recurrent(q, k, v, g, beta, state) if T == 1 else kda_chunked(q, k, v, g, beta, state, 64)
    state.copy_(S)
    return o


def _output_projection(y: torch.Tensor, w_o: torch.Tensor, out) -> torch.Tensor:
    """y [B, T, P] @ w_o [P, N] in y's dtype, computed into the executor's slot for the op's output (out[0]) where
    it fits (the same GEMM on the rows folded, so the same numbers)."""
    w = w_o.to(y.dtype)
    dst = out_slot(out, 0, (*y.shape[:-1], w.shape[-1]), y.dtype)
    if dst is None:
        return y @ w
    torch.mm(y.reshape(-1, y.shape[-1]), w, out=dst.view(-1, w.shape[-1]))
    return dst


def kda(x, a, out=None):
    """kimi.KDA; out: the executor's slots (the output's, then None for the two caches updated in place)."""
    (h, conv_state, state, lengths, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b, w_b, w_g, A_log, dt_bias,
     o_norm, w_o) = x
    if h.is_cuda:
        res = decode_fused(x, a, out) if h.shape[1] == 1 else prefill_fused(x, a, out)
        if res is not None:
            return res
    q, k, v, g, beta = prepare(h, conv_state, lengths, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b, w_b,
                               A_log, dt_bias, a)
    B, T, _ = h.shape
    H, D = A_log.numel(), o_norm.numel()
    P, dt = H * D, h.dtype
    o = _recurrence(q, k, v, g, beta, state).float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + a["eps"]) * o_norm.float()
    gate = torch.sigmoid((h @ w_g.to(dt)).float().reshape(B, T, H, D))
    return _output_projection((o * gate).reshape(B, T, P).to(dt), w_o, out), conv_state, state


class _Layer(NamedTuple):
    """kimi.KDA's inputs, in the op's order."""
    h: torch.Tensor
    conv_state: torch.Tensor
    state: torch.Tensor
    lengths: torch.Tensor
    w_q: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    w_f_a: torch.Tensor
    w_f_b: torch.Tensor
    w_b: torch.Tensor
    w_g: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm: torch.Tensor
    w_o: torch.Tensor


def _fused_inputs(x: _Layer):
    """What both fused paths start from: the stacked conv weights [3P, 4] and, as empty tensors, the shapes the
    projections u [B, T, 3P], f [B, T, P] and b [B, T, H] will have (so a path is declined before any of them runs)."""
    B, T, _ = x.h.shape
    P = x.w_q.shape[1]
    cw = _cat_once([x.conv_q, x.conv_k, x.conv_v], 0)
    cw = cw.reshape(cw.shape[0], cw.shape[-1])
    new = x.h.new_empty
    return cw, (new(B, T, 3 * P), x.conv_state, cw, new(B, T, P), new(B, T, x.A_log.numel()), x.lengths)


def _projections(x: _Layer):
    """u = h @ [w_q | w_k | w_v], f = (h @ w_f_a) @ w_f_b and b = h @ w_b, in h's dtype (cuBLAS)."""
    h, dt = x.h, x.h.dtype
    return (h @ _cat_once([x.w_q, x.w_k, x.w_v], 1).to(dt), (h @ x.w_f_a.to(dt)) @ x.w_f_b.to(dt),
            h @ x.w_b.to(dt))


def decode_fused(x, a, out=None):
    """One decode token of the layer in nine launches: the six projections (cuBLAS), the Triton pre-kernel (conv
    over the carried window, SiLU, L2 norms, safe gate, beta, padding rows masked; plugins/kda/triton.py
    `kda_decode_prepare`), the Triton decode step and the output norm-and-gate kernel; the torch form issues about
    seventy operations for the same step. Returns None (the caller takes the torch form) where the pre-kernel does
    not apply (`decode_prepare_unsupported`). Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    from kimi_compile.plugins.kda import triton as ktk

    x = _Layer(*x)
    B, T, _ = x.h.shape
    H, D = x.A_log.numel(), x.o_norm.numel()
    dt = x.h.dtype
    cw, shapes = _fused_inputs(x)
    if ktk.decode_prepare_unsupported(*shapes, x.A_log, x.dt_bias) is not None:
        return None
    u, f, b = _projections(x)
    q, k, v, g, beta = ktk.kda_decode_prepare(u, x.conv_state, cw, f, b, x.lengths, x.A_log, x.dt_bias,
                                              scale=a["scale"], l2_eps=a["l2_eps"], lower_bound=a["lower_bound"])
    o = ktk.kda_decode_step(q, k, v, g, beta, x.state, out=torch.empty(B, H, D, dtype=torch.float32,
                                                                         device=x.h.device))
    y = ktk.kda_output_norm_gate(o.view(B, T, H, D), x.h @ x.w_g.to(dt), x.o_norm, a["eps"], out_dtype=dt)
    return _output_projection(y, x.w_o, out), x.conv_state, x.state


def prefill_fused(x, a, out=None):
    """T > 1 tokens of the layer: the six projections (cuBLAS), `kda_prefill_prepare` (one Triton launch: the conv
    over the carried window, SiLU, L2 norms, beta, the gate input masked on padding rows, the window advanced in
    place), the chunked core (fla-core's safe gate and intra-chunk kernels, then the fused state/output recurrence
    `kda_chunk_state_out`; the state updated in place) and the output norm-and-gate kernel (plugins/kda/triton.py
    `kda_prefill`). Returns None (the caller takes the torch form) where
    the pre-kernel does not apply (`prefill_prepare_unsupported`), the state is not contiguous float32 or the
    activations are float32 (`fla_chunk_applies`)."""
    from kimi_compile.plugins.kda import triton as ktk

    x = _Layer(*x)
    dt = x.h.dtype
    cw, shapes = _fused_inputs(x)
    if (ktk.prefill_prepare_unsupported(*shapes) is not None or not fla_chunk_applies(dt)
            or not (x.state.dtype == torch.float32 and x.state.is_contiguous())):
        return None
    u, f, b = _projections(x)
    H = x.A_log.numel()
    y = ktk.kda_prefill(u, x.conv_state, cw, f, b, x.lengths, x.A_log.float(), x.dt_bias.float().reshape(H, -1),
                        x.h @ x.w_g.to(dt), x.o_norm, x.state, scale=a["scale"], l2_eps=a["l2_eps"],
                        lower_bound=a["lower_bound"], eps=a["eps"])
    return _output_projection(y, x.w_o, out), x.conv_state, x.state


def prepare(h, conv_state, lengths, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b, w_b, A_log, dt_bias, a):
    """The delta rule's inputs (q, k, v, g, beta) of a KDA layer; the conv window `conv_state` advances in place
    (padding rows zero g and beta)."""
    B, T, _ = h.shape
    H = A_log.numel()
    P, W = conv_q.shape[0], conv_q.shape[-1]
    D = P // H
    dt = h.dtype
    w_qkv = _cat_once([w_q, w_k, w_v], 1)
    cw = _cat_once([conv_q, conv_k, conv_v], 0)
    u = h @ w_qkv.to(dt)  # [B, T, 3P]
    cat = torch.cat([conv_state.to(dt), u], 1)  # [B, W-1+T, 3P]
    y = F.silu(F.conv1d(cat.transpose(1, 2), cw.to(dt), groups=3 * P).transpose(1, 2))  # [B, T, 3P]
    rows = lengths.reshape(B, 1) + torch.arange(W - 1, device=h.device).reshape(1, W - 1)
    conv_state.copy_(torch.gather(cat, 1, rows.unsqueeze(-1).expand(B, W - 1, 3 * P)))
    q, k, v = (t.reshape(B, T, H, D) for t in y.split(P, dim=-1))
    q = q.float() * torch.rsqrt(q.float().pow(2).sum(-1, keepdim=True) + a["l2_eps"]) * a["scale"]
    k = k.float() * torch.rsqrt(k.float().pow(2).sum(-1, keepdim=True) + a["l2_eps"])
    f = ((h @ w_f_a.to(dt)) @ w_f_b.to(dt)).float().reshape(B, T, H, D) + dt_bias.float().reshape(H, D)
    g = a["lower_bound"] * torch.sigmoid(torch.exp(A_log.float()).reshape(H, 1) * f)
    beta = torch.sigmoid((h @ w_b.to(dt)).float())
    valid = (torch.arange(T, device=h.device).reshape(1, T) < lengths.reshape(B, 1)).float()
    g = g * valid.reshape(B, T, 1, 1)
    beta = beta * valid.reshape(B, T, 1)
    return q, k, v, g, beta


CUDA = {"KDA": Kernel(kda, devices=("cuda", "cpu"), inplace={1: 1, 2: 2}, name="kda.triton_decode+fla_chunk",
                      out=True)}
