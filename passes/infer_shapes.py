"""infer_shapes: ONNX shape and dtype inference over the graph (local kimi functions included), recording how many
values gained a shape."""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import onnx_ir.passes.common as common

from kimi_compile.passbase import KimiPass, PassStats


def _known(model: ir.Model) -> int:
    return sum(1 for n in model.graph for v in n.outputs if v.shape is not None and v.dtype is not None)


class InferShapesPass(KimiPass):
    name = "infer_shapes"
    version = 1

    @dataclasses.dataclass(frozen=True)
    class Options:
        strict: bool = False
        data_prop: bool = True  # propagate shape values through Shape/Gather/Concat chains

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        before = _known(model)
        common.ShapeInferencePass(check_type=True, strict_mode=self.options.strict, data_prop=self.options.data_prop)(model)
        after = _known(model)
        stats.counts.update({"values_typed": after - before, "values_total": sum(len(n.outputs) for n in model.graph)})
        return after != before


PASS = InferShapesPass
