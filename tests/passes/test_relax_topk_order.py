import onnx_ir as ir
import pytest

from kimi_compile.passes.fuse_indexer import FuseIndexerPass
from kimi_compile.passes.fuse_sparse_mla import FuseSparseMLAPass
from kimi_compile.passes.relax_topk_order import RelaxTopkOrderPass
from kimi_compile.pipeline import verify_model
from kimi_compile.rewrite import attr


def _indexers(m):
    return [n for n in m.graph if n.domain == "kimi" and n.op_type == "IndexerTopK"]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_relaxes_the_indexers_that_feed_sparse_mla_only(k31, phase):
    m = k31.fresh(phase)
    FuseIndexerPass()(m)
    FuseSparseMLAPass()(m)
    before = k31.run(m, phase)
    r = RelaxTopkOrderPass()(m)
    verify_model(m, "test")
    n = len(k31.cfg.indexed_layer_ids)
    assert r.counts["relaxed"] == n == len(_indexers(m)) and r.modified
    assert all(attr(x, "sorted") == 0 for x in _indexers(m))
    after = k31.run(m, phase)  # the function body sorts either way: ONNX Runtime's outputs are unchanged
    assert all((after[k] == before[k]).all() for k in before)
    again = RelaxTopkOrderPass()(m)  # idempotent
    assert again.counts["relaxed"] == 0 and not again.modified


def test_keeps_the_order_for_other_readers(k31):
    m = k31.fresh("decode")
    FuseIndexerPass()(m)  # no SparseMLA fusion: the indices feed the unfused attention's gathers
    r = RelaxTopkOrderPass()(m)
    n = len(k31.cfg.indexed_layer_ids)
    assert r.counts["relaxed"] == 0 and r.counts["refused.ordered_reader"] == n
    assert all(attr(x, "sorted", 1) == 1 for x in _indexers(m))


def test_keeps_the_order_when_scores_are_read_or_returned(k31):
    m = k31.fresh("decode")
    FuseIndexerPass()(m)
    FuseSparseMLAPass()(m)
    first, second = _indexers(m)[:2]
    ident = ir.node("Identity", [first.outputs[1]], name="reads_scores")
    m.graph.append(ident)
    m.graph.outputs.append(ident.outputs[0])
    m.graph.outputs.append(second.outputs[0])
    r = RelaxTopkOrderPass()(m)
    assert r.counts["refused.scores_read"] == 1 and r.counts["refused.graph_output"] == 1
    assert attr(first, "sorted", 1) == 1 and attr(second, "sorted", 1) == 1
    assert {x["reason"] for x in r.near_misses} == {"scores_read", "graph_output"}
