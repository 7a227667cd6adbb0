"""TensorRT lowering of the quantization ops: the exact ONNX bodies, made explicit-Q/DQ for strongly typed networks.

TensorRT accepts an FP8 tensor only from a Quantize (or plugin, constant, concat, shuffle) layer, and no UINT8
intermediate tensors (measured with tensorrt_rtx 1.7.1: "Tensor ... has datatype FP8 but is not produced by ...
IQuantizeLayer", "TensorRT does not support UINT8 types for intermediate tensors"). The bodies in body.py
use plain Casts, so the inlined body is rewritten:

    Cast(x, to=FP8)            -> QuantizeLinear(x, 1.0f, zero_point=FP8 0)      (the body clips to +-max first, so
                                                                                  saturation never decides a value)
    Cast(q_fp8, to=FLOAT)      -> DequantizeLinear(q_fp8, 1.0f)
    Cast(b, to=UINT8)          -> Cast(b, to=INT32) unless it produces an output of the op (E8M0 bytes 0..255 are
                                  exact in int32; indices and arithmetic downstream are unchanged)

Both flavours lower natively: TensorRT's own MXFP8 dynamic quantization (IDynamicQuantizeLayer) rounds by its own
rule; the recipe's rounding (floor or ceil) and the exact E8M0 search are kept by the body.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from kimi_compile.lowering import Native

_FP8 = (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2)
_DEQUANT_OPS = ("DequantizeMX", "DequantizeFP8Tile")  # input 0 is typed FP8


def _attr(n: onnx.NodeProto, name: str):
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def explicit_qdq(call: onnx.NodeProto, body: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The inlined body of one quant node with FP8 Casts as Q/DQ and internal UINT8 as INT32."""
    fp8 = {call.input[0]} if call.op_type in _DEQUANT_OPS and call.input else set()
    outputs = set(call.output)
    out: list[onnx.NodeProto] = []
    for n in body:
        to = _attr(n, "to") if n.op_type == "Cast" and n.domain in ("", "ai.onnx") else None
        if to in _FP8:
            one, zp = f"{n.name}/one", f"{n.name}/zero_point"
            out.append(helper.make_node("Constant", [], [one], name=one,
                                        value=helper.make_tensor(one, TensorProto.FLOAT, [], [1.0])))
            out.append(helper.make_node("Constant", [], [zp], name=zp, value=helper.make_tensor(zp, to, [], [0])))
            out.append(helper.make_node("QuantizeLinear", [n.input[0], one, zp], list(n.output), name=n.name))
            fp8.add(n.output[0])
        elif to is not None and n.input[0] in fp8:
            one = f"{n.name}/one"
            out.append(helper.make_node("Constant", [], [one], name=one,
                                        value=helper.make_tensor(one, TensorProto.FLOAT, [], [1.0])))
            dq = helper.make_node("DequantizeLinear", [n.input[0], one], [n.output[0] + "/f32"] if
                                  to != TensorProto.FLOAT else list(n.output), name=n.name)
            out.append(dq)
            if to != TensorProto.FLOAT:
                out.append(helper.make_node("Cast", [dq.output[0]], list(n.output), name=n.name + "/cast", to=to))
        elif to == TensorProto.UINT8 and n.output[0] not in outputs:
            out.append(helper.make_node("Cast", list(n.input), list(n.output), name=n.name, to=TensorProto.INT32))
        else:
            out.append(n)
    return out


_Q = Native("exact ONNX body inlined; FP8 Casts become explicit QuantizeLinear/DequantizeLinear (IQuantizeLayer/"
            "IDequantizeLayer, scale 1) and internal E8M0 bytes int32, as strongly typed TensorRT requires",
            version=1, rewrite=explicit_qdq)

TENSORRT = {op: {"tensorrt": _Q, "tensorrt_rtx": _Q}
            for op in ("QuantizeMX", "DequantizeMX", "QDQMX", "QuantizeFP8Tile", "DequantizeFP8Tile", "QDQFP8Tile")}
