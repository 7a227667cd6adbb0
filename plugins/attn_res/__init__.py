"""Block Attention Residuals in two stages (optimizations.md §4.3).

kimi.AttnResStage1 — once per bank state (every mixing point whose finished sources are the same):
    inputs  bank [K,B,T,D] (the finished sources, stacked), queries [L,D] (w_eff = norm_w * proj_w of each
            mixing point served by this bank)
    outputs o1 [L,B,T,D] = sum_k e^{s_lk - m1_l} bank_k,  m1 [L,B,T] = max_k s_lk,  l1 [L,B,T] = sum_k e^{s_lk - m1_l}
            with s_lk = (bank_k . w_l) / sqrt(mean(bank_k^2) + eps)
    attrs   eps
kimi.AttnResMerge — per mixing point, the online-softmax merge of the running partial, fused with the RMSNorm that
follows the mix:
    inputs  o1, m1, l1 (stage-1 outputs), partial [B,T,D], query [D], norm_weight [D]
    output  RMSNorm(mix) where mix = (o1[slot] e^{m1-m} + partial e^{s_p-m}) / (l1 e^{m1-m} + e^{s_p-m}),
            s_p = (partial . query)/sqrt(mean(partial^2)+eps), m = max(m1[slot], s_p)
    attrs   slot (which stage-1 query), eps (AttnRes), norm_eps (the RMSNorm's)
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from kimi_compile.onnx_body import attr_const
from kimi_compile.ops import DOMAIN, ONNX_OPSET, OpDef, TensorType, register
from kimi_compile.plugins.indexer_topk import _c


_ref = attr_const


def _inv_rms(x: str, eps: str, out: str) -> list:
    n = helper.make_node
    return [n("Mul", [x, x], [out + "_sq"]), n("ReduceMean", [out + "_sq", "axm1"], [out + "_ms"], keepdims=0),
            n("Add", [out + "_ms", eps], [out + "_mse"]), n("Sqrt", [out + "_mse"], [out + "_rms"]),
            n("Reciprocal", [out + "_rms"], [out])]


def stage1_function():
    n = helper.make_node
    nodes = [
        _c("axm1", [-1]), _c("ax1", [1]), _c("ax0", [0]), _ref("eps", "eps", "value_float"),
        *_inv_rms("bank", "eps", "inv"),  # [K,B,T]
        n("Einsum", ["bank", "queries"], ["dots"], equation="kbtd,ld->lkbt"),
        n("Unsqueeze", ["inv", "ax0"], ["inv1"]),
        n("Mul", ["dots", "inv1"], ["s"]),  # [L,K,B,T]
        n("ReduceMax", ["s", "ax1"], ["m1"], keepdims=0),  # [L,B,T]
        n("Unsqueeze", ["m1", "ax1"], ["m1k"]),
        n("Sub", ["s", "m1k"], ["sc"]), n("Exp", ["sc"], ["e"]),
        n("ReduceSum", ["e", "ax1"], ["l1"], keepdims=0),
        n("Einsum", ["e", "bank"], ["o1"], equation="lkbt,kbtd->lbtd"),
    ]
    return helper.make_function(DOMAIN, "AttnResStage1", ["bank", "queries"], ["o1", "m1", "l1"], nodes,
                                [helper.make_opsetid("", ONNX_OPSET)], attributes=["eps"])


def merge_function():
    n = helper.make_node
    nodes = [
        _c("axm1", [-1]), _ref("slot", "slot", "value_int"), _ref("eps", "eps", "value_float"),
        _ref("neps", "norm_eps", "value_float"),
        n("Gather", ["o1", "slot"], ["o1s"], axis=0), n("Gather", ["m1", "slot"], ["m1s"], axis=0),
        n("Gather", ["l1", "slot"], ["l1s"], axis=0),
        *_inv_rms("partial", "eps", "pinv"),
        n("Einsum", ["partial", "query"], ["pdot"], equation="btd,d->bt"),
        n("Mul", ["pdot", "pinv"], ["sp"]),
        n("Max", ["m1s", "sp"], ["m"]),
        n("Sub", ["m1s", "m"], ["d1"]), n("Exp", ["d1"], ["a1"]),
        n("Sub", ["sp", "m"], ["d2"]), n("Exp", ["d2"], ["a2"]),
        n("Unsqueeze", ["a1", "axm1"], ["a1d"]), n("Unsqueeze", ["a2", "axm1"], ["a2d"]),
        n("Mul", ["o1s", "a1d"], ["num1"]), n("Mul", ["partial", "a2d"], ["num2"]), n("Add", ["num1", "num2"], ["num"]),
        n("Mul", ["l1s", "a1"], ["den1"]), n("Add", ["den1", "a2"], ["den"]),
        n("Unsqueeze", ["den", "axm1"], ["dend"]),
        n("Div", ["num", "dend"], ["mix"]),
        *_inv_rms("mix", "neps", "minv"),
        n("Unsqueeze", ["minv", "axm1"], ["minvd"]),
        n("Mul", ["mix", "minvd"], ["normed"]),
        n("Mul", ["normed", "norm_weight"], ["out"]),
    ]
    return helper.make_function(DOMAIN, "AttnResMerge", ["o1", "m1", "l1", "partial", "query", "norm_weight"],
                                ["out"], nodes, [helper.make_opsetid("", ONNX_OPSET)],
                                attributes=["slot", "eps", "norm_eps"])


def stage1_reference(bank, queries, eps: float):
    b = bank.astype(np.float64)
    inv = 1.0 / np.sqrt((b**2).mean(-1) + eps)  # [K,B,T]
    s = np.einsum("kbtd,ld->lkbt", b, queries) * inv[None]
    m1 = s.max(1)
    e = np.exp(s - m1[:, None])
    return (np.einsum("lkbt,kbtd->lbtd", e, b).astype(np.float32), m1.astype(np.float32),
            e.sum(1).astype(np.float32))


def merge_reference(o1, m1, l1, partial, query, norm_weight, slot: int, eps: float, norm_eps: float):
    p = partial.astype(np.float64)
    sp = (p @ query) / np.sqrt((p**2).mean(-1) + eps)
    m = np.maximum(m1[slot], sp)
    mix = (o1[slot] * np.exp(m1[slot] - m)[..., None] + p * np.exp(sp - m)[..., None]) / \
        (l1[slot] * np.exp(m1[slot] - m) + np.exp(sp - m))[..., None]
    return (mix / np.sqrt((mix**2).mean(-1, keepdims=True) + norm_eps) * norm_weight).astype(np.float32)


def _infer1(types, attrs):
    bank, q = types
    if not (bank and bank.shape and q and q.shape):
        return [TensorType(None, TensorProto.FLOAT)] * 3
    L, (K, B, T, D) = q.shape[0], bank.shape
    return [TensorType((L, B, T, D), TensorProto.FLOAT), TensorType((L, B, T), TensorProto.FLOAT),
            TensorType((L, B, T), TensorProto.FLOAT)]


def _infer2(types, attrs):
    p = types[3]
    return [TensorType(p.shape if p else None, TensorProto.FLOAT)]


STAGE1 = register(OpDef("AttnResStage1", ("bank", "queries"), ("o1", "m1", "l1"), {"eps": 1e-5},
                        function=stage1_function, infer=_infer1, reference=stage1_reference, doc=__doc__,
                        float32_ports=frozenset({"m1", "l1"})))
MERGE = register(OpDef("AttnResMerge", ("o1", "m1", "l1", "partial", "query", "norm_weight"), ("out",),
                       {"slot": 0, "eps": 1e-5, "norm_eps": 1e-5}, function=merge_function, infer=_infer2,
                       reference=merge_reference, doc=__doc__, float32_ports=frozenset({"m1", "l1"})))
