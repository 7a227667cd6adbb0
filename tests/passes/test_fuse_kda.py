import numpy as np
import onnx_ir as ir
import pytest

from kimi_compile import ops
from kimi_compile.passes.fuse_kda import FuseKDAPass
from kimi_compile.pipeline import verify_model
from tests.passes.conftest import histogram, max_rel

PHASES = ["prefill", "decode"]


def _recurrences(m):
    return [n for n in m.graph if n.op_type == "KDARecurrence" and n.domain == "kimi"]


@pytest.mark.parametrize("phase", PHASES)
def test_positive_one_node_per_kda_layer(k31, phase):
    m = k31.fresh(phase)
    before = histogram(m)
    r = FuseKDAPass()(m)
    verify_model(m, "test")
    after = histogram(m)
    layers = k31.cfg.kda_layer_ids
    n = len(layers)
    assert r.counts["matches"] == n == after["kimi.KDA"] == before["kimi.KDARecurrence"]
    assert not any(k.startswith("refused.") for k in r.counts)
    # everything the layers owned is gone: recurrences, convs, conv-state splits, the q/k L2 norms
    assert after["kimi.KDARecurrence"] == after["Conv"] == after["Split"] == 0
    assert before["Pow"] - after["Pow"] == 2 * n and before["Sqrt"] - after["Sqrt"] == 2 * n
    assert before["RMSNormalization"] - after["RMSNormalization"] == n
    assert before["Transpose"] - after["Transpose"] == 6 * n
    kda = [x for x in m.graph if x.op_type == "KDA"]
    chunk = 0 if phase == "decode" else k31.opts.kda_chunk
    for node, layer in zip(kda, layers):
        assert node.metadata_props["kimi.rule"] == "fuse_kda"
        assert [v.name for v in node.inputs[1:4]] == [f"conv.{layer}", f"state.{layer}", "lengths"]
        assert [v.name for v in node.outputs[1:]] == [f"conv.{layer}.out", f"state.{layer}.out"]
        assert all(v.const_value is not None for v in node.inputs[4:])
        a = {k: v.value for k, v in node.attributes.items()}
        assert a["chunk_size"] == chunk and a["lower_bound"] == k31.cfg.gate_lower_bound
        assert a["scale"] == pytest.approx(k31.cfg.kda_head_dim**-0.5) and a["l2_eps"] == pytest.approx(1e-6)
        assert a["eps"] == pytest.approx(k31.cfg.rms_norm_eps)
    assert ("kimi", "KDA", "") in m.functions
    # the function body inlines the recurrence: no kimi.* op inside
    assert not [x for x in m.functions[("kimi", "KDA", "")] if x.domain == "kimi"]


@pytest.mark.parametrize("phase", PHASES)
def test_numerics_before_and_after(k31, phase):
    m = k31.fresh(phase)
    before = k31.run(m, phase)
    FuseKDAPass()(m)
    after = k31.run(m, phase)
    assert max_rel(after, before) < 1e-5
    assert k31.err(m, phase) < 1e-5


def test_idempotent(k31):
    m = k31.fresh("prefill")
    FuseKDAPass()(m)
    r = FuseKDAPass()(m)
    assert r.counts["matches"] == 0


def test_op_body_matches_reference():
    rng = np.random.default_rng(0)
    B, T, hid, H, D, W = 2, 7, 16, 2, 8, 4
    P = H * D

    def r(*s):
        return (rng.standard_normal(s) * 0.3).astype(np.float32)

    feeds = dict(x=r(B, T, hid), conv_state=r(B, W - 1, 3 * P), state=r(B, H, D, D),
                 lengths=np.array([7, 3], np.int64), w_q=r(hid, P), w_k=r(hid, P), w_v=r(hid, P), conv_q=r(P, 1, W),
                 conv_k=r(P, 1, W), conv_v=r(P, 1, W), w_f_a=r(hid, D), w_f_b=r(D, P), w_b=r(hid, H), w_g=r(hid, P),
                 A_log=r(H), dt_bias=r(H, D), o_norm=r(D), w_o=r(P, hid))
    attrs = dict(lower_bound=-5.0, scale=D**-0.5, l2_eps=1e-6, eps=1e-5, chunk_size=4)
    got = _run_single(ops.lookup("KDA"), feeds, attrs)
    want = ops.lookup("KDA").reference(**feeds, **attrs)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5


def _run_single(op, feeds, attrs):
    import onnxruntime as ort
    from onnx import helper

    node = helper.make_node(op.name, list(op.inputs), list(op.outputs), domain="kimi", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                                      v.shape) for k, v in feeds.items()],
                          [helper.make_empty_tensor_value_info(o) for o in op.outputs])
    model = helper.make_model(g, functions=[op.function()], opset_imports=[
        helper.make_opsetid("", ops.ONNX_OPSET), helper.make_opsetid("kimi", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


# ---- negative: one mutation per refusal reason, each on the first KDA layer's edges ------------------------------

def _identity_after(m, v: ir.Value) -> None:
    """Route every use of v through an Identity: the pattern no longer sees v's producer."""
    ident = ir.node("Identity", [v])
    p = v.producer()
    if p is None:
        m.graph.insert_before(next(iter(m.graph)), ident)
    else:
        m.graph.insert_after(p, ident)
    for use in list(v.uses()):
        if use.node is not ident:
            use.node.replace_input_with(use.idx, ident.outputs[0])


def _rec(m):
    return _recurrences(m)[0]


def _gate_sigmoid(m):  # g = Mul(Mul(Sigmoid(.), lb), valid)
    return _rec(m).inputs[3].producer().inputs[0].producer().inputs[0]


def _output_gate_mul(m):
    norm = next(iter(_rec(m).outputs[0].uses())).node
    return next(iter(norm.outputs[0].uses())).node


def _output_gate(m):
    gm = _output_gate_mul(m)
    return next(v for v in gm.inputs if v.producer().op_type == "Sigmoid")


def _q_projection(m):  # the MatMul feeding the first [conv_state ‖ u] Concat
    cat = next(n for n in m.graph if n.op_type == "Concat" and n.inputs[0].producer() is not None
               and n.inputs[0].producer().op_type == "Split")
    return cat.inputs[1]


def _window_index(m):
    return next(n for n in m.graph if n.op_type == "GatherElements" and n.inputs[1].producer().op_type == "Expand"
                ).inputs[1]


MUTATIONS = {
    "no_l2norm": lambda m: _identity_after(m, _rec(m).inputs[1]),
    "no_conv": lambda m: _identity_after(m, _rec(m).inputs[2]),
    "no_projection": lambda m: _identity_after(m, _q_projection(m)),
    "conv_window": lambda m: _identity_after(m, _window_index(m)),
    "no_valid_mask": lambda m: _identity_after(m, _rec(m).inputs[3]),
    "gate_form": lambda m: _identity_after(m, _gate_sigmoid(m)),
    "beta_form": lambda m: _identity_after(m, _rec(m).inputs[4].producer().inputs[0]),
    "no_output_norm": lambda m: _identity_after(m, _rec(m).outputs[0]),
    "no_output_gate": lambda m: _identity_after(m, _output_gate(m)),
    "no_output_proj": lambda m: _identity_after(m, _output_gate_mul(m).outputs[0]),
}


@pytest.mark.parametrize("reason", sorted(MUTATIONS))
def test_refuses(k31, reason):
    m = k31.fresh("prefill")
    n = len(_recurrences(m))
    MUTATIONS[reason](m)
    r = FuseKDAPass()(m)
    refused = {k: v for k, v in r.counts.items() if k.startswith("refused.")}
    assert set(refused) == {f"refused.{reason}"}, r.near_misses
    assert refused[f"refused.{reason}"] >= 1 and r.counts["matches"] + refused[f"refused.{reason}"] == n
    verify_model(m, "test")
    assert k31.err(m, "prefill") < 1e-5  # the refused layer still runs its plain form


def test_every_refusal_reason_is_tested():
    import kimi_compile.passes.fuse_kda as mod

    listed = mod.__doc__.split("Refusals (counted as `refused.<reason>`):")[1].replace("\n", " ")
    assert {r.strip(" .") for r in listed.split(",")} == set(MUTATIONS)
