"""Fusions on the quantized k31 graph (quantize first, with the quant recipe's rules): every fusion matches as on the
float graph, the fused ops read the quantized pools (no dequantized cache left outside them), numerics equal the
unfused quantized graph."""

from pathlib import Path

import pytest
import yaml

from kimi_compile.accuracy import rebase_feeds
from kimi_compile.verify import ort_run
from kimi_compile.passes.fuse_attn_res import FuseAttnResPass
from kimi_compile.passes.fuse_indexer import FuseIndexerPass
from kimi_compile.passes.fuse_kda import FuseKDAPass
from kimi_compile.passes.fuse_moe import FuseMoEPass
from kimi_compile.passes.fuse_sparse_mla import FuseSparseMLAPass
from kimi_compile.passes.quantize import QuantizePass
from kimi_compile.pipeline import verify_model
from tests.passes.conftest import histogram, max_rel

RECIPE = yaml.safe_load((Path(__file__).parents[2] / "recipes" / "kimi-k3.1-tiny-quant.yaml").read_text())
FUSIONS = [FuseIndexerPass, FuseSparseMLAPass, FuseKDAPass, FuseMoEPass, FuseAttnResPass]


def _quantized(k31, phase):
    m = k31.fresh(phase)
    QuantizePass(QuantizePass.Options(rules=tuple(RECIPE["precision"]), latent_rope="fp8"))(m)
    return m, rebase_feeds(m, k31.feeds[phase], None)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_quantized_graph_fuses_and_matches_unfused(k31, phase):
    m, feeds = _quantized(k31, phase)
    ref = ort_run(m, feeds)
    for P in FUSIONS:
        r = P()(m)
        verify_model(m, P.name)
        assert r.counts["matches"] > 0, (P.name, r.counts)
        assert max_rel(ort_run(m, feeds), ref) < 1e-5, P.name  # vs the unfused quantized graph
    h = histogram(m)
    cfg = k31.cfg
    n_idx = len(cfg.indexed_layer_ids)
    assert h["kimi.IndexerTopK"] == h["kimi.SparseMLA"] == n_idx
    assert h["kimi.KDA"] == 4 and h["kimi.MoE"] == 5 and h["kimi.AttnResMerge"] == 12
    # the fused ops read the code/scale pools; no dequantized cache or paged gather is left outside them
    assert h["kimi.DequantizeMX"] == h["kimi.DequantizeFP8Tile"] == h["kimi.PagedGather"] == 0
    idx = next(n for n in m.graph if n.op_type == "IndexerTopK")
    assert idx.overload == "mxfp8_e4m3" and idx.inputs[2].dtype.name == "UINT8" and idx.inputs[6].name.endswith(
        ".scale.out")
    sm = next(n for n in m.graph if n.op_type == "SparseMLA")
    assert sm.attributes["kv_format"].value == "mxfp8" and sm.attributes["rope_format"].value == "mxfp8"
    assert [v.dtype.name for v in sm.inputs[7:]] == ["UINT8"] * 3
    # bf16-stored projection weights stay bf16 behind the fused ops
    kda = next(n for n in m.graph if n.op_type == "KDA")
    w_q = kda.inputs[4].producer()
    assert w_q.op_type == "Cast" and w_q.inputs[0].dtype.name == "BFLOAT16"


def test_sparse_mla_absorbed_weights_stay_bf16_and_shared(k31):
    """W_UK / W_UV behind kimi.SparseMLA keep the stored bf16 dtype in decode as in prefill, under the same
    initializer names (one copy for both phases), and still match the unfused quantized graph."""
    names = {}
    for phase in ("prefill", "decode"):
        m, feeds = _quantized(k31, phase)
        ref = ort_run(m, feeds)
        for P in FUSIONS:
            P()(m)
        assert max_rel(ort_run(m, feeds), ref) < 1e-5, phase
        sm = next(n for n in m.graph if n.op_type == "SparseMLA")
        names[phase] = []
        for v in sm.inputs[5:7]:
            cast = v.producer()
            assert cast is not None and cast.op_type == "Cast" and cast.inputs[0].dtype.name == "BFLOAT16", (phase, v)
            names[phase].append(cast.inputs[0].name)
    assert names["prefill"] == names["decode"], names
