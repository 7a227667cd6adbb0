"""ONNX function bodies of kimi.AttnResStage1 and kimi.AttnResMerge (standard ops; semantics in __init__.py)."""

from __future__ import annotations

from onnx import FunctionProto, NodeProto, helper

from kimi_compile.onnx_body import attr_const, const, function


def _inv_rms(x: str, eps: str, out: str) -> list[NodeProto]:
    """out = 1 / sqrt(mean(x^2, last axis) + eps) (the body's `axm1` constant is the axis)."""
    n = helper.make_node
    return [n("Mul", [x, x], [out + "_sq"]), n("ReduceMean", [out + "_sq", "axm1"], [out + "_ms"], keepdims=0),
            n("Add", [out + "_ms", eps], [out + "_mse"]), n("Sqrt", [out + "_mse"], [out + "_rms"]),
            n("Reciprocal", [out + "_rms"], [out])]


def attn_res_stage1() -> FunctionProto:
    n = helper.make_node
    nodes = [
        const("axm1", [-1]), const("ax1", [1]), const("ax0", [0]), attr_const("eps", "eps", "value_float"),
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
    return function("AttnResStage1", ["bank", "queries"], ["o1", "m1", "l1"], nodes, ["eps"])


def attn_res_merge() -> FunctionProto:
    n = helper.make_node
    nodes = [
        const("axm1", [-1]), attr_const("slot", "slot", "value_int"), attr_const("eps", "eps", "value_float"),
        attr_const("neps", "norm_eps", "value_float"),
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
    return function("AttnResMerge", ["o1", "m1", "l1", "partial", "query", "norm_weight"], ["out"], nodes,
                    ["slot", "eps", "norm_eps"])
