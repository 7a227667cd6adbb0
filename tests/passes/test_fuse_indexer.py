import numpy as np
import onnx_ir as ir
import pytest

from kimi_compile.passes.fuse_indexer import FuseIndexerPass
from kimi_compile.pipeline import verify_model
from tests.passes.conftest import histogram, max_rel

PHASES = ["prefill", "decode"]


def _indexer_topk(m):
    return [n for n in m.graph if n.op_type == "TopK" and n.inputs[0].producer().op_type == "Concat"]


@pytest.mark.parametrize("phase", PHASES)
def test_positive_one_node_per_indexed_layer(k31, phase):
    m = k31.fresh(phase)
    before = histogram(m)
    r = FuseIndexerPass()(m)
    verify_model(m, "test")
    after = histogram(m)
    n_idx = len(k31.cfg.indexed_layer_ids)
    assert r.counts["matches"] == n_idx == after["kimi.IndexerTopK"]
    assert after["TopK"] == before["TopK"] - n_idx  # only the MoE router TopKs remain
    assert after["Relu"] == before["Relu"] - n_idx and after["kimi.PagedGather"] == before["kimi.PagedGather"] - n_idx
    assert after["ReduceSum"] == before["ReduceSum"] - n_idx
    assert not _indexer_topk(m)
    assert all(n.metadata_props.get("kimi.rule") == "fuse_indexer" for n in m.graph if n.op_type == "IndexerTopK")
    assert r.counts["refused.no_padded_score_row"] == before["TopK"] - n_idx  # the router TopKs, with a reason


@pytest.mark.parametrize("phase", PHASES)
def test_numerics_before_and_after(k31, phase):
    m = k31.fresh(phase)
    before = k31.run(m, phase)
    FuseIndexerPass()(m)
    after = k31.run(m, phase)
    assert max_rel(after, before) < 1e-6
    assert k31.err(m, phase) < 1e-5


def test_idempotent(k31):
    m = k31.fresh("decode")
    FuseIndexerPass()(m)
    r = FuseIndexerPass()(m)
    assert r.counts["matches"] == 0


def _first(m, op, pred=lambda n: True):
    return next(n for n in m.graph if n.op_type == op and pred(n))


def _const_value(m, node, array):
    c = ir.node("Constant", [], attributes={"value": ir.tensor(np.asarray(array))})
    m.graph.insert_before(node, c)
    return c.outputs[0]


def _break_relu(m):
    relu = _first(m, "Relu")
    relu.op_type = "Abs"


def _break_broadcast(m):
    mul = next(n for n in m.graph if n.op_type == "Mul" and any(
        i.producer() is not None and i.producer().op_type == "Relu" for i in n.inputs))
    uns = next(i.producer() for i in mul.inputs if i.producer().op_type == "Unsqueeze")
    uns.replace_input_with(1, _const_value(m, uns, np.array([1], dtype=np.int64)))


def _break_k(m):
    topk = _indexer_topk(m)[0]
    ident = ir.node("Identity", [topk.inputs[1]])
    m.graph.insert_before(topk, ident)
    topk.replace_input_with(1, ident.outputs[0])


def _break_causal(m):
    le = _first(m, "LessOrEqual")
    le.op_type = "Less"


def _break_axis(m):
    red = next(n for n in m.graph if n.op_type == "ReduceSum" and n.inputs[0].producer() is not None
               and n.inputs[0].producer().op_type == "Mul" and any(
                   i.producer() is not None and i.producer().op_type == "Relu" for i in n.inputs[0].producer().inputs))
    red.replace_input_with(1, _const_value(m, red, np.array([1], dtype=np.int64)))


@pytest.mark.parametrize("breaker, reason", [
    (_break_relu, "no_relu"),
    (_break_broadcast, "weight_broadcast"),
    (_break_k, "non_constant_k"),
    (_break_causal, "non_causal_mask"),
    (_break_axis, "reduce_axis"),
])
def test_negative_each_refusal(k31, breaker, reason):
    m = k31.fresh("prefill")
    breaker(m)
    r = FuseIndexerPass()(m)
    assert r.counts.get(f"refused.{reason}", 0) >= 1, r.counts
    assert r.counts["matches"] < len(k31.cfg.indexed_layer_ids)  # layers sharing the broken node stay unfused
