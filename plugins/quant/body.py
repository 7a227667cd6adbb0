"""Exact ONNX function bodies (opset 23, standard ops only) of the kimi quantization ops, run by ONNX Runtime CPU.

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
The tables are plugins/quant/reference.py's (pow2_table, threshold_table, code_table).

How it stays exact without Log/Pow/BitCast (none is exact or present at opset 23):
- 2^k comes from the constant table ``POW2[b] = 2^(b-127)`` (b = 0..254; 2^-127 is a float32 subnormal; POW2[255] = NaN),
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

import math
from collections.abc import Callable

import numpy as np
from onnx import AttributeProto, FunctionProto, NodeProto, TensorProto, helper

from kimi_compile.onnx_body import attr_const, const, function, ref_attr
from kimi_compile.ops import DOMAIN

from . import reference as ref

_F, _I64 = TensorProto.FLOAT, TensorProto.INT64
MX_ATTRS = {"block": 32, "elem_type": TensorProto.FLOAT8E4M3FN, "rounding": "floor"}  # the ops' attribute defaults
TILE_ATTRS = {"tile": 128, "scale_fmt": "fp32"}
_SEARCH_STEPS = (128, 64, 32, 16, 8, 4, 2, 1)  # 8 steps over the 256 bytes


def _table(name: str, a: np.ndarray) -> NodeProto:
    return const(name, a.ravel().tolist(), _F, dims=list(a.shape))


def _scalar(name: str, v: float | int, dtype: int = _I64) -> NodeProto:
    return const(name, [v], dtype, dims=[])


def _blocks(x: str, key: str, p: str) -> list[NodeProto]:
    """p+"xf" = float32(x), p+"xb" = xf viewed as [..., K / `key`, `key`] (key: the block/tile attribute)."""
    n = helper.make_node
    return [
        n("Cast", [x], [p + "xf"], to=_F),
        attr_const(p + "k0", key, "value_int"), const(p + "one", [1]), const(p + "neg1", [-1]),
        n("Reshape", [p + "k0", p + "one"], [p + "k"]),
        n("Shape", [p + "xf"], [p + "lead"], end=-1),
        n("Concat", [p + "lead", p + "neg1", p + "k"], [p + "bshape"], axis=0),
        n("Reshape", [p + "xf", p + "bshape"], [p + "xb"]),
    ]


def _amax(p: str) -> list[NodeProto]:
    """p+"finite" (per element), p+"bad" (a block holds NaN/Inf), p+"amax" (max |finite element| per block)."""
    n = helper.make_node
    return [
        n("IsNaN", [p + "xb"], [p + "isnan"]), n("IsInf", [p + "xb"], [p + "isinf"]),
        n("Or", [p + "isnan", p + "isinf"], [p + "nonfinite"]), n("Not", [p + "nonfinite"], [p + "finite"]),
        n("Not", [p + "finite"], [p + "bad_e"]), n("Cast", [p + "bad_e"], [p + "bad_f"], to=_F),
        n("ReduceMax", [p + "bad_f", p + "neg1"], [p + "bad_n"], keepdims=0),
        _scalar(p + "zero_f", 0.0, _F), n("Greater", [p + "bad_n", p + "zero_f"], [p + "bad"]),
        n("Where", [p + "finite", p + "xb", p + "zero_f"], [p + "xfin"]), n("Abs", [p + "xfin"], [p + "xabs"]),
        n("ReduceMax", [p + "xabs", p + "neg1"], [p + "amax"], keepdims=0),
    ]


def _byte_search(amax: str, thr: str, out: str, p: str) -> list[NodeProto]:
    """out = max{c : amax >= thr[c]} (0 if none), an 8-step binary search over a monotone table thr[256]."""
    n = helper.make_node
    nodes = [n("Mul", [amax, p + "zero_f"], [p + "b_f"]), n("Cast", [p + "b_f"], [p + "b0"], to=_I64)]
    for i, step in enumerate(_SEARCH_STEPS):
        b, c, nxt = f"{p}b{i}", f"{p}c{i + 1}", out if i == len(_SEARCH_STEPS) - 1 else f"{p}b{i + 1}"
        nodes += [_scalar(f"{p}step{i + 1}", step), n("Add", [b, f"{p}step{i + 1}"], [c]),
                  n("Gather", [thr, c], [c + "_t"]), n("GreaterOrEqual", [amax, c + "_t"], [c + "_ge"]),
                  n("Where", [c + "_ge", c, b], [nxt])]
    return nodes


def _finish_codes(v: str, q: str, p: str, to: str | int) -> list[NodeProto]:
    """q = FP8 codes of the clipped scaled values v [..., nb, k] (NaN blocks NaN), reshaped like x; `to` the element
    type, or the name of the attribute that holds it."""
    n = helper.make_node
    cast = n("Cast", [p + "vflat"], [q]) if isinstance(to, str) else n("Cast", [p + "vflat"], [q], to=to)
    if isinstance(to, str):
        ref_attr(cast, "to", to, AttributeProto.INT)
    return [
        n("Unsqueeze", [p + "bad", p + "neg1"], [p + "bad_b"]), _scalar(p + "nan", math.nan, _F),
        n("Where", [p + "bad_b", p + "nan", v], [p + "vnan"]),
        n("Shape", [p + "xf"], [p + "xshape"]), n("Reshape", [p + "vnan", p + "xshape"], [p + "vflat"]),
        cast,
    ]


def _quantize_mx(x: str, q: str, scale: str, p: str) -> list[NodeProto]:
    n = helper.make_node
    thresholds = np.stack([ref.threshold_table(e, r) for e in ("e4m3", "e5m2") for r in ("floor", "ceil")])
    return [
        *_blocks(x, "block", p), *_amax(p),
        # row of the threshold table = 2 * (elem_type == FLOAT8E5M2) + (rounding == "ceil")
        attr_const(p + "rounding", "rounding", "value_string"),
        n("Constant", [], [p + "ceil"], value_string="ceil"), n("Equal", [p + "rounding", p + "ceil"], [p + "is_ceil"]),
        attr_const(p + "elem_type", "elem_type", "value_int"), _scalar(p + "e5m2", TensorProto.FLOAT8E5M2),
        n("Equal", [p + "elem_type", p + "e5m2"], [p + "is_e5m2"]),
        n("Cast", [p + "is_e5m2"], [p + "is_e5m2_i"], to=_I64), _scalar(p + "two", 2),
        n("Mul", [p + "is_e5m2_i", p + "two"], [p + "row2"]), n("Cast", [p + "is_ceil"], [p + "is_ceil_i"], to=_I64),
        n("Add", [p + "row2", p + "is_ceil_i"], [p + "row"]),
        _table(p + "thresholds", thresholds), n("Gather", [p + "thresholds", p + "row"], [p + "thr"], axis=0),
        *_byte_search(p + "amax", p + "thr", p + "byte_found", p),
        _scalar(p + "nan_byte", ref.E8M0_NAN), n("Where", [p + "bad", p + "nan_byte", p + "byte_found"], [p + "byte"]),
        n("Cast", [p + "byte"], [scale], to=TensorProto.UINT8),
        # v = x * 2^-e (POW2[254 - byte]), clipped to the element format's max normal
        _table(p + "pow2", ref.pow2_table()), _scalar(p + "b254", 254),
        n("Sub", [p + "b254", p + "byte"], [p + "inv_byte"]), n("Gather", [p + "pow2", p + "inv_byte"], [p + "inv"]),
        n("Unsqueeze", [p + "inv", p + "neg1"], [p + "inv_b"]), n("Mul", [p + "xb", p + "inv_b"], [p + "v"]),
        _scalar(p + "max_e5m2", ref.ELEM_FORMATS["e5m2"].max_normal, _F),
        _scalar(p + "max_e4m3", ref.ELEM_FORMATS["e4m3"].max_normal, _F),
        n("Where", [p + "is_e5m2", p + "max_e5m2", p + "max_e4m3"], [p + "vmax"]), n("Neg", [p + "vmax"], [p + "vmin"]),
        n("Clip", [p + "v", p + "vmin", p + "vmax"], [p + "vc"]),
        *_finish_codes(p + "vc", q, p, "elem_type"),
    ]


def _dequantize(q: str, scale: str, y: str, key: str, p: str) -> list[NodeProto]:
    """y = float32(q) * the block's scale: POW2[scale byte] (key "block", E8M0) or the float32 scale (key "tile")."""
    n = helper.make_node
    if key == "block":
        s = [_table(p + "pow2", ref.pow2_table()), n("Cast", [scale], [p + "sbyte"], to=_I64),
             n("Gather", [p + "pow2", p + "sbyte"], [p + "s"])]
    else:
        s = [n("Cast", [scale], [p + "s"], to=_F)]
    return [
        *_blocks(q, key, p), *s,
        n("Unsqueeze", [p + "s", p + "neg1"], [p + "s_b"]), n("Mul", [p + "xb", p + "s_b"], [p + "yb"]),
        n("Shape", [p + "xf"], [p + "xshape"]), n("Reshape", [p + "yb", p + "xshape"], [y]),
    ]


def _quantize_fp8_tile(x: str, q: str, scale: str, p: str) -> list[NodeProto]:
    n = helper.make_node
    e4m3 = ref.ELEM_FORMATS["e4m3"]
    return [
        *_blocks(x, "tile", p), *_amax(p),
        _scalar(p + "amax_floor", float(ref.FP8_TILE_AMAX_FLOOR), _F),
        n("Max", [p + "amax", p + "amax_floor"], [p + "amax_c"]),
        # scale: amax / 448 (fp32) or the power of two 2^ceil(log2(amax / 448)) (ue8m0), NaN for a bad tile
        attr_const(p + "scale_fmt", "scale_fmt", "value_string"),
        n("Constant", [], [p + "ue8m0"], value_string="ue8m0"),
        n("Equal", [p + "scale_fmt", p + "ue8m0"], [p + "is_ue8m0"]),
        _table(p + "thr", ref.threshold_table("e4m3", "ceil")),
        *_byte_search(p + "amax_c", p + "thr", p + "byte", p),
        _table(p + "pow2", ref.pow2_table()), n("Gather", [p + "pow2", p + "byte"], [p + "s_pow2"]),
        _scalar(p + "max", e4m3.max_normal, _F), n("Div", [p + "amax_c", p + "max"], [p + "s_fp32"]),
        n("Where", [p + "is_ue8m0", p + "s_pow2", p + "s_fp32"], [p + "s"]),
        _scalar(p + "nan_s", math.nan, _F), n("Where", [p + "bad", p + "nan_s", p + "s"], [scale]),
        n("Unsqueeze", [scale, p + "neg1"], [p + "scale_b"]), n("Div", [p + "xb", p + "scale_b"], [p + "v"]),
        n("Neg", [p + "max"], [p + "min"]), n("Clip", [p + "v", p + "min", p + "max"], [p + "vc"]),
        *_finish_codes(p + "vc", q, p, e4m3.onnx_type),
    ]


def _family(quantize: Callable[..., list[NodeProto]], key: str, defaults: dict, names: tuple[str, str, str]):
    """The three bodies of one format: Quantize(x) -> (q, scale), Dequantize(q, scale) -> y and QDQ(x) -> y
    (quantize then dequantize, CastLike x)."""
    q_name, dq_name, qdq_name = names

    def quantize_fn() -> FunctionProto:
        return function(q_name, ["x"], ["q", "scale"], quantize("x", "q", "scale", ""), defaults=defaults)

    def dequantize_fn() -> FunctionProto:
        return function(dq_name, ["q", "scale"], ["y"], _dequantize("q", "scale", "y", key, ""),
                        defaults={key: defaults[key]})

    def qdq_fn() -> FunctionProto:
        nodes = [*quantize("x", "qx_q", "qx_scale", "qx_"), *_dequantize("qx_q", "qx_scale", "dq_y", key, "dq_"),
                 helper.make_node("CastLike", ["dq_y", "x"], ["y"])]
        return function(qdq_name, ["x"], ["y"], nodes, defaults=defaults)

    return quantize_fn, dequantize_fn, qdq_fn


quantize_mx, dequantize_mx, qdq_mx = _family(_quantize_mx, "block", MX_ATTRS,
                                             ("QuantizeMX", "DequantizeMX", "QDQMX"))
quantize_fp8_tile, dequantize_fp8_tile, qdq_fp8_tile = _family(
    _quantize_fp8_tile, "tile", TILE_ATTRS, ("QuantizeFP8Tile", "DequantizeFP8Tile", "QDQFP8Tile"))


def dequant_nodes(codes: str, scale: str, out: str, kind: str, elem: str, block_attr: str) -> list[NodeProto]:
    """The read of a quantized pool inside another op's body, exactly as the quantize pass reads it: uint8 bits ->
    FP8 codes (code table lookup, Cast) -> kimi.DequantizeMX (kind mx, E8M0 scales) | kimi.DequantizeFP8Tile (kind
    tile, float32 scales), its block/tile from the calling node's attribute `block_attr`."""
    n = helper.make_node
    p = out + "_"
    deq = n("DequantizeMX" if kind == "mx" else "DequantizeFP8Tile", [p + "q", scale], [out], domain=DOMAIN)
    return [
        n("Cast", [codes], [p + "i"], to=TensorProto.INT32),
        const(p + "table", ref.code_table(elem).tolist(), _F, dims=[256]),
        n("Gather", [p + "table", p + "i"], [p + "v"], axis=0),
        n("Cast", [p + "v"], [p + "q"], to=ref.elem_format(elem).onnx_type),
        ref_attr(deq, "block" if kind == "mx" else "tile", block_attr, AttributeProto.INT),
    ]
