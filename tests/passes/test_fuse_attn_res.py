import pytest

from kimi_compile.passes.fuse_attn_res import FuseAttnResPass
from kimi_compile.pipeline import verify_model
from tests.passes.conftest import histogram, max_rel

PHASES = ["prefill", "decode"]


def _mix_points(cfg):
    # two mixes per layer (the first layer's attention side has no bank), plus the final mix
    return 2 * cfg.num_hidden_layers - 1 + 1


def _banks(cfg):
    return -(-cfg.num_hidden_layers // cfg.attn_res_block_size)


@pytest.mark.parametrize("phase", PHASES)
def test_positive_two_stages(k31, phase):
    m = k31.fresh(phase)
    before = k31.run(m, phase)
    h0 = histogram(m)
    r = FuseAttnResPass()(m)
    verify_model(m, "test")
    h = histogram(m)
    assert r.counts["matches"] == h["kimi.AttnResMerge"] == _mix_points(k31.cfg)
    assert h["kimi.AttnResStage1"] == _banks(k31.cfg)  # stage 1 once per bank state
    assert h0["RMSNormalization"] - h["RMSNormalization"] == _mix_points(k31.cfg)  # the norm after each mix is fused
    assert not [n for n in m.graph if n.op_type == "Softmax" and n.attributes["axis"].value == 0]
    assert max_rel(k31.run(m, phase), before) < 1e-5
    assert k31.err(m, phase) < 1e-5


def test_refuses_when_the_mix_is_not_followed_by_one_norm(k31):
    import onnx_ir as ir

    m = k31.fresh("decode")
    sm = next(n for n in m.graph if n.op_type == "Softmax" and n.attributes["axis"].value == 0)
    red = list(list(list(sm.outputs[0].uses())[0].node.outputs[0].uses())[0].node.outputs[0].uses())[0].node
    extra = ir.node("Neg", [red.outputs[0]])
    m.graph.append(extra)
    m.graph.outputs.append(extra.outputs[0])
    r = FuseAttnResPass()(m)
    assert r.counts.get("refused.no_following_norm") == 1 and r.counts["matches"] == _mix_points(k31.cfg) - 1


def test_refuses_non_constant_query(k31):
    import onnx_ir as ir

    m = k31.fresh("prefill")
    sm = next(n for n in m.graph if n.op_type == "Softmax" and n.attributes["axis"].value == 0)
    mul = sm.inputs[0].producer()
    mm = next(i.producer() for i in mul.inputs if i.producer().op_type == "MatMul")
    ident = ir.node("Identity", [mm.inputs[1]])
    m.graph.insert_before(mm, ident)
    mm.replace_input_with(1, ident.outputs[0])
    r = FuseAttnResPass()(m)
    assert r.counts.get("refused.query_not_constant") == 1
