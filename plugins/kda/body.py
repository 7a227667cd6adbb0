"""ONNX function body of kimi.KDA (standard ops; semantics in __init__.py): projections, the causal short convs
over [conv_state ‖ u], L2-normalised q/k, safe gate and beta zeroed on padding rows, the gated delta rule as a Scan
(kimi.KDARecurrence's step body, inlined), per-head RMSNorm times the sigmoid gate, and the output projection."""

from __future__ import annotations

from onnx import FunctionProto, TensorProto, helper

from kimi_compile.onnx_body import attr_const, const, function, ref_attr
from kimi_compile.plugins.kda_recurrence.body import step_body

NAME = "KDA"
INPUTS = ("x", "conv_state", "state", "lengths", "w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_f_a", "w_f_b",
          "w_b", "w_g", "A_log", "dt_bias", "o_norm", "w_o")
OUTPUTS = ("out", "new_conv_state", "new_state")
ATTRS = {"lower_bound": -5.0, "scale": 1.0, "l2_eps": 1e-6, "eps": 1e-5, "chunk_size": 0}


def kda() -> FunctionProto:
    n = helper.make_node
    rms = ref_attr(n("RMSNormalization", ["kda_o", "o_norm"], ["kda_on"], axis=-1, stash_type=1), "epsilon", "eps")
    nodes = [
        const("kda_zero", [0], dims=[]), const("kda_one", [1], dims=[]), const("kda_ax0", [0]), const("kda_ax1", [1]),
        const("kda_ax2", [2]), const("kda_axm1", [-1]), const("kda_ax23", [2, 3]), const("kda_00", [0, 0]),
        const("kda_00m1", [0, 0, -1]), const("kda_11", [1, 1]), const("kda_m11", [-1, 1]),
        const("kda_two", [2.0], TensorProto.FLOAT, dims=[]),
        attr_const("kda_lb", "lower_bound"), attr_const("kda_scale", "scale"), attr_const("kda_l2eps", "l2_eps"),
        # shapes: per-head view [B,T,H,D] as [0,0,H,-1]; T and W as scalars
        n("Shape", ["A_log"], ["kda_H"]),
        n("Concat", ["kda_00", "kda_H", "kda_axm1"], ["kda_hshape"], axis=0),
        n("Concat", ["kda_H", "kda_axm1"], ["kda_hd"], axis=0),
        n("Shape", ["x"], ["kda_T1"], start=1, end=2), n("Squeeze", ["kda_T1", "kda_ax0"], ["kda_T"]),
        n("Shape", ["conv_q"], ["kda_W1"], start=2, end=3), n("Squeeze", ["kda_W1", "kda_ax0"], ["kda_W"]),
        # projections and the causal depthwise conv over [conv_state ‖ u] for q‖k‖v at once
        n("MatMul", ["x", "w_q"], ["kda_uq"]), n("MatMul", ["x", "w_k"], ["kda_uk"]),
        n("MatMul", ["x", "w_v"], ["kda_uv"]),
        n("Concat", ["kda_uq", "kda_uk", "kda_uv"], ["kda_u"], axis=2),
        n("Concat", ["conv_state", "kda_u"], ["kda_cat"], axis=1),  # [B, W-1+T, 3P]
        n("Range", ["kda_zero", "kda_T", "kda_one"], ["kda_tpos"]),
        n("Range", ["kda_zero", "kda_W", "kda_one"], ["kda_jpos"]),
        n("Unsqueeze", ["kda_tpos", "kda_ax1"], ["kda_tcol"]), n("Unsqueeze", ["kda_jpos", "kda_ax0"], ["kda_jrow"]),
        n("Add", ["kda_tcol", "kda_jrow"], ["kda_win_idx"]),  # [T, W]
        n("Gather", ["kda_cat", "kda_win_idx"], ["kda_win"], axis=1),  # [B, T, W, 3P]
        n("Concat", ["conv_q", "conv_k", "conv_v"], ["kda_convw"], axis=0),  # [3P, 1, W]
        n("Squeeze", ["kda_convw", "kda_ax1"], ["kda_convw2"]),
        n("Transpose", ["kda_convw2"], ["kda_convwt"], perm=[1, 0]),  # [W, 3P]
        n("Mul", ["kda_win", "kda_convwt"], ["kda_prod"]),
        n("ReduceSum", ["kda_prod", "kda_ax2"], ["kda_y"], keepdims=0),
        n("Sigmoid", ["kda_y"], ["kda_ysig"]), n("Mul", ["kda_y", "kda_ysig"], ["kda_silu"]),
        n("Split", ["kda_silu"], ["kda_yq", "kda_yk", "kda_yv"], axis=2, num_outputs=3),
        # new conv window: rows lengths[b] + [0, W-1) of the concatenation
        n("Sub", ["kda_W", "kda_one"], ["kda_Wm1"]),
        n("Range", ["kda_zero", "kda_Wm1", "kda_one"], ["kda_rpos"]),
        n("Unsqueeze", ["lengths", "kda_ax1"], ["kda_len2"]), n("Unsqueeze", ["kda_rpos", "kda_ax0"], ["kda_rpos2"]),
        n("Add", ["kda_len2", "kda_rpos2"], ["kda_rows"]),
        n("Unsqueeze", ["kda_rows", "kda_axm1"], ["kda_rows3"]),
        n("Shape", ["kda_cat"], ["kda_C"], start=2, end=3),
        n("Concat", ["kda_11", "kda_C"], ["kda_rshape"], axis=0),
        n("Expand", ["kda_rows3", "kda_rshape"], ["kda_rows_e"]),
        n("GatherElements", ["kda_cat", "kda_rows_e"], ["new_conv_state"], axis=1),
        # L2-normalised q (scaled) and k, per head
        n("Reshape", ["kda_yq", "kda_hshape"], ["kda_q4"]), n("Reshape", ["kda_yk", "kda_hshape"], ["kda_k4"]),
        n("Reshape", ["kda_yv", "kda_hshape"], ["kda_v4"]),
        n("Pow", ["kda_q4", "kda_two"], ["kda_q2"]), n("ReduceSum", ["kda_q2", "kda_axm1"], ["kda_qss"], keepdims=1),
        n("Add", ["kda_qss", "kda_l2eps"], ["kda_qsse"]), n("Sqrt", ["kda_qsse"], ["kda_qn"]),
        n("Reciprocal", ["kda_qn"], ["kda_qr"]), n("Mul", ["kda_q4", "kda_qr"], ["kda_qu"]),
        n("Mul", ["kda_qu", "kda_scale"], ["kda_q"]),
        n("Pow", ["kda_k4", "kda_two"], ["kda_k2"]), n("ReduceSum", ["kda_k2", "kda_axm1"], ["kda_kss"], keepdims=1),
        n("Add", ["kda_kss", "kda_l2eps"], ["kda_ksse"]), n("Sqrt", ["kda_ksse"], ["kda_kn"]),
        n("Reciprocal", ["kda_kn"], ["kda_kr"]), n("Mul", ["kda_k4", "kda_kr"], ["kda_k"]),
        # safe gate and beta, zeroed on padding rows
        n("MatMul", ["x", "w_f_a"], ["kda_fa"]), n("MatMul", ["kda_fa", "w_f_b"], ["kda_f"]),
        n("Reshape", ["kda_f", "kda_hshape"], ["kda_f4"]),
        n("Reshape", ["dt_bias", "kda_hd"], ["kda_dt"]), n("Add", ["kda_f4", "kda_dt"], ["kda_fb"]),
        n("Reshape", ["A_log", "kda_m11"], ["kda_alog"]), n("Exp", ["kda_alog"], ["kda_a"]),
        n("Mul", ["kda_a", "kda_fb"], ["kda_af"]), n("Sigmoid", ["kda_af"], ["kda_sg"]),
        n("Mul", ["kda_sg", "kda_lb"], ["kda_g0"]),
        n("MatMul", ["x", "w_b"], ["kda_bl"]), n("Sigmoid", ["kda_bl"], ["kda_b0"]),
        n("Unsqueeze", ["kda_tpos", "kda_ax0"], ["kda_trow"]),
        n("Less", ["kda_trow", "kda_len2"], ["kda_valid"]),  # [B, T]
        n("Cast", ["kda_valid"], ["kda_validf"], to=TensorProto.FLOAT),
        n("Unsqueeze", ["kda_validf", "kda_ax23"], ["kda_valid4"]),
        n("Unsqueeze", ["kda_validf", "kda_ax2"], ["kda_valid3"]),
        n("Mul", ["kda_g0", "kda_valid4"], ["kda_g"]), n("Mul", ["kda_b0", "kda_valid3"], ["kda_beta"]),
        # the gated delta rule (the kimi.KDARecurrence body, inlined)
        n("Scan", ["state", "kda_q", "kda_k", "kda_v4", "kda_g", "kda_beta"], ["new_state", "kda_o"],
          num_scan_inputs=5, scan_input_axes=[1, 1, 1, 1, 1], scan_output_axes=[1], body=step_body()),
        # output norm, gate and projection
        rms,
        n("MatMul", ["x", "w_g"], ["kda_gl"]), n("Reshape", ["kda_gl", "kda_hshape"], ["kda_g4"]),
        n("Sigmoid", ["kda_g4"], ["kda_gate"]), n("Mul", ["kda_on", "kda_gate"], ["kda_og"]),
        n("Reshape", ["kda_og", "kda_00m1"], ["kda_of"]), n("MatMul", ["kda_of", "w_o"], ["out"]),
    ]
    return function(NAME, INPUTS, OUTPUTS, nodes, list(ATTRS))
