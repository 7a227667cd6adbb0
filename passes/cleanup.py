"""cleanup: dead code elimination and constant folding that leaves `kimi.*` nodes (and their functions) alone.

    before: ... -> Shape -> Gather(const) -> Cast -> (unused branch) ...
    after:  constants folded, unused nodes/initializers/functions removed; every kimi.* node untouched
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
import onnx_ir.passes.common as common

from kimi_compile.ops import DOMAIN
from kimi_compile.passbase import KimiPass, PassStats


# Layout-only ops (exact, no arithmetic) are folded over constants whatever their size: weight reshapes, transposes
# and slices (the per-head W_UK / W_UV views of kv_b, ...) must become initializers at every model size, or the
# fusions that need constant weights refuse on large models while they match on small ones.
LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Slice", "Squeeze", "Unsqueeze", "Split", "Identity", "Concat"})


def _should_fold(node: ir.Node) -> bool | None:
    if node.domain == DOMAIN:
        return False
    if node.domain == "" and node.op_type in LAYOUT_OPS:
        return True
    return None  # the folder's default rules and size limits


class CleanupPass(KimiPass):
    name = "cleanup"
    version = 2

    @dataclasses.dataclass(frozen=True)
    class Options:
        fold_constants: bool = True

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        kimi_before = sum(1 for n in model.graph if n.domain == DOMAIN)
        nodes_before = len(model.graph)
        inits_before = len(model.graph.initializers)
        if self.options.fold_constants:
            from onnxscript.optimizer._constant_folding import FoldConstantsPass

            FoldConstantsPass(shape_inference=False, input_size_limit=1 << 16, output_size_limit=1 << 20,
                              should_fold=_should_fold)(model)
        common.RemoveUnusedNodesPass()(model)
        used = {(n.domain, n.op_type, n.overload) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
        removed_fn = [k for k in model.functions if k not in used]
        for k in removed_fn:
            del model.functions[k]
        kimi_after = sum(1 for n in model.graph if n.domain == DOMAIN)
        assert kimi_after == kimi_before, "cleanup must not touch kimi.* nodes"
        stats.counts.update({
            "nodes_removed": nodes_before - len(model.graph),
            "initializers_removed": inits_before - len(model.graph.initializers),
            "functions_removed": len(removed_fn),
        })
        return nodes_before != len(model.graph) or inits_before != len(model.graph.initializers) or bool(removed_fn)


PASS = CleanupPass
