import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common  # noqa: F401
import pytest

from kimi_compile import ops
from kimi_compile.passes.fuse_moe import FuseMoEPass
from kimi_compile.pipeline import verify_model
from tests.passes.conftest import histogram, max_rel
from tests.passes.test_fuse_kda import _identity_after, _run_single

PHASES = ["prefill", "decode"]


def _moe_layers(cfg):
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]


def _router_topk(m):
    return [n for n in m.graph if n.op_type == "TopK" and n.inputs[0].producer().op_type == "Add"]


@pytest.mark.parametrize("phase", PHASES)
def test_positive_one_node_per_moe_layer(k31, phase):
    m = k31.fresh(phase)
    before = histogram(m)
    r = FuseMoEPass()(m)
    verify_model(m, "test")
    after = histogram(m)
    cfg = k31.cfg
    n, n_idx = len(_moe_layers(cfg)), len(cfg.indexed_layer_ids)
    assert r.counts["matches"] == n == after["kimi.MoE"]
    # the indexer's TopKs are near misses with a reason; they are all that is left of TopK
    assert {k: v for k, v in r.counts.items() if k.startswith("refused.")} == {"refused.router_not_sigmoid": n_idx}
    assert after["TopK"] == before["TopK"] - n == n_idx and not _router_topk(m)
    assert after["GatherND"] == 0 and before["GatherND"] == 3 * n
    assert before["Einsum"] - after["Einsum"] == 3 * n and before["Gemm"] - after["Gemm"] == 5 * n
    assert before["Tanh"] - after["Tanh"] == 4 * n and before["RMSNormalization"] - after["RMSNormalization"] == n
    for node in (x for x in m.graph if x.op_type == "MoE"):
        assert node.metadata_props["kimi.rule"] == "fuse_moe"
        assert node.inputs[2].name.endswith("e_score_correction_bias")
        assert all(v.const_value is not None for v in node.inputs[1:])
        assert [u.node.op_type for u in node.outputs[0].uses()] == ["Reshape"]
        a = {k: v.value for k, v in node.attributes.items()}
        assert a == pytest.approx(dict(top_k=cfg.num_experts_per_token, renormalize=1,
                                       scaling=cfg.routed_scaling_factor, situ_beta=cfg.activation_situ_beta,
                                       situ_linear_beta=cfg.activation_situ_linear_beta, eps=cfg.rms_norm_eps))
    assert ("kimi", "MoE", "") in m.functions


@pytest.mark.parametrize("phase", PHASES)
def test_numerics_before_and_after(k31, phase):
    m = k31.fresh(phase)
    before = k31.run(m, phase)
    FuseMoEPass()(m)
    after = k31.run(m, phase)
    assert max_rel(after, before) < 1e-5
    assert k31.err(m, phase) < 1e-5


def test_variant_without_renormalisation_with_scaling(k31):
    """No Div (renormalize=0) and a routed scaling factor: the variant is an attribute, numerics unchanged."""
    m = k31.fresh("prefill")
    for topk in _router_topk(m):
        ge = next(u.node for u in topk.outputs[1].uses() if u.node.op_type == "GatherElements")
        div = next(u.node for u in ge.outputs[0].uses() if u.node.op_type == "Div")
        c = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(2.5, np.float32))})
        mul = ir.node("Mul", [ge.outputs[0], c.outputs[0]])
        m.graph.insert_after(div, [c, mul])
        ir.convenience.replace_all_uses_with(div.outputs[0], mul.outputs[0])
    ir.passes.common.RemoveUnusedNodesPass()(m)
    before = k31.run(m, "prefill")
    r = FuseMoEPass()(m)
    assert r.counts["matches"] == len(_moe_layers(k31.cfg))
    for node in (x for x in m.graph if x.op_type == "MoE"):
        assert node.attributes["renormalize"].value == 0 and node.attributes["scaling"].value == 2.5
    assert max_rel(k31.run(m, "prefill"), before) < 1e-5


def test_idempotent(k31):
    m = k31.fresh("decode")
    FuseMoEPass()(m)
    r = FuseMoEPass()(m)
    assert r.counts["matches"] == 0


def _moe_feeds(rng, N: int, hid: int = 16, E: int = 8, L: int = 12, I: int = 10, Is: int = 14) -> dict:
    """Random kimi.MoE inputs (fp32): N tokens, E experts of latent L and width I, a shared expert of width Is."""
    def r(*s):
        return (rng.standard_normal(s) * 0.3).astype(np.float32)

    return dict(x=r(1, N, hid) * 3, router_w=r(E, hid), router_bias=r(E), w_down=r(L, hid), w1=r(E, I, L),
                w3=r(E, I, L), w2=r(E, L, I), norm_w=r(L), w_up=r(hid, L), shared_gate=r(Is, hid),
                shared_up=r(Is, hid), shared_down=r(hid, Is))


@pytest.mark.parametrize("lbeta, renorm, k", [(25.0, 1, 2), (0.0, 0, 3)])
def test_op_body_matches_reference(lbeta, renorm, k):
    feeds = _moe_feeds(np.random.default_rng(0), N=11)
    attrs = dict(top_k=k, renormalize=renorm, scaling=1.5, situ_beta=4.0, situ_linear_beta=lbeta, eps=1e-5)
    (got,) = _run_single(ops.lookup("MoE"), feeds, attrs)
    want = ops.lookup("MoE").reference(**feeds, **attrs)
    assert got.shape == want.shape == (1, 11, 16)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_experts_op_split_over_expert_groups_sums_to_the_latent(groups):
    """kimi.MoEExperts (expert parallel): its ONNX body, its numpy reference and the cuda backend's torch kernel (on
    CPU tensors) agree on each group of experts, and the groups' latent sums add up to the one of all experts (the
    latent kimi.MoE normalizes): RMSNorm(sum) and the up-projection then give kimi.MoE's routed output."""
    import torch

    from plugins.moe import cuda as moe_cuda

    rng = np.random.default_rng(1)
    N, hid, E, L, I = 9, 16, 8, 12, 10

    def r(*s):
        return (rng.standard_normal(s) * 0.3).astype(np.float32)

    full = dict(x=r(1, N, hid) * 3, router_w=r(E, hid), router_bias=r(E), w_down=r(L, hid), w1=r(E, I, L),
                w3=r(E, I, L), w2=r(E, L, I))
    attrs = dict(top_k=3, renormalize=1, scaling=1.5, situ_beta=4.0, situ_linear_beta=25.0)
    op = ops.lookup("MoEExperts")
    el = E // groups
    total = np.zeros((1, N, L))
    for g in range(groups):
        feeds = {**full, **{k: full[k][g * el:(g + 1) * el] for k in ("w1", "w3", "w2")}}
        a = {**attrs, "expert_offset": g * el}
        (got,) = _run_single(op, feeds, a)
        want = op.reference(**feeds, **a)
        (kern,) = moe_cuda.moe_experts([torch.from_numpy(feeds[k]) for k in op.inputs], a)
        assert got.shape == want.shape == tuple(kern.shape) == (1, N, L)
        assert _rel(got, want) < 1e-5 and _rel(kern.numpy(), want) < 1e-5
        total += want
    whole = op.reference(**full, **attrs, expert_offset=0)
    assert _rel(total, whole) < 1e-6
    norm_w, w_up = r(L), r(hid, L)
    zeros = dict(shared_gate=np.zeros((4, hid), np.float32), shared_up=np.zeros((4, hid), np.float32),
                 shared_down=np.zeros((hid, 4), np.float32))
    moe = ops.lookup("MoE").reference(**full, norm_w=norm_w, w_up=w_up, **zeros, **attrs, eps=1e-5)
    rn = total / np.sqrt((total * total).mean(-1, keepdims=True) + 1e-5) * norm_w
    assert _rel(rn @ w_up.T, moe) < 1e-5


def _rel(a, b) -> float:  # a group that no token selected holds zeros: absolute error there
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (np.linalg.norm(b) or 1.0))


# ---- negative: one mutation per refusal reason, each on the first MoE layer ------------------------------------

def _identity_on(m, node: ir.Node, idx: int) -> None:
    """Route one input edge of `node` through an Identity."""
    ident = ir.node("Identity", [node.inputs[idx]])
    m.graph.insert_before(node, ident)
    node.replace_input_with(idx, ident.outputs[0])


def _topk(m):
    return _router_topk(m)[0]


def _gather(m):
    return next(u.node for u in _topk(m).outputs[1].uses() if u.node.op_type == "GatherElements")


def _div(m):
    return next(u.node for u in _gather(m).outputs[0].uses() if u.node.op_type == "Div")


def _bias_add(m):
    return _topk(m).inputs[0].producer()


def _sigmoid(m):
    return next(v.producer() for v in _bias_add(m).inputs if v.producer() is not None)


def _sum(m):  # ReduceSum over k of the weighted expert outputs
    unsq = next(iter(_div(m).outputs[0].uses())).node
    mul = next(iter(unsq.outputs[0].uses())).node
    return next(iter(mul.outputs[0].uses())).node


def _down_einsum(m):  # Einsum["nki,nkdi->nkd"] of the first MoE layer
    mul = _sum(m).inputs[0].producer()
    return next(v.producer() for v in mul.inputs if v.producer().op_type == "Einsum")


def _latent(m):  # z, read by the gate/up Einsums["nd,nkid->nki"] of the first MoE layer
    return next(n for n in m.graph if n.op_type == "Einsum" and n.attributes["equation"].value == "nd,nkid->nki"
                ).inputs[0]


def _norm(m):
    return next(iter(_sum(m).outputs[0].uses())).node


def _up(m):
    return next(iter(_norm(m).outputs[0].uses())).node


MUTATIONS = {
    "non_constant_k": lambda m: _identity_on(m, _topk(m), 1),
    "router_not_sigmoid": lambda m: _identity_on(m, _topk(m), 0),
    "bias_not_constant": lambda m: _identity_on(m, _bias_add(m), [v.producer() is None for v in
                                                                  _bias_add(m).inputs].index(True)),
    "router_not_linear": lambda m: _identity_after(m, _sigmoid(m).inputs[0]),
    "weights_not_scores": lambda m: _identity_on(m, _gather(m), 0),
    "renormalize_form": lambda m: _identity_on(m, _div(m), 1),
    "no_weighted_sum": lambda m: _identity_after(m, _div(m).outputs[0]),
    "experts_form": lambda m: _identity_on(m, _down_einsum(m), 1),
    "activation": lambda m: _identity_on(m, _down_einsum(m), 0),
    "no_latent_down": lambda m: _identity_after(m, _latent(m)),
    "no_latent_norm": lambda m: _identity_after(m, _sum(m).outputs[0]),
    "no_latent_up": lambda m: _identity_after(m, _norm(m).outputs[0]),
    "no_shared_experts": lambda m: _identity_after(m, _up(m).outputs[0]),
}


@pytest.mark.parametrize("reason", sorted(MUTATIONS))
def test_refuses(k31, reason):
    m = k31.fresh("prefill")
    n = len(_router_topk(m))
    MUTATIONS[reason](m)
    r = FuseMoEPass()(m)
    refused = {k: v for k, v in r.counts.items() if k.startswith("refused.")}
    n_idx = len(k31.cfg.indexed_layer_ids)  # the indexer's TopKs are refused as router_not_sigmoid anyway
    expected = {"refused.router_not_sigmoid": n_idx}
    expected[f"refused.{reason}"] = expected.get(f"refused.{reason}", 0) + 1
    assert refused == expected, r.near_misses
    assert r.counts["matches"] == n - 1
    verify_model(m, "test")
    assert k31.err(m, "prefill") < 1e-5  # the refused layer still runs its plain form


def test_every_refusal_reason_is_tested():
    import kimi_compile.passes.fuse_moe as mod

    listed = mod.__doc__.split("Refusals (counted as `refused.<reason>`):")[1].replace("\n", " ")
    assert {r.strip(" .") for r in listed.split(",")} == set(MUTATIONS)


def test_cuda_kernel_matches_reference_and_is_deterministic(monkeypatch):
    """The cuda backend's kimi.MoE kernel (on CPU tensors: the same sorted layout through the batched product)
    equals the numpy reference, and the k expert rows of each token are summed in a fixed order (no atomics): two
    runs give the same bits."""
    import torch

    from plugins.moe import cuda as moe_cuda

    feeds = _moe_feeds(np.random.default_rng(2), N=13)
    attrs = dict(top_k=3, renormalize=1, scaling=1.5, situ_beta=4.0, situ_linear_beta=25.0, eps=1e-5)
    want = ops.lookup("MoE").reference(**feeds, **attrs)
    args = [torch.from_numpy(v) for v in feeds.values()]
    (a,) = moe_cuda.moe(args, attrs)
    (b,) = moe_cuda.moe(args, attrs)
    assert torch.equal(a, b)
    assert np.linalg.norm(a.numpy() - want) / np.linalg.norm(want) < 1e-5
    # rows gathered in slices (bounded memory for long prefill chunks): the same bits, with a ragged last slice
    w1 = args[4]
    with monkeypatch.context() as m:
        m.setattr(moe_cuda, "_GATHER_BYTES", 4 * w1[0].numel() * w1.element_size())
        (c,) = moe_cuda.moe(args, attrs)
    assert torch.equal(a, c)
