"""Builders shared by the ONNX function bodies in plugins/<op>/body.py, all in one style: `onnx.helper` nodes
(`n = helper.make_node`) with explicit value names; constants from `const`; the calling node's attribute values as
constants from `attr_const`; attributes forwarded from the calling node by `ref_attr`; the FunctionProto (domain
`kimi`, default-domain opset ONNX_OPSET) from `function`. The paged-pool read and the causal mask that several ops
share live here; the read of a quantized pool is plugins/quant/body.py's `dequant_nodes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onnx import AttributeProto, FunctionProto, NodeProto, TensorProto, helper

from kimi_compile.ops import DOMAIN, ONNX_OPSET

MASKED = -1e30  # the score of a position no query may see: finite, so a Softmax over a fully masked row stays finite

_REF_TYPES = {"value_int": AttributeProto.INT, "value_float": AttributeProto.FLOAT,
              "value_string": AttributeProto.STRING, "value_ints": AttributeProto.INTS}
_ZERO = {AttributeProto.INT: 0, AttributeProto.FLOAT: 0.0, AttributeProto.STRING: "", AttributeProto.INTS: []}


def const(name: str, vals: list, dtype: int = TensorProto.INT64, dims: list | None = None) -> NodeProto:
    """A Constant node `name` holding `vals` (1-D by default; dims=[] for a scalar)."""
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, dtype, [len(vals)] if dims is None else dims, vals))


def attr_const(name: str, attr: str, kind: str = "value_float") -> NodeProto:
    """A Constant node `name` whose value is the calling node's attribute `attr` (kind value_float, value_int,
    value_string or value_ints)."""
    node = helper.make_node("Constant", [], [name])
    return ref_attr(node, kind, attr, _REF_TYPES[kind])


def ref_attr(node: NodeProto, name: str, attr: str, kind: int = AttributeProto.FLOAT) -> NodeProto:
    """Give `node` the attribute `name` whose value is the calling node's attribute `attr` (AttributeProto type
    `kind`); returns the node."""
    a = helper.make_attribute(name, _ZERO[kind], attr_type=kind)
    a.ref_attr_name = attr
    node.attribute.append(a)
    return node


def function(name: str, inputs: Sequence[str], outputs: Sequence[str], nodes: Sequence[NodeProto],
             attributes: Sequence[str] = (), *, defaults: Mapping[str, Any] | None = None, overload: str = "",
             calls_kimi: bool = False) -> FunctionProto:
    """The FunctionProto kimi.<name>: `attributes` without a default, `defaults` {attribute: value} with one;
    `calls_kimi` when the body calls other kimi ops; `overload` names a variant (quantized formats)."""
    opsets = [helper.make_opsetid("", ONNX_OPSET)] + ([helper.make_opsetid(DOMAIN, 1)] if calls_kimi else [])
    protos = [helper.make_attribute(k, v) for k, v in (defaults or {}).items()]
    return helper.make_function(DOMAIN, name, list(inputs), list(outputs), list(nodes), opsets,
                                attributes=list(attributes), attribute_protos=protos or None,
                                overload=overload or None)


def paged_keys_nodes(pool: str, block_table: str, out: str) -> list[NodeProto]:
    """out [B, MB*BS, D] = the rows of a paged pool [NB, BS, D] in sequence order (block table [B, MB])."""
    n = helper.make_node
    p = out + "_"
    return [
        const(p + "neg1", [-1]),
        n("Reshape", [block_table, p + "neg1"], [p + "flat_bt"]),
        n("Gather", [pool, p + "flat_bt"], [p + "blocks"], axis=0),  # [B*MB, BS, D]
        n("Shape", [block_table], [p + "b"], start=0, end=1),
        n("Shape", [pool], [p + "d"], start=-1),
        n("Concat", [p + "b", p + "neg1", p + "d"], [p + "shape"], axis=0),
        n("Reshape", [p + "blocks", p + "shape"], [out]),
    ]


def causal_mask_nodes(q: str, keys: str, start: str, lengths: str, out: str) -> list[NodeProto]:
    """out [B,T,S] = s <= start[b] + t and s < start[b] + lengths[b] (q [B,T,...], keys [B,S,...])."""
    n = helper.make_node
    p = out + "_"
    return [
        const(p + "zero", [0], dims=[]), const(p + "one", [1], dims=[]), const(p + "ax0", [0]),
        const(p + "ax1", [1]), const(p + "axm1", [-1]), const(p + "ax01", [0, 1]),
        n("Shape", [q], [p + "tshape"], start=1, end=2), n("Squeeze", [p + "tshape", p + "ax0"], [p + "T"]),
        n("Shape", [keys], [p + "sshape"], start=1, end=2), n("Squeeze", [p + "sshape", p + "ax0"], [p + "S"]),
        n("Range", [p + "zero", p + "T", p + "one"], [p + "tpos"]),
        n("Range", [p + "zero", p + "S", p + "one"], [p + "spos"]),
        n("Unsqueeze", [start, p + "ax1"], [p + "start2"]),
        n("Unsqueeze", [p + "tpos", p + "ax0"], [p + "tpos2"]),
        n("Add", [p + "start2", p + "tpos2"], [p + "qpos"]),  # [B,T]
        n("Unsqueeze", [p + "qpos", p + "axm1"], [p + "qpos3"]),  # [B,T,1]
        n("Unsqueeze", [p + "spos", p + "ax01"], [p + "spos3"]),  # [1,1,S]
        n("Add", [start, lengths], [p + "end"]),
        n("Unsqueeze", [p + "end", p + "ax1"], [p + "end2"]),
        n("Unsqueeze", [p + "end2", p + "ax1"], [p + "end3"]),  # [B,1,1]
        n("LessOrEqual", [p + "spos3", p + "qpos3"], [p + "causal"]),
        n("Less", [p + "spos3", p + "end3"], [p + "inseq"]),
        n("And", [p + "causal", p + "inseq"], [out]),
    ]
