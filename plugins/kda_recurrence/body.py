"""ONNX function body of kimi.KDARecurrence: the gated delta rule as one Scan over T (any T, including T not a
multiple of chunk_size). kimi.KDA inlines the same step body (`step_body`)."""

from __future__ import annotations

from onnx import FunctionProto, GraphProto, TensorProto, helper

from kimi_compile.onnx_body import const, function


def step_body() -> GraphProto:
    """One step of the gated delta rule as a Scan body: (S, q_t, k_t, v_t, g_t, b_t) -> (S_out, o_t)."""
    f = TensorProto.FLOAT
    n = helper.make_node
    nodes = [
        const("ax_last", [-1]), const("ax2", [2]),
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


def kda_recurrence() -> FunctionProto:
    scan = helper.make_node(
        "Scan", ["state", "q", "k", "v", "g", "beta"], ["final_state", "o"], num_scan_inputs=5,
        scan_input_axes=[1, 1, 1, 1, 1], scan_output_axes=[1], body=step_body())
    return function("KDARecurrence", ["q", "k", "v", "g", "beta", "state"], ["o", "final_state"], [scan],
                    ["chunk_size"])
