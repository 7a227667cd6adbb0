"""Quantization ops: MXFP8 (E8M0 scale per 32) and FP8 E4M3 tile (per 128) quantize / dequantize / fake-quant.

Registers kimi.QuantizeMX, kimi.DequantizeMX, kimi.QDQMX, kimi.QuantizeFP8Tile, kimi.DequantizeFP8Tile and
kimi.QDQFP8Tile. Semantics, edge cases and the format tables: reference.py; exact ONNX bodies: body.py.

Attributes (validated by shape inference, which names the op and the attribute):
    block: int > 0 (MX, default 32), tile: int > 0 (default 128): the last input dim must be a multiple of it;
    elem_type: TensorProto.FLOAT8E4M3FN (17, default) or FLOAT8E5M2 (19): the type of q;
    rounding: "floor" (OCP MX) or "ceil" (DeepSeek/RCEIL); scale_fmt: "fp32" or "ue8m0".
Registered references take numpy inputs and the node attributes as keywords. FP8 codes travel as uint8 (that is
what ONNX Runtime returns for FLOAT8E4M3FN outputs) or as ml_dtypes float8 arrays, whose dtype names the format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference
from .body import MX_ATTRS, TILE_ATTRS
from .reference import ELEM_BY_ONNX_TYPE

_FLOAT_INPUTS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _attrs(op: str, defaults: dict[str, Any], attrs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(attrs) - set(defaults))
    if unknown:
        raise ValueError(f"kimi.{op}: unknown attribute(s) {unknown}; expected {sorted(defaults)}")
    a = {**defaults, **attrs}
    for key in ("block", "tile"):
        if key in a and (not isinstance(a[key], (int, np.integer)) or a[key] <= 0):
            raise ValueError(f"kimi.{op}: attribute {key} must be a positive int, got {a[key]!r}")
    if "elem_type" in a and a["elem_type"] not in ELEM_BY_ONNX_TYPE:
        raise ValueError(f"kimi.{op}: attribute elem_type must be FLOAT8E4M3FN (17) or FLOAT8E5M2 (19), "
                         f"got {a['elem_type']!r}")
    if "rounding" in a and a["rounding"] not in reference.ROUNDINGS:
        raise ValueError(f"kimi.{op}: attribute rounding must be one of {list(reference.ROUNDINGS)}, "
                         f"got {a['rounding']!r}")
    if "scale_fmt" in a and a["scale_fmt"] not in reference.SCALE_FMTS:
        raise ValueError(f"kimi.{op}: attribute scale_fmt must be one of {list(reference.SCALE_FMTS)}, "
                         f"got {a['scale_fmt']!r}")
    return a


def _grouped_shape(op: str, name: str, t: TensorType | None, group: int, key: str):
    """(full shape, shape with the last dim divided by group); None where unknown."""
    if t is None or t.shape is None:
        return None, None
    if len(t.shape) == 0:
        raise ValueError(f"kimi.{op}: input {name} must have at least one axis, got a scalar")
    k = t.shape[-1]
    if isinstance(k, int):
        if k % group:
            raise ValueError(f"kimi.{op}: input {name} last dim {k} must be divisible by {key}={group}")
        return t.shape, (*t.shape[:-1], k // group)
    return t.shape, (*t.shape[:-1], None)


def _check_dtype(op: str, name: str, t: TensorType | None, allowed: Sequence[int]) -> None:
    if t is not None and t.dtype not in allowed:
        names = [TensorProto.DataType.Name(d) for d in allowed]
        raise ValueError(f"kimi.{op}: input {name} must be one of {names}, got {TensorProto.DataType.Name(t.dtype)}")


def _infer_quantize(op: str, defaults: dict[str, Any], key: str):
    def infer(types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        a = _attrs(op, defaults, attrs)
        x = types[0]
        _check_dtype(op, "x", x, _FLOAT_INPUTS)
        shape, gshape = _grouped_shape(op, "x", x, a[key], key)
        qtype = a.get("elem_type", TensorProto.FLOAT8E4M3FN)
        stype = TensorProto.UINT8 if key == "block" else TensorProto.FLOAT
        return [TensorType(shape, qtype), TensorType(gshape, stype)]

    return infer


def _infer_dequantize(op: str, defaults: dict[str, Any], key: str):
    def infer(types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        a = _attrs(op, defaults, attrs)
        q, scale = types[0], types[1]
        _check_dtype(op, "q", q, tuple(ELEM_BY_ONNX_TYPE) if key == "block" else (TensorProto.FLOAT8E4M3FN,))
        _check_dtype(op, "scale", scale, (TensorProto.UINT8,) if key == "block" else (TensorProto.FLOAT,))
        shape, gshape = _grouped_shape(op, "q", q, a[key], key)
        if gshape is not None and scale is not None and scale.shape is not None:
            if len(scale.shape) != len(gshape) or any(
                isinstance(s, int) and isinstance(g, int) and s != g for s, g in zip(scale.shape, gshape)
            ):
                raise ValueError(f"kimi.{op}: input scale shape {scale.shape} must be q.shape[:-1] + (K // {key},) "
                                 f"= {gshape}")
        return [TensorType(shape, TensorProto.FLOAT)]

    return infer


def _infer_qdq(op: str, defaults: dict[str, Any], key: str):
    def infer(types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
        a = _attrs(op, defaults, attrs)
        x = types[0]
        _check_dtype(op, "x", x, _FLOAT_INPUTS)
        shape, _ = _grouped_shape(op, "x", x, a[key], key)
        return [TensorType(shape, x.dtype if x is not None else TensorProto.FLOAT)]

    return infer


def _codes(q: Any) -> tuple[np.ndarray, str]:
    """(uint8 codes, elem) from an ml_dtypes float8 array or uint8 E4M3FN codes."""
    q = np.asarray(q)
    if q.dtype == ml_dtypes.float8_e5m2:
        return q.view(np.uint8), "e5m2"
    if q.dtype in (ml_dtypes.float8_e4m3fn, np.uint8):
        return q.view(np.uint8), "e4m3"
    raise ValueError(f"q must be uint8 E4M3FN codes or an ml_dtypes float8_e4m3fn/float8_e5m2 array, got {q.dtype}")


def quantize_mx_ref(x, *, block=32, elem_type=TensorProto.FLOAT8E4M3FN, rounding="floor"):
    """kimi.QuantizeMX reference: (q uint8 codes, scale uint8 E8M0 bytes)."""
    a = _attrs("QuantizeMX", MX_ATTRS, {"block": block, "elem_type": elem_type, "rounding": rounding})
    return reference.mx_quantize(x, block=a["block"], elem=ELEM_BY_ONNX_TYPE[a["elem_type"]], rounding=a["rounding"])


def dequantize_mx_ref(q, scale, *, block=32):
    """kimi.DequantizeMX reference: float32."""
    codes, elem = _codes(q)
    return reference.mx_dequantize(codes, scale, block=block, elem=elem)


def qdq_mx_ref(x, *, block=32, elem_type=TensorProto.FLOAT8E4M3FN, rounding="floor"):
    """kimi.QDQMX reference: dequantize(quantize(x)) cast to x's dtype."""
    q, s = quantize_mx_ref(x, block=block, elem_type=elem_type, rounding=rounding)
    y = reference.mx_dequantize(q, s, block=block, elem=ELEM_BY_ONNX_TYPE[elem_type])
    return y.astype(np.asarray(x).dtype)


def quantize_fp8_tile_ref(x, *, tile=128, scale_fmt="fp32"):
    """kimi.QuantizeFP8Tile reference: (q uint8 E4M3FN codes, scale float32)."""
    return reference.fp8_tile_quantize(x, tile=tile, scale_fmt=scale_fmt)


def dequantize_fp8_tile_ref(q, scale, *, tile=128):
    """kimi.DequantizeFP8Tile reference: float32."""
    codes, elem = _codes(q)
    if elem != "e4m3":
        raise ValueError(f"kimi.DequantizeFP8Tile: q must hold E4M3FN codes, got {np.asarray(q).dtype}")
    return reference.fp8_tile_dequantize(codes, scale, tile=tile)


def qdq_fp8_tile_ref(x, *, tile=128, scale_fmt="fp32"):
    """kimi.QDQFP8Tile reference: dequantize(quantize(x)) cast to x's dtype."""
    return reference.fp8_tile_qdq(x, tile=tile, scale_fmt=scale_fmt).astype(np.asarray(x).dtype)


OPS = (
    OpDef("QuantizeMX", ("x",), ("q", "scale"), dict(MX_ATTRS), body.quantize_mx,
          _infer_quantize("QuantizeMX", MX_ATTRS, "block"), quantize_mx_ref,
          doc="MX block quantization: FP8 elements + one E8M0 (uint8) scale per block of the last axis", kind="quant"),
    OpDef("DequantizeMX", ("q", "scale"), ("y",), {"block": 32}, body.dequantize_mx,
          _infer_dequantize("DequantizeMX", {"block": 32}, "block"), dequantize_mx_ref,
          doc="float32(q) * 2^(scale - 127) per block; scale 0xFF -> NaN", kind="quant"),
    OpDef("QDQMX", ("x",), ("y",), dict(MX_ATTRS), body.qdq_mx,
          _infer_qdq("QDQMX", MX_ATTRS, "block"), qdq_mx_ref,
          doc="MX fake quantization (quantize then dequantize), output dtype = input dtype", kind="quant"),
    OpDef("QuantizeFP8Tile", ("x",), ("q", "scale"), dict(TILE_ATTRS), body.quantize_fp8_tile,
          _infer_quantize("QuantizeFP8Tile", TILE_ATTRS, "tile"), quantize_fp8_tile_ref,
          doc="FP8 E4M3 per-tile quantization, float32 scale per tile of the last axis", kind="quant"),
    OpDef("DequantizeFP8Tile", ("q", "scale"), ("y",), {"tile": 128}, body.dequantize_fp8_tile,
          _infer_dequantize("DequantizeFP8Tile", {"tile": 128}, "tile"), dequantize_fp8_tile_ref,
          doc="float32(q) * scale per tile", kind="quant"),
    OpDef("QDQFP8Tile", ("x",), ("y",), dict(TILE_ATTRS), body.qdq_fp8_tile,
          _infer_qdq("QDQFP8Tile", TILE_ATTRS, "tile"), qdq_fp8_tile_ref,
          doc="FP8 tile fake quantization (quantize then dequantize), output dtype = input dtype", kind="quant"),
)

for _op in OPS:
    register(_op)
