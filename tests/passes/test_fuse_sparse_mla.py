import pytest

from kimi_compile.passes.fuse_indexer import FuseIndexerPass
from kimi_compile.passes.fuse_sparse_mla import FuseSparseMLAPass
from kimi_compile.pipeline import verify_model
from tests.passes.conftest import histogram, max_rel

PHASES = ["prefill", "decode"]


@pytest.mark.parametrize("phase", PHASES)
def test_positive_and_numerics(k31, phase):
    m = k31.fresh(phase)
    FuseIndexerPass()(m)
    before = k31.run(m, phase)
    h0 = histogram(m)
    r = FuseSparseMLAPass()(m)
    verify_model(m, "test")
    h = histogram(m)
    n = len(k31.cfg.indexed_layer_ids)
    assert r.counts["matches"] == n == h["kimi.SparseMLA"]
    assert h["kimi.PagedGather"] == 0  # both the latent and index-K pools are read inside the fused ops
    assert h["Softmax"] == h0["Softmax"] - n
    assert max_rel(k31.run(m, phase), before) < 1e-5
    assert k31.err(m, phase) < 1e-5


def test_refuses_without_the_indexer_fusion(k31):
    m = k31.fresh("decode")
    r = FuseSparseMLAPass()(m)
    assert r.counts["matches"] == 0 and r.counts.get("refused.not_indexed", 0) == len(k31.cfg.indexed_layer_ids)


def test_refuses_non_constant_weights(k31):
    import onnx_ir as ir

    m = k31.fresh("decode")
    FuseIndexerPass()(m)
    ein = next(n for n in m.graph if n.op_type == "Einsum" and n.attributes["equation"].value == "bthd,hdr->bthr")
    ident = ir.node("Identity", [ein.inputs[1]])
    m.graph.insert_before(ein, ident)
    ein.replace_input_with(1, ident.outputs[0])
    r = FuseSparseMLAPass()(m)
    assert r.counts.get("refused.weights_not_constant") == 1 and r.counts["matches"] == 1


def test_refuses_a_softmax_without_scale(k31):
    m = k31.fresh("prefill")
    FuseIndexerPass()(m)
    sm = next(n for n in m.graph if n.op_type == "Softmax" and n.attributes.get("axis").value == -1)
    where = sm.inputs[0].producer()
    mul = where.inputs[2].producer()
    mul.op_type = "Add"
    r = FuseSparseMLAPass()(m)
    assert r.counts.get("refused.no_scale") == 1
