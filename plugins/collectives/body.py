"""ONNX function bodies of the collectives: at world size 1 every collective is the identity, which is what ONNX
Runtime runs (a partitioned artifact with more ranks runs on the cuda backend, over torch.distributed)."""

from __future__ import annotations

from onnx import FunctionProto, helper

from kimi_compile.onnx_body import function

INPUTS = ("x",)
OUTPUTS = ("y",)
# group: the process group by name ("tp": the tensor-parallel group of this rank); world: its size
ATTRS = {
    "AllReduce": {"group": "tp", "world": 1},
    "AllGather": {"axis": 0, "group": "tp", "world": 1},
    "ReduceScatter": {"axis": 0, "group": "tp", "world": 1},
    "AllToAll": {"split_axis": 0, "concat_axis": 0, "group": "tp", "world": 1},
}


def identity(name: str):
    def build() -> FunctionProto:
        return function(name, INPUTS, OUTPUTS, [helper.make_node("Identity", ["x"], ["y"])], list(ATTRS[name]))
    build.__name__ = name
    return build
