"""ONNX function body (opset 23) of kimi.MatMulNZ: restore the plain [K, N] weight from NZ, then MatMul.

    MatMulNZ(x [..., K], w_nz [N1, K', n0]) -> y [..., N]     attrs K, N (the plain weight's dims)
    body: Transpose(w_nz, perm=[1, 0, 2]) -> [K', N1, n0] -> Reshape [K', N1*n0] -> Slice [:K, :N] -> MatMul(x, .)
"""

from __future__ import annotations

from onnx import FunctionProto, helper

from kimi_compile.onnx_body import attr_const, const, function


def matmul_nz() -> FunctionProto:
    n = helper.make_node
    nodes = [
        attr_const("K0", "K", "value_int"), attr_const("N0", "N", "value_int"), const("one", [1]),
        n("Reshape", ["K0", "one"], ["K1"]), n("Reshape", ["N0", "one"], ["N1"]),
        n("Concat", ["K1", "N1"], ["kn"], axis=0),
        n("Transpose", ["w_nz"], ["w_t"], perm=[1, 0, 2]),
        const("flat", [0, -1]), n("Reshape", ["w_t", "flat"], ["w_pad"]),
        const("starts", [0, 0]), const("axes", [0, 1]),
        n("Slice", ["w_pad", "starts", "kn", "axes"], ["w"]),
        n("MatMul", ["x", "w"], ["y"]),
    ]
    return function("MatMulNZ", ["x", "w_nz"], ["y"], nodes, ["K", "N"])
