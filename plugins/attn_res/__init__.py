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

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference


def _infer1(types, attrs):
    """o1 in the bank's dtype, m1 and l1 float32 (the kernels' contract, in a bf16 graph too)."""
    bank, q = types
    dt = bank.dtype if bank else TensorProto.FLOAT
    if not (bank and bank.shape and q and q.shape):
        return [TensorType(None, dt), TensorType(None, TensorProto.FLOAT), TensorType(None, TensorProto.FLOAT)]
    L, (K, B, T, D) = q.shape[0], bank.shape
    return [TensorType((L, B, T, D), dt), TensorType((L, B, T), TensorProto.FLOAT),
            TensorType((L, B, T), TensorProto.FLOAT)]


def _infer2(types, attrs):
    """out in partial's dtype."""
    p = types[3]
    return [TensorType(p.shape if p else None, p.dtype if p else TensorProto.FLOAT)]


STAGE1 = register(OpDef("AttnResStage1", ("bank", "queries"), ("o1", "m1", "l1"), {"eps": 1e-5},
                        function=body.attn_res_stage1, infer=_infer1, reference=reference.attn_res_stage1, doc=__doc__,
                        float32_ports=frozenset({"m1", "l1"}), kind="fused"))
MERGE = register(OpDef("AttnResMerge", ("o1", "m1", "l1", "partial", "query", "norm_weight"), ("out",),
                       {"slot": 0, "eps": 1e-5, "norm_eps": 1e-5}, function=body.attn_res_merge, infer=_infer2,
                       reference=reference.attn_res_merge, doc=__doc__, float32_ports=frozenset({"m1", "l1"}),
                       kind="fused"))
