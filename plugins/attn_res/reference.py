"""kimi.AttnResStage1 / kimi.AttnResMerge: the numpy oracle (fp64 math, float32 outputs; semantics in __init__.py).
Outputs in the ops' order: (o1, m1, l1) and out."""

from __future__ import annotations

import numpy as np


def attn_res_stage1(bank, queries, eps: float):
    b = bank.astype(np.float64)
    inv = 1.0 / np.sqrt((b**2).mean(-1) + eps)  # [K,B,T]
    s = np.einsum("kbtd,ld->lkbt", b, queries) * inv[None]
    m1 = s.max(1)
    e = np.exp(s - m1[:, None])
    return (np.einsum("lkbt,kbtd->lbtd", e, b).astype(np.float32), m1.astype(np.float32),
            e.sum(1).astype(np.float32))


def attn_res_merge(o1, m1, l1, partial, query, norm_weight, slot: int, eps: float, norm_eps: float):
    p = partial.astype(np.float64)
    sp = (p @ query) / np.sqrt((p**2).mean(-1) + eps)
    m = np.maximum(m1[slot], sp)
    mix = (o1[slot] * np.exp(m1[slot] - m)[..., None] + p * np.exp(sp - m)[..., None]) / \
        (l1[slot] * np.exp(m1[slot] - m) + np.exp(sp - m))[..., None]
    return (mix / np.sqrt((mix**2).mean(-1, keepdims=True) + norm_eps) * norm_weight).astype(np.float32)
