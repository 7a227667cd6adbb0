"""Exact ONNX lowerings (opset 23, standard ops only) of the kimi quantization ops, runnable by ONNX Runtime CPU.

Ops (domain ``kimi``; semantics, edge cases and the numpy oracle are in reference.py):

    QuantizeMX(x) -> (q, scale)            attrs block=32, elem_type=FLOAT8E4M3FN(17)|FLOAT8E5M2(19),
                                           rounding="floor"|"ceil"
    DequantizeMX(q, scale) -> y            attrs block=32
    QDQMX(x) -> y                          attrs as QuantizeMX; y = DequantizeMX(QuantizeMX(x)), cast like x
    QuantizeFP8Tile(x) -> (q, scale)       attrs tile=128, scale_fmt="fp32"|"ue8m0"
    DequantizeFP8Tile(q, scale) -> y       attrs tile=128
    QDQFP8Tile(x) -> y                     attrs as QuantizeFP8Tile

x is float32/float16/bfloat16 (upcast to float32 exactly); q is typed FP8 (elem_type; E4M3FN for the tile ops); MX
scales are uint8 E8M0 bytes (opset 23 has no FLOAT8E8M0); tile scales are float32. The rounding rule and the element
type are node attributes read inside one function body (a Where over constant tables), not separate function variants.

How it stays exact without Log/Pow/BitCast (none is exact or present at opset 23):
- 2^k comes from a constant table ``POW2[b] = 2^(b-127)`` (b = 0..254; 2^-127 is a float32 subnormal; POW2[255] = NaN),
  indexed by the E8M0 byte: the scale is POW2[b] and its inverse POW2[254-b]; both products are exact power-of-two
  scalings.
- The E8M0 byte is found by an 8-step binary search over a monotone threshold table: byte = the largest c with
  amax >= THRESHOLDS[c] (0 if none). floor: THRESHOLDS[c] = 2^(c-127+emax); ceil: nextafter(max_elem * 2^(c-128), +inf),
  i.e. amax > max_elem * 2^(c-128). Entries past float32 range are +inf, so finite blocks stop at 254.
- ORT's Cast float->FP8 (saturate=1, the default) rounds to nearest even, FP8 subnormals included, and matches
  ml_dtypes bit for bit on clipped inputs (measured on all midpoints ±1 ulp and 2M random values). We Clip to
  ±max_normal first anyway, so the result never depends on the saturate mode (saturate=0 maps 480 to 448 in ORT 1.32).
- Non-finite blocks are found with IsNaN/IsInf (ReduceMax's NaN propagation is not relied upon).
ORT must run without denormals-are-zero (its default), since 2^-127 and some products are float32 subnormals.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto
from onnx import helper as oh
from onnxscript import opset23 as op
from onnxscript import script
from onnxscript.values import Opset

from kimi_compile.ops import ONNX_OPSET

from . import reference as ref

kimi = Opset("kimi", 1)

FLOAT8E4M3FN = TensorProto.FLOAT8E4M3FN  # 17
FLOAT8E5M2 = TensorProto.FLOAT8E5M2  # 19


def _tensor(name: str, a: np.ndarray) -> TensorProto:
    return oh.make_tensor(name, TensorProto.FLOAT, list(a.shape), a.ravel().tolist())


# Row index = 2 * (elem_type == FLOAT8E5M2) + (rounding == "ceil").
_POW2 = _tensor("kimi_pow2", ref.pow2_table())
_MX_THRESHOLDS = _tensor(
    "kimi_mx_thresholds",
    np.stack([ref.threshold_table(e, r) for e in ("e4m3", "e5m2") for r in ("floor", "ceil")]),
)
_UE8M0_THRESHOLDS = _tensor("kimi_ue8m0_thresholds", ref.threshold_table("e4m3", "ceil"))


@script(kimi, default_opset=op)
def QuantizeMX(x, block: int = 32, elem_type: int = 17, rounding: str = "floor"):
    xf = op.Cast(x, to=1)
    blk = op.Reshape(op.Constant(value_int=block), op.Constant(value_ints=[1]))
    xb = op.Reshape(xf, op.Concat(op.Shape(xf, end=-1), op.Constant(value_ints=[-1]), blk, axis=0))
    finite = op.Not(op.Or(op.IsNaN(xb), op.IsInf(xb)))
    bad = op.Greater(op.ReduceMax(op.Cast(op.Not(finite), to=1), op.Constant(value_ints=[-1]), keepdims=0), 0.0)
    amax = op.ReduceMax(op.Abs(op.Where(finite, xb, 0.0)), op.Constant(value_ints=[-1]), keepdims=0)
    is_ceil = op.Equal(op.Constant(value_string=rounding), op.Constant(value_string="ceil"))
    is_e5m2 = op.Equal(op.Constant(value_int=elem_type), op.Constant(value_int=19))
    row = op.Add(op.Mul(op.Cast(is_e5m2, to=7), op.Constant(value_int=2)), op.Cast(is_ceil, to=7))
    thr = op.Gather(op.Constant(value=_MX_THRESHOLDS), row, axis=0)
    # binary search: b = max{c : amax >= thr[c]}
    b0 = op.Cast(op.Mul(amax, 0.0), to=7)
    c1 = op.Add(b0, op.Constant(value_int=128))
    b1 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c1)), c1, b0)
    c2 = op.Add(b1, op.Constant(value_int=64))
    b2 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c2)), c2, b1)
    c3 = op.Add(b2, op.Constant(value_int=32))
    b3 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c3)), c3, b2)
    c4 = op.Add(b3, op.Constant(value_int=16))
    b4 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c4)), c4, b3)
    c5 = op.Add(b4, op.Constant(value_int=8))
    b5 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c5)), c5, b4)
    c6 = op.Add(b5, op.Constant(value_int=4))
    b6 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c6)), c6, b5)
    c7 = op.Add(b6, op.Constant(value_int=2))
    b7 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c7)), c7, b6)
    c8 = op.Add(b7, op.Constant(value_int=1))
    b8 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c8)), c8, b7)
    byte = op.Where(bad, op.Constant(value_int=255), b8)
    scale = op.Cast(byte, to=2)
    inv = op.Gather(op.Constant(value=_POW2), op.Sub(op.Constant(value_int=254), byte))  # 2^-e
    v = op.Mul(xb, op.Unsqueeze(inv, op.Constant(value_ints=[-1])))
    vmax = op.Where(is_e5m2, op.Constant(value_float=57344.0), op.Constant(value_float=448.0))
    v = op.Clip(v, op.Neg(vmax), vmax)
    v = op.Where(op.Unsqueeze(bad, op.Constant(value_ints=[-1])), op.Constant(value_float=math.nan), v)
    q = op.Cast(op.Reshape(v, op.Shape(xf)), to=elem_type)
    return q, scale


@script(kimi, default_opset=op)
def DequantizeMX(q, scale, block: int = 32):
    qf = op.Cast(q, to=1)
    blk = op.Reshape(op.Constant(value_int=block), op.Constant(value_ints=[1]))
    qb = op.Reshape(qf, op.Concat(op.Shape(qf, end=-1), op.Constant(value_ints=[-1]), blk, axis=0))
    s = op.Gather(op.Constant(value=_POW2), op.Cast(scale, to=7))
    yb = op.Mul(qb, op.Unsqueeze(s, op.Constant(value_ints=[-1])))
    y = op.Reshape(yb, op.Shape(qf))
    return y


@script(kimi, default_opset=op)
def QuantizeFP8Tile(x, tile: int = 128, scale_fmt: str = "fp32"):
    xf = op.Cast(x, to=1)
    blk = op.Reshape(op.Constant(value_int=tile), op.Constant(value_ints=[1]))
    xb = op.Reshape(xf, op.Concat(op.Shape(xf, end=-1), op.Constant(value_ints=[-1]), blk, axis=0))
    finite = op.Not(op.Or(op.IsNaN(xb), op.IsInf(xb)))
    bad = op.Greater(op.ReduceMax(op.Cast(op.Not(finite), to=1), op.Constant(value_ints=[-1]), keepdims=0), 0.0)
    amax = op.ReduceMax(op.Abs(op.Where(finite, xb, 0.0)), op.Constant(value_ints=[-1]), keepdims=0)
    amax = op.Max(amax, op.Constant(value_float=1e-4))
    is_ue8m0 = op.Equal(op.Constant(value_string=scale_fmt), op.Constant(value_string="ue8m0"))
    thr = op.Constant(value=_UE8M0_THRESHOLDS)
    b0 = op.Cast(op.Mul(amax, 0.0), to=7)
    c1 = op.Add(b0, op.Constant(value_int=128))
    b1 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c1)), c1, b0)
    c2 = op.Add(b1, op.Constant(value_int=64))
    b2 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c2)), c2, b1)
    c3 = op.Add(b2, op.Constant(value_int=32))
    b3 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c3)), c3, b2)
    c4 = op.Add(b3, op.Constant(value_int=16))
    b4 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c4)), c4, b3)
    c5 = op.Add(b4, op.Constant(value_int=8))
    b5 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c5)), c5, b4)
    c6 = op.Add(b5, op.Constant(value_int=4))
    b6 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c6)), c6, b5)
    c7 = op.Add(b6, op.Constant(value_int=2))
    b7 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c7)), c7, b6)
    c8 = op.Add(b7, op.Constant(value_int=1))
    b8 = op.Where(op.GreaterOrEqual(amax, op.Gather(thr, c8)), c8, b7)
    s_pow2 = op.Gather(op.Constant(value=_POW2), b8)
    s_fp32 = op.Div(amax, op.Constant(value_float=448.0))
    s = op.Where(is_ue8m0, s_pow2, s_fp32)
    scale = op.Where(bad, op.Constant(value_float=math.nan), s)
    v = op.Clip(op.Div(xb, op.Unsqueeze(scale, op.Constant(value_ints=[-1]))), op.Constant(value_float=-448.0),
                op.Constant(value_float=448.0))
    v = op.Where(op.Unsqueeze(bad, op.Constant(value_ints=[-1])), op.Constant(value_float=math.nan), v)
    q = op.Cast(op.Reshape(v, op.Shape(xf)), to=17)
    return q, scale


@script(kimi, default_opset=op)
def DequantizeFP8Tile(q, scale, tile: int = 128):
    qf = op.Cast(q, to=1)
    blk = op.Reshape(op.Constant(value_int=tile), op.Constant(value_ints=[1]))
    qb = op.Reshape(qf, op.Concat(op.Shape(qf, end=-1), op.Constant(value_ints=[-1]), blk, axis=0))
    yb = op.Mul(qb, op.Unsqueeze(op.Cast(scale, to=1), op.Constant(value_ints=[-1])))
    y = op.Reshape(yb, op.Shape(qf))
    return y


@script(kimi, default_opset=op)
def QDQMX(x, block: int = 32, elem_type: int = 17, rounding: str = "floor"):
    q, scale = QuantizeMX(x, block=block, elem_type=elem_type, rounding=rounding)
    y = op.CastLike(DequantizeMX(q, scale, block=block), x)
    return y


@script(kimi, default_opset=op)
def QDQFP8Tile(x, tile: int = 128, scale_fmt: str = "fp32"):
    q, scale = QuantizeFP8Tile(x, tile=tile, scale_fmt=scale_fmt)
    y = op.CastLike(DequantizeFP8Tile(q, scale, tile=tile), x)
    return y


def _finish(fp: onnx.FunctionProto) -> onnx.FunctionProto:
    del fp.opset_import[:]
    fp.opset_import.append(oh.make_opsetid("", ONNX_OPSET))
    return fp


def _inlined(outer, *callees) -> onnx.FunctionProto:
    """outer's FunctionProto with its calls to kimi callees inlined, so it is self-contained (one proto per op)."""
    funcs = [outer.to_function_proto()] + [c.to_function_proto() for c in callees]
    graph = oh.make_graph([], "holder", [], [])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", ONNX_OPSET), oh.make_opsetid("kimi", 1)],
                          functions=funcs)
    ids = [(f.domain, f.name) for f in funcs[1:]]
    model = onnx.inliner.inline_selected_functions(model, ids)
    (fp,) = [f for f in model.functions if f.name == outer.name]
    return _finish(fp)


def function_proto(name: str) -> onnx.FunctionProto:
    """A fresh copy of the self-contained FunctionProto (default-domain opset ONNX_OPSET) of one of the ops above."""
    out = onnx.FunctionProto()
    out.CopyFrom(_build(name))
    return out


@functools.cache
def _build(name: str) -> onnx.FunctionProto:
    if name == "QDQMX":
        fp = _inlined(QDQMX, QuantizeMX, DequantizeMX)
    elif name == "QDQFP8Tile":
        fp = _inlined(QDQFP8Tile, QuantizeFP8Tile, DequantizeFP8Tile)
    else:
        fns = {f.name: f for f in (QuantizeMX, DequantizeMX, QuantizeFP8Tile, DequantizeFP8Tile)}
        if name not in fns:
            known = sorted(fns) + ["QDQFP8Tile", "QDQMX"]
            raise ValueError(f"function_proto: unknown quant op {name!r}; known: {known}")
        fp = _finish(fns[name].to_function_proto())
    return fp
