"""kimi.MoE: the numpy oracle (fp64 math, float32 output; semantics in __init__.py)."""

from __future__ import annotations

import numpy as np


def moe(x, router_w, router_bias, w_down, w1, w3, w2, norm_w, w_up, shared_gate, shared_up, shared_down, top_k=1,
        renormalize=1, scaling=1.0, situ_beta=1.0, situ_linear_beta=0.0, eps=1e-5):
    """numpy reference in fp64; expert selection from the fp32 scores (so near-ties pick as ONNX Runtime does)."""
    shape = np.shape(x)
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    sig = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731

    def act(u, g):
        a = situ_beta * np.tanh(g / situ_beta) * sig(g)
        return a * (situ_linear_beta * np.tanh(u / situ_linear_beta) if situ_linear_beta > 0 else u)

    xf = f64(x).reshape(-1, shape[-1])
    s32 = sig(np.asarray(x, np.float32).reshape(-1, shape[-1]) @ np.asarray(router_w, np.float32).T)
    choice = s32.astype(np.float32) + np.asarray(router_bias, np.float32)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    s = sig(xf @ f64(router_w).T)
    w = np.take_along_axis(s, idx, axis=-1)
    if renormalize:
        w = w / w.sum(-1, keepdims=True)
    w = w * scaling
    z = xf @ f64(w_down).T
    gate = np.einsum("nd,nkid->nki", z, f64(w1)[idx])
    up = np.einsum("nd,nkid->nki", z, f64(w3)[idx])
    r = (np.einsum("nki,nkdi->nkd", act(up, gate), f64(w2)[idx]) * w[..., None]).sum(1)
    r = r / np.sqrt((r * r).mean(-1, keepdims=True) + eps) * f64(norm_w)
    y = r @ f64(w_up).T + act(xf @ f64(shared_up).T, xf @ f64(shared_gate).T) @ f64(shared_down).T
    return y.reshape(shape).astype(np.float32)
