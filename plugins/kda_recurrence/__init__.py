"""kimi.KDARecurrence: the gated delta rule over a dynamic number of steps (the `kimi::kda_recurrence` primitive).

Inputs  q, k [B,T,H,K] (q pre-scaled), v [B,T,H,V], g [B,T,H,K] (log decay), beta [B,T,H], state [B,H,K,V]
Outputs o [B,T,H,V], final_state [B,H,K,V]
Attr    chunk_size: 0 = recurrent form, > 0 = chunked form (same numbers up to rounding; the ONNX body always runs
        the recurrence as a Scan, which ONNX Runtime executes for any T, including T not a multiple of the chunk).
Per step: S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t.
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference


def infer(types, attrs):
    q, k, v, g, beta, state = types
    return [TensorType(v.shape if v else None, v.dtype if v else TensorProto.FLOAT),  # o in v's dtype
            TensorType(state.shape if state else None, TensorProto.FLOAT)]


OP = register(OpDef("KDARecurrence", ("q", "k", "v", "g", "beta", "state"), ("o", "final_state"), {"chunk_size": 0},
                    function=body.kda_recurrence, infer=infer, reference=reference.kda_recurrence, doc=__doc__,
                    float32_ports=frozenset({"state", "final_state"}), kind="primitive"))
