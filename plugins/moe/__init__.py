"""kimi.MoE: the latent MoE block: sigmoid router with a correction bias used for selection only, top-k, renormalised
and scaled weights, routed experts in the latent (down-proj, stacked experts with SiTU, weighted sum, RMSNorm,
up-proj), plus the shared experts on x.

Inputs   x [..., hidden] (N = product of the leading dims), router_w [E,hidden], router_bias [E],
         w_down [L,hidden], w1 [E,I,L] (gate), w3 [E,I,L] (up), w2 [E,L,I] (down), norm_w [L], w_up [hidden,L],
         shared_gate [Is,hidden], shared_up [Is,hidden], shared_down [hidden,Is]
         (2-D weights in nn.Linear layout [out, in]: y = x @ w^T)
Output   y [..., hidden]
Attrs    top_k, renormalize (1: weights / their sum over the k), scaling (routed scaling factor),
         situ_beta, situ_linear_beta (0 = the up branch is linear), eps (latent RMSNorm epsilon)
Math     s = sigmoid(x @ router_w^T);  idx = topk(s + router_bias, k) (ties to the lower expert);
         w = s[idx] (/ sum_k s[idx] if renormalize) * scaling;
         act(u, g) = situ_beta*tanh(g/situ_beta)*sigmoid(g) * (situ_linear_beta*tanh(u/situ_linear_beta) or u);
         z = x @ w_down^T;  r = sum_k w_k * w2[e_k] act(w3[e_k] z, w1[e_k] z);
         y = RMSNorm(r) * norm_w @ w_up^T + shared_down act(shared_up x, shared_gate x).
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, TensorProto, helper

from kimi_compile.onnx_body import attr_const, const
from kimi_compile.ops import DOMAIN, ONNX_OPSET, OpDef, TensorType, register

NAME = "MoE"
INPUTS = ("x", "router_w", "router_bias", "w_down", "w1", "w3", "w2", "norm_w", "w_up", "shared_gate", "shared_up",
          "shared_down")
OUTPUTS = ("y",)
ATTRS = {"top_k": 1, "renormalize": 1, "scaling": 1.0, "situ_beta": 1.0, "situ_linear_beta": 0.0, "eps": 1e-5}


_c = const


_ref = attr_const


def situ_nodes(up: str, gate: str, out: str) -> list:
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


def function():
    n = helper.make_node
    eps_attr = helper.make_attribute("epsilon", 0.0)
    eps_attr.ref_attr_name, eps_attr.type = "eps", AttributeProto.FLOAT
    rms = n("RMSNormalization", ["moe_r", "norm_w"], ["moe_rn"], axis=-1, stash_type=1)
    rms.attribute.append(eps_attr)
    nodes = [
        _c("moe_ax1", [1]), _c("moe_axm1", [-1]), _c("moe_zero_f", [0.0], TensorProto.FLOAT, dims=[]),
        _c("moe_one_f", [1.0], TensorProto.FLOAT, dims=[]), _c("moe_zero_i", [0], dims=[]),
        _ref("moe_beta", "situ_beta"), _ref("moe_lbeta", "situ_linear_beta"), _ref("moe_scaling", "scaling"),
        _ref("moe_k0", "top_k", "value_int"), _ref("moe_renorm0", "renormalize", "value_int"),
        n("Greater", ["moe_lbeta", "moe_zero_f"], ["moe_has_lbeta"]),
        n("Where", ["moe_has_lbeta", "moe_lbeta", "moe_one_f"], ["moe_lbeta_safe"]),
        n("Reshape", ["moe_k0", "moe_axm1"], ["moe_k"]),
        n("Greater", ["moe_renorm0", "moe_zero_i"], ["moe_renorm"]),
        # flatten tokens: xf [N, hidden]
        n("Shape", ["x"], ["moe_hidden"], start=-1),
        n("Concat", ["moe_axm1", "moe_hidden"], ["moe_flat"], axis=0),
        n("Reshape", ["x", "moe_flat"], ["moe_xf"]),
        # router: sigmoid scores, bias-corrected selection, weights from the uncorrected scores
        n("Transpose", ["router_w"], ["moe_rwt"], perm=[1, 0]),
        n("MatMul", ["moe_xf", "moe_rwt"], ["moe_logits"]), n("Sigmoid", ["moe_logits"], ["moe_s"]),
        n("Add", ["moe_s", "router_bias"], ["moe_choice"]),
        n("TopK", ["moe_choice", "moe_k"], ["moe_topv", "moe_idx"], axis=-1, largest=1, sorted=1),
        n("GatherElements", ["moe_s", "moe_idx"], ["moe_w0"], axis=-1),
        n("ReduceSum", ["moe_w0", "moe_axm1"], ["moe_wsum"], keepdims=1),
        n("Where", ["moe_renorm", "moe_wsum", "moe_one_f"], ["moe_den"]),
        n("Div", ["moe_w0", "moe_den"], ["moe_w1"]), n("Mul", ["moe_w1", "moe_scaling"], ["moe_w"]),
        # routed experts in the latent
        n("Gemm", ["moe_xf", "w_down"], ["moe_z"], transB=1),
        n("Unsqueeze", ["moe_idx", "moe_axm1"], ["moe_idx3"]),
        n("GatherND", ["w1", "moe_idx3"], ["moe_w1g"]), n("Einsum", ["moe_z", "moe_w1g"], ["moe_gate"],
                                                          equation="nd,nkid->nki"),
        n("GatherND", ["w3", "moe_idx3"], ["moe_w3g"]), n("Einsum", ["moe_z", "moe_w3g"], ["moe_up"],
                                                          equation="nd,nkid->nki"),
        *situ_nodes("moe_up", "moe_gate", "moe_h"),
        n("GatherND", ["w2", "moe_idx3"], ["moe_w2g"]), n("Einsum", ["moe_h", "moe_w2g"], ["moe_ye"],
                                                          equation="nki,nkdi->nkd"),
        n("Unsqueeze", ["moe_w", "moe_axm1"], ["moe_w3d"]), n("Mul", ["moe_ye", "moe_w3d"], ["moe_yw"]),
        n("ReduceSum", ["moe_yw", "moe_ax1"], ["moe_r"], keepdims=0),
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
    return helper.make_function(DOMAIN, NAME, list(INPUTS), list(OUTPUTS), nodes,
                                [helper.make_opsetid("", ONNX_OPSET)], attributes=list(ATTRS))


def infer(types, attrs):
    x = types[0]
    return [TensorType(x.shape if x else None, TensorProto.FLOAT)]


def reference(x, router_w, router_bias, w_down, w1, w3, w2, norm_w, w_up, shared_gate, shared_up, shared_down,
              top_k=1, renormalize=1, scaling=1.0, situ_beta=1.0, situ_linear_beta=0.0, eps=1e-5):
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


OP = register(OpDef(NAME, INPUTS, OUTPUTS, dict(ATTRS), function=function, infer=infer, reference=reference,
                    doc=__doc__))
