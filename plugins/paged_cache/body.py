"""ONNX function bodies of kimi.PagedWrite (Reshape -> ScatterND over the flat rows -> Reshape: a new pool tensor)
and kimi.PagedGather (the pool rows in sequence order through the block table)."""

from __future__ import annotations

from onnx import FunctionProto, helper

from kimi_compile.onnx_body import const, function, paged_keys_nodes


def paged_write() -> FunctionProto:
    n = helper.make_node
    nodes = [
        const("neg1", [-1]),
        n("Shape", ["pool"], ["pshape"]),
        const("ax1", [1]),
        n("Shape", ["pool"], ["d_shape"], start=-1),
        n("Concat", ["neg1", "d_shape"], ["flat2"], axis=0),
        n("Reshape", ["pool", "flat2"], ["flat"]),
        n("Unsqueeze", ["slots", "ax1"], ["idx"]),
        n("Reshape", ["values", "flat2"], ["vals2"]),
        n("ScatterND", ["flat", "idx", "vals2"], ["flat_out"]),
        n("Reshape", ["flat_out", "pshape"], ["out"]),
    ]
    return function("PagedWrite", ["pool", "slots", "values"], ["out"], nodes)


def paged_gather() -> FunctionProto:
    return function("PagedGather", ["pool", "block_table"], ["out"], paged_keys_nodes("pool", "block_table", "out"))
