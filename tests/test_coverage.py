"""Op coverage: the fused-op set comes from the registry (OpDef.kind), and the trace's primitives (kimi.PagedWrite,
kimi.PagedGather, kimi.KDARecurrence) and the quantize ops are neither fused nor fallback."""

from __future__ import annotations

import types

import onnx_ir as ir

from kimi_compile import ops
from kimi_compile.coverage import coverage, fused_ops

CFG = types.SimpleNamespace(is_kda=lambda i: False, has_indexer=lambda i: True)
NS = "model.model.layers.0.self_attn.indexer: Indexer"


def _graph(op_types: list[tuple[str, str]]) -> ir.Model:
    x = ir.Value(name="x")
    nodes, v = [], x
    for domain, op in op_types:
        node = ir.node(op, [v], domain=domain, metadata_props={"namespace": NS})
        nodes.append(node)
        v = node.outputs[0]
    g = ir.Graph([x], [v], nodes=nodes, opset_imports={"": ops.ONNX_OPSET, ops.DOMAIN: 1})
    return ir.Model(g, ir_version=10)


def test_fused_ops_come_from_the_registry_kinds():
    assert fused_ops() == {"IndexerTopK", "SparseMLA", "KDA", "MoE", "MoEExperts", "AttnResStage1", "AttnResMerge",
                          "MatMulNZ"}
    kinds = {o.name: o.kind for o in ops.registered()}
    assert {n for n, k in kinds.items() if k == "primitive"} == {"PagedWrite", "PagedGather", "KDARecurrence",
                                                                 "AllReduce", "AllGather", "ReduceScatter", "AllToAll"}
    assert {n for n, k in kinds.items() if k == "partition"} == {"KDAConvTail", "KDASegmentMap", "KDASegmentReplay"}
    assert {n for n, k in kinds.items() if k == "quant"} == {"QuantizeMX", "DequantizeMX", "QDQMX", "QuantizeFP8Tile",
                                                             "DequantizeFP8Tile", "QDQFP8Tile"}


def test_primitives_and_quant_ops_are_not_fallbacks():
    traced = _graph([("", "MatMul"), ("kimi", "PagedWrite"), ("", "Relu"), ("", "ReduceSum"), ("", "TopK"),
                     ("kimi", "PagedGather")])
    final = _graph([("", "MatMul"), ("kimi", "PagedWrite"), ("kimi", "QDQMX"), ("kimi", "IndexerTopK"),
                    ("kimi", "PagedGather")])
    cov = coverage(traced, final, CFG)
    (row,) = cov["by_component"]
    assert (row["layer_kind"], row["component"]) == ("mla+indexer", "indexer")
    assert row["fused_ops"] == {"kimi.IndexerTopK": 1}
    assert row["fallback_ops"] == {"MatMul": 1}  # no kimi.PagedWrite / PagedGather / QDQMX
    assert row["traced_nodes"] == 4 and row["coverage_pct"] == 75.0 and cov["total_pct"] == 75.0
