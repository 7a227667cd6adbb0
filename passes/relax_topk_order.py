"""relax_topk_order: a top-k selection whose every reader takes it as a set need not be sorted.

    before: indices, scores = kimi.IndexerTopK[topk, sorted=1](...)   (indices sorted by score, then position)
            o = kimi.SparseMLA(..., indices, ...)                      (softmax over the selected rows: a set)
    after:  indices, scores = kimi.IndexerTopK[topk, sorted=0](...)   (the same positions, in any order)

Taken only when every reader of `indices` is a set reader (`SET_READERS`: kimi.SparseMLA, whose output does not
depend on the order of its indices beyond floating-point summation order), `indices` is not a graph output, and
`scores` (aligned with the indices, so their order too) has no reader and is not a graph output. The function
body the ONNX Runtime backend inlines sorts either way; the cuda backend's kernel skips its rank stage (one launch
and its key workspace per call: plugins/indexer_topk/triton.py, measured in docs/kernels/indexer_topk.md).

Counts: `relaxed` (nodes set to sorted=0), `refused.<reason>` per node left sorted: `ordered_reader` (a reader of
indices that is not a set reader), `scores_read`, `graph_output`.
"""

from __future__ import annotations

import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.passbase import KimiPass, PassStats
from kimi_compile.rewrite import attr, consumers

SET_READERS = frozenset({(DOMAIN, "SparseMLA")})


def _why_ordered(node: ir.Node, outputs: set[int]) -> tuple[str, str] | None:
    """(reason, detail) why the node's order must stay, None when it may go."""
    indices, scores = node.outputs[0], node.outputs[1]
    if id(indices) in outputs or id(scores) in outputs:
        return "graph_output", "indices or scores is a graph output"
    for r in consumers(indices):
        if (r.domain, r.op_type) not in SET_READERS:
            return "ordered_reader", f"indices read by {r.domain + '.' if r.domain else ''}{r.op_type} {r.name!r}"
    if consumers(scores):
        return "scores_read", f"scores read by {consumers(scores)[0].name!r}"
    return None


class RelaxTopkOrderPass(KimiPass):
    name = "relax_topk_order"
    version = 1

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        outputs = {id(v) for v in model.graph.outputs}
        relaxed = 0
        for node in model.graph:
            if node.domain != DOMAIN or node.op_type != "IndexerTopK" or attr(node, "sorted", 1) == 0:
                continue
            why = _why_ordered(node, outputs)
            if why is not None:
                stats.refuse(why[0], node=node.name, detail=why[1])
                continue
            node.attributes["sorted"] = ir.AttrInt64("sorted", 0)
            relaxed += 1
        stats.counts["relaxed"] = relaxed
        return relaxed > 0


PASS = RelaxTopkOrderPass
