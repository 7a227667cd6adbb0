"""ONNX body (opset 23) of kimi.MatMulNZ: restore the plain [K, N] weight from NZ, then MatMul.

    MatMulNZ(x [..., K], w_nz [N1, K', n0]) -> y [..., N]     attrs K, N (the plain weight's dims)
    body: Transpose(w_nz, perm=[1, 0, 2]) -> [K', N1, n0] -> Reshape [K', N1*n0] -> Slice [:K, :N] -> MatMul(x, .)
"""

from __future__ import annotations

import functools

import onnx
from onnx import helper as oh
from onnxscript import opset23 as op
from onnxscript import script
from onnxscript.values import Opset

from kimi_compile.ops import ONNX_OPSET

kimi = Opset("kimi", 1)


@script(kimi, default_opset=op)
def MatMulNZ(x, w_nz, K: int, N: int):
    kn = op.Concat(op.Reshape(op.Constant(value_int=K), op.Constant(value_ints=[1])),
                   op.Reshape(op.Constant(value_int=N), op.Constant(value_ints=[1])), axis=0)
    w_pad = op.Reshape(op.Transpose(w_nz, perm=[1, 0, 2]), op.Constant(value_ints=[0, -1]))
    w = op.Slice(w_pad, op.Constant(value_ints=[0, 0]), kn, op.Constant(value_ints=[0, 1]))
    y = op.MatMul(x, w)
    return y


@functools.cache
def _build() -> onnx.FunctionProto:
    fp = MatMulNZ.to_function_proto()
    del fp.opset_import[:]
    fp.opset_import.append(oh.make_opsetid("", ONNX_OPSET))
    return fp


def function_proto() -> onnx.FunctionProto:
    """A fresh copy of the MatMulNZ FunctionProto (default-domain opset ONNX_OPSET)."""
    out = onnx.FunctionProto()
    out.CopyFrom(_build())
    return out
