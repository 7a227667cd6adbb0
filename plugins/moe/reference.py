"""kimi.MoE: the numpy oracle (fp64 math, float32 output; semantics in __init__.py)."""

from __future__ import annotations

import numpy as np


def _sig(a):
    return 1.0 / (1.0 + np.exp(-a))


def _act(u, g, situ_beta, situ_linear_beta):
    a = situ_beta * np.tanh(g / situ_beta) * _sig(g)
    return a * (situ_linear_beta * np.tanh(u / situ_linear_beta) if situ_linear_beta > 0 else u)


def _latent_sum(xf, x, router_w, router_bias, w_down, w1, w3, w2, top_k, renormalize, scaling, situ_beta,
                situ_linear_beta, expert_offset=0):
    """fp64 [N, latent]: the routed experts' latent outputs summed with their router weights, over the experts held
    here (global ids expert_offset .. expert_offset + len(w1) - 1; the others contribute 0). Expert selection from
    the fp32 scores (so near-ties pick as ONNX Runtime does)."""
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    hidden = np.shape(x)[-1]
    s32 = _sig(np.asarray(x, np.float32).reshape(-1, hidden) @ np.asarray(router_w, np.float32).T)
    choice = s32.astype(np.float32) + np.asarray(router_bias, np.float32)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(_sig(xf @ f64(router_w).T), idx, axis=-1)
    if renormalize:
        w = w / w.sum(-1, keepdims=True)
    w = w * scaling
    local = idx - int(expert_offset)
    held = (local >= 0) & (local < np.shape(w1)[0])
    local, w = np.where(held, local, 0), np.where(held, w, 0.0)
    z = xf @ f64(w_down).T
    gate = np.einsum("nd,nkid->nki", z, f64(w1)[local])
    up = np.einsum("nd,nkid->nki", z, f64(w3)[local])
    h = _act(up, gate, situ_beta, situ_linear_beta)
    return (np.einsum("nki,nkdi->nkd", h, f64(w2)[local]) * w[..., None]).sum(1)


def moe(x, router_w, router_bias, w_down, w1, w3, w2, norm_w, w_up, shared_gate, shared_up, shared_down, top_k=1,
        renormalize=1, scaling=1.0, situ_beta=1.0, situ_linear_beta=0.0, eps=1e-5):
    """numpy reference in fp64; expert selection from the fp32 scores (so near-ties pick as ONNX Runtime does)."""
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    shape = np.shape(x)
    xf = f64(x).reshape(-1, shape[-1])
    r = _latent_sum(xf, x, router_w, router_bias, w_down, w1, w3, w2, top_k, renormalize, scaling, situ_beta,
                    situ_linear_beta)
    r = r / np.sqrt((r * r).mean(-1, keepdims=True) + eps) * f64(norm_w)
    shared = _act(xf @ f64(shared_up).T, xf @ f64(shared_gate).T, situ_beta, situ_linear_beta) @ f64(shared_down).T
    return (r @ f64(w_up).T + shared).reshape(shape).astype(np.float32)


def moe_experts(x, router_w, router_bias, w_down, w1, w3, w2, top_k=1, renormalize=1, scaling=1.0, situ_beta=1.0,
                situ_linear_beta=0.0, expert_offset=0):
    """kimi.MoEExperts in numpy (fp64 math, float32 output): the latent sum r over the experts held here."""
    shape = np.shape(x)
    xf = np.asarray(x, dtype=np.float64).reshape(-1, shape[-1])
    r = _latent_sum(xf, x, router_w, router_bias, w_down, w1, w3, w2, top_k, renormalize, scaling, situ_beta,
                    situ_linear_beta, expert_offset)
    return r.reshape(*shape[:-1], r.shape[-1]).astype(np.float32)
