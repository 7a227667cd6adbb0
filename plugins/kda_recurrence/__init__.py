"""kimi.KDARecurrence: the gated delta rule over a dynamic number of steps (the `kimi::kda_recurrence` primitive).

Inputs  q, k [B,T,H,K] (q pre-scaled), v [B,T,H,V], g [B,T,H,K] (log decay), beta [B,T,H], state [B,H,K,V]
Outputs o [B,T,H,V], final_state [B,H,K,V]
Attr    chunk_size: 0 = recurrent form, > 0 = chunked form (same numbers up to rounding; the ONNX body always runs
        the recurrence as a Scan, which ONNX Runtime executes for any T, including T not a multiple of the chunk).
Per step: S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from kimi_compile.ops import DOMAIN, ONNX_OPSET, OpDef, TensorType, register

NAME = "KDARecurrence"


def _step_body() -> "helper.GraphProto":
    f = TensorProto.FLOAT
    n = helper.make_node
    nodes = [
        n("Constant", [], ["ax_last"], value=helper.make_tensor("ax_last", TensorProto.INT64, [1], [-1])),
        n("Constant", [], ["ax2"], value=helper.make_tensor("ax2", TensorProto.INT64, [1], [2])),
        n("Exp", ["g_t"], ["decay0"]),
        n("Unsqueeze", ["decay0", "ax_last"], ["decay"]),
        n("Mul", ["S", "decay"], ["S1"]),
        n("Unsqueeze", ["k_t", "ax_last"], ["kk"]),
        n("Mul", ["S1", "kk"], ["Sk"]),
        n("ReduceSum", ["Sk", "ax2"], ["kv_mem"], keepdims=0),
        n("Sub", ["v_t", "kv_mem"], ["diff"]),
        n("Unsqueeze", ["b_t", "ax_last"], ["bb"]),
        n("Mul", ["diff", "bb"], ["delta"]),
        n("Unsqueeze", ["delta", "ax2"], ["delta2"]),
        n("Mul", ["kk", "delta2"], ["upd"]),
        n("Add", ["S1", "upd"], ["S_out"]),
        n("Unsqueeze", ["q_t", "ax_last"], ["qq"]),
        n("Mul", ["S_out", "qq"], ["Sq"]),
        n("ReduceSum", ["Sq", "ax2"], ["o_t"], keepdims=0),
    ]
    ins = [helper.make_tensor_value_info(x, f, None) for x in ("S", "q_t", "k_t", "v_t", "g_t", "b_t")]
    outs = [helper.make_tensor_value_info(x, f, None) for x in ("S_out", "o_t")]
    return helper.make_graph(nodes, "kda_step", ins, outs)


def function():
    scan = helper.make_node(
        "Scan", ["state", "q", "k", "v", "g", "beta"], ["final_state", "o"], num_scan_inputs=5,
        scan_input_axes=[1, 1, 1, 1, 1], scan_output_axes=[1], body=_step_body())
    return helper.make_function(
        DOMAIN, NAME, ["q", "k", "v", "g", "beta", "state"], ["o", "final_state"], [scan],
        [helper.make_opsetid("", ONNX_OPSET)], attributes=["chunk_size"])


def infer(types, attrs):
    q, k, v, g, beta, state = types
    return [TensorType(v.shape if v else None, TensorProto.FLOAT), TensorType(state.shape if state else None,
                                                                              TensorProto.FLOAT)]


def reference(q, k, v, g, beta, state, chunk_size=0):
    import torch

    from kimi_compile.model.primitives import kda_chunked, kda_recurrent

    args = [torch.as_tensor(x) for x in (q, k, v, g, beta, state)]
    o, s = kda_chunked(*args, chunk_size) if chunk_size else kda_recurrent(*args)
    return o.numpy(), s.numpy()


OP = register(OpDef(NAME, ("q", "k", "v", "g", "beta", "state"), ("o", "final_state"), {"chunk_size": 0},
                    function=function, infer=infer, reference=reference, doc=__doc__,
                    float32_ports=frozenset({"state", "final_state"})))
