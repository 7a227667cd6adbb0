"""Small builders for the ONNX function bodies in plugins/ (onnx.helper nodes)."""

from __future__ import annotations

from onnx import AttributeProto, TensorProto, helper


def const(name: str, vals: list, dtype: int = TensorProto.INT64, dims: list | None = None):
    """A Constant node `name` holding `vals` (1-D by default; dims=[] for a scalar)."""
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, dtype, [len(vals)] if dims is None else dims, vals))


def attr_const(name: str, attr: str, kind: str = "value_float"):
    """A scalar Constant node `name` whose value is the calling node's attribute `attr` (value_float or value_int)."""
    is_int = kind == "value_int"
    a = helper.make_attribute(kind, 0 if is_int else 0.0)
    a.ref_attr_name, a.type = attr, AttributeProto.INT if is_int else AttributeProto.FLOAT
    node = helper.make_node("Constant", [], [name])
    node.attribute.append(a)
    return node
