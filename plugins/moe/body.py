"""ONNX function bodies of kimi.MoE and kimi.MoEExperts (standard ops; semantics in __init__.py): sigmoid router with
the bias used for selection only, TopK, renormalised and scaled weights, the selected experts gathered (GatherND) and
applied in the latent with SiTU, then (MoE) RMSNorm and the up-projection, plus the shared experts on x."""

from __future__ import annotations

from onnx import FunctionProto, NodeProto, TensorProto, helper

from kimi_compile.onnx_body import attr_const, const, function, ref_attr

NAME = "MoE"
INPUTS = ("x", "router_w", "router_bias", "w_down", "w1", "w3", "w2", "norm_w", "w_up", "shared_gate", "shared_up",
          "shared_down")
OUTPUTS = ("y",)
ATTRS = {"top_k": 1, "renormalize": 1, "scaling": 1.0, "situ_beta": 1.0, "situ_linear_beta": 0.0, "eps": 1e-5}


def situ_nodes(up: str, gate: str, out: str) -> list[NodeProto]:
    """act(up, gate) with the betas `moe_beta` / `moe_lbeta` (Where keeps the linear branch when lbeta == 0)."""
    n = helper.make_node
    p = out + "_"
    return [
        n("Div", [gate, "moe_beta"], [p + "gd"]), n("Tanh", [p + "gd"], [p + "gt"]),
        n("Mul", [p + "gt", "moe_beta"], [p + "gb"]), n("Sigmoid", [gate], [p + "gs"]),
        n("Mul", [p + "gb", p + "gs"], [p + "a"]),
        n("Div", [up, "moe_lbeta_safe"], [p + "ud"]), n("Tanh", [p + "ud"], [p + "ut"]),
        n("Mul", [p + "ut", "moe_lbeta_safe"], [p + "ub"]),
        n("Where", ["moe_has_lbeta", p + "ub", up], [p + "u"]),
        n("Mul", [p + "a", p + "u"], [out]),
    ]


def _router(weights: str) -> list[NodeProto]:
    """Constants, attributes and the router: tokens flattened (moe_xf [N, hidden]), sigmoid scores, bias-corrected
    TopK selection (moe_idx), weights from the uncorrected scores, renormalised and scaled (`weights`)."""
    n = helper.make_node
    return [
        const("moe_ax1", [1]), const("moe_axm1", [-1]), const("moe_zero_f", [0.0], TensorProto.FLOAT, dims=[]),
        const("moe_one_f", [1.0], TensorProto.FLOAT, dims=[]), const("moe_zero_i", [0], dims=[]),
        attr_const("moe_beta", "situ_beta"), attr_const("moe_lbeta", "situ_linear_beta"),
        attr_const("moe_scaling", "scaling"),
        attr_const("moe_k0", "top_k", "value_int"), attr_const("moe_renorm0", "renormalize", "value_int"),
        n("Greater", ["moe_lbeta", "moe_zero_f"], ["moe_has_lbeta"]),
        n("Where", ["moe_has_lbeta", "moe_lbeta", "moe_one_f"], ["moe_lbeta_safe"]),
        n("Reshape", ["moe_k0", "moe_axm1"], ["moe_k"]),
        n("Greater", ["moe_renorm0", "moe_zero_i"], ["moe_renorm"]),
        n("Shape", ["x"], ["moe_hidden"], start=-1),
        n("Concat", ["moe_axm1", "moe_hidden"], ["moe_flat"], axis=0),
        n("Reshape", ["x", "moe_flat"], ["moe_xf"]),
        n("Transpose", ["router_w"], ["moe_rwt"], perm=[1, 0]),
        n("MatMul", ["moe_xf", "moe_rwt"], ["moe_logits"]), n("Sigmoid", ["moe_logits"], ["moe_s"]),
        n("Add", ["moe_s", "router_bias"], ["moe_choice"]),
        n("TopK", ["moe_choice", "moe_k"], ["moe_topv", "moe_idx"], axis=-1, largest=1, sorted=1),
        n("GatherElements", ["moe_s", "moe_idx"], ["moe_w0"], axis=-1),
        n("ReduceSum", ["moe_w0", "moe_axm1"], ["moe_wsum"], keepdims=1),
        n("Where", ["moe_renorm", "moe_wsum", "moe_one_f"], ["moe_den"]),
        n("Div", ["moe_w0", "moe_den"], ["moe_w1"]), n("Mul", ["moe_w1", "moe_scaling"], [weights]),
    ]


def _experts(idx: str, weights: str) -> list[NodeProto]:
    """The selected experts (expert ids `idx` [N, k] into w1/w3/w2) in the latent with SiTU, summed with `weights`:
    moe_r [N, latent]."""
    n = helper.make_node
    return [
        n("Gemm", ["moe_xf", "w_down"], ["moe_z"], transB=1),
        n("Unsqueeze", [idx, "moe_axm1"], ["moe_idx3"]),
        n("GatherND", ["w1", "moe_idx3"], ["moe_w1g"]), n("Einsum", ["moe_z", "moe_w1g"], ["moe_gate"],
                                                          equation="nd,nkid->nki"),
        n("GatherND", ["w3", "moe_idx3"], ["moe_w3g"]), n("Einsum", ["moe_z", "moe_w3g"], ["moe_up"],
                                                          equation="nd,nkid->nki"),
        *situ_nodes("moe_up", "moe_gate", "moe_h"),
        n("GatherND", ["w2", "moe_idx3"], ["moe_w2g"]), n("Einsum", ["moe_h", "moe_w2g"], ["moe_ye"],
                                                          equation="nki,nkdi->nkd"),
        n("Unsqueeze", [weights, "moe_axm1"], ["moe_w3d"]), n("Mul", ["moe_ye", "moe_w3d"], ["moe_yw"]),
        n("ReduceSum", ["moe_yw", "moe_ax1"], ["moe_r"], keepdims=0),
    ]


def moe() -> FunctionProto:
    n = helper.make_node
    rms = ref_attr(n("RMSNormalization", ["moe_r", "norm_w"], ["moe_rn"], axis=-1, stash_type=1), "epsilon", "eps")
    nodes = [
        *_router("moe_w"),
        *_experts("moe_idx", "moe_w"),
        rms,
        n("Gemm", ["moe_rn", "w_up"], ["moe_routed"], transB=1),
        # shared experts on x
        n("Gemm", ["moe_xf", "shared_up"], ["moe_su"], transB=1),
        n("Gemm", ["moe_xf", "shared_gate"], ["moe_sg"], transB=1),
        *situ_nodes("moe_su", "moe_sg", "moe_sh"),
        n("Gemm", ["moe_sh", "shared_down"], ["moe_shared"], transB=1),
        n("Add", ["moe_routed", "moe_shared"], ["moe_yf"]),
        n("Shape", ["x"], ["moe_xshape"]),
        n("Reshape", ["moe_yf", "moe_xshape"], ["y"]),
    ]
    return function(NAME, INPUTS, OUTPUTS, nodes, list(ATTRS))


EXPERTS_NAME = "MoEExperts"
EXPERTS_INPUTS = ("x", "router_w", "router_bias", "w_down", "w1", "w3", "w2")
EXPERTS_OUTPUTS = ("r",)
EXPERTS_ATTRS = {"top_k": 1, "renormalize": 1, "scaling": 1.0, "situ_beta": 1.0, "situ_linear_beta": 0.0,
                 "expert_offset": 0}


def moe_experts() -> FunctionProto:
    """The routed part of kimi.MoE up to the latent sum, over the experts held here (global ids expert_offset ..
    expert_offset + E_local - 1): a selected expert held elsewhere contributes 0 (its weight is masked, its index
    clamped to a held one)."""
    n = helper.make_node
    nodes = [
        const("moe_ax0", [0]),
        *_router("moe_wg"),
        attr_const("moe_off", "expert_offset", "value_int"),
        # the experts held here: local index = global - offset, valid in [0, E_local)
        n("Shape", ["w1"], ["moe_el1"], start=0, end=1), n("Squeeze", ["moe_el1", "moe_ax0"], ["moe_el"]),
        n("Sub", ["moe_idx", "moe_off"], ["moe_loc"]),
        n("GreaterOrEqual", ["moe_loc", "moe_zero_i"], ["moe_ge"]), n("Less", ["moe_loc", "moe_el"], ["moe_lt"]),
        n("And", ["moe_ge", "moe_lt"], ["moe_held"]),
        n("Where", ["moe_held", "moe_loc", "moe_zero_i"], ["moe_lidx"]),
        n("Where", ["moe_held", "moe_wg", "moe_zero_f"], ["moe_w"]),
        *_experts("moe_lidx", "moe_w"),
        n("Shape", ["x"], ["moe_lead"], start=0, end=-1), n("Shape", ["w_down"], ["moe_lat"], start=0, end=1),
        n("Concat", ["moe_lead", "moe_lat"], ["moe_rshape"], axis=0),
        n("Reshape", ["moe_r", "moe_rshape"], ["r"]),
    ]
    return function(EXPERTS_NAME, EXPERTS_INPUTS, EXPERTS_OUTPUTS, nodes, list(EXPERTS_ATTRS))
