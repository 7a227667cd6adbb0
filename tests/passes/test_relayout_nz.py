"""relayout_nz: positive (exact op list, NZ initializers), one negative per refusal reason, numerical (ONNX Runtime
before vs after), and end to end: the NZ build of kimi-k3.1-tiny gives the same logits as the plain one."""

import os

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from kimi_compile.functions import attach_functions
from kimi_compile.passes.relayout_nz import RelayoutNZPass
from kimi_compile.pipeline import verify_model
from kimi_compile.plugins.matmul_nz import nd_to_nz
from tests.passes._graphs import ops, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
rng = np.random.default_rng(0)
W1 = rng.standard_normal((64, 40)).astype(np.float32)  # MatMul weight [K, N]
W2 = rng.standard_normal((24, 64)).astype(np.float32)  # Gemm B with transB=1: W = B^T [64, 24]
BIAS = rng.standard_normal(24).astype(np.float32)
W3 = rng.standard_normal((64, 50)).astype(ml_dtypes.bfloat16)  # a bf16-stored weight behind a Cast (quantize)


def projections(*, gemm_attrs=None, w1=W1, w1_input=False, small=False) -> ir.Model:
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [3, 64])]
    inits = [onnx.numpy_helper.from_array(W2, "W2"), onnx.numpy_helper.from_array(BIAS, "bias"),
             onnx.numpy_helper.from_array(np.asarray(W3), "W3")]
    if w1_input:
        inputs.append(h.make_tensor_value_info("W1", T.FLOAT, list(w1.shape)))
    else:
        inits.append(onnx.numpy_helper.from_array(w1, "W1"))
    nodes = [h.make_node("MatMul", ["x", "W1"], ["y1"]),
             h.make_node("Gemm", ["x", "W2", "bias"], ["y2"], **(gemm_attrs or {"transB": 1})),
             h.make_node("Cast", ["W3"], ["W3f"], to=T.FLOAT),
             h.make_node("MatMul", ["x", "W3f"], ["y3"])]
    n1 = w1.shape[-1]
    outputs = [h.make_tensor_value_info("y1", T.FLOAT, [3, n1] if w1.ndim == 2 else None),
               h.make_tensor_value_info("y2", T.FLOAT, [3, 24]), h.make_tensor_value_info("y3", T.FLOAT, [3, 50])]
    if w1.ndim != 2:
        outputs[0] = h.make_tensor_value_info("y1", T.FLOAT, [2, 3, n1])
    g = h.make_graph(nodes, "proj", inputs, outputs, inits)
    m = ir.serde.deserialize_model(h.make_model(g, opset_imports=[h.make_opsetid("", 23)]))
    attach_functions(m)
    return m


def _relayout(m, **options):
    r = RelayoutNZPass(RelayoutNZPass.Options(**{"min_elements": 1024, **options}))(m)
    verify_model(m, "after relayout_nz")
    return r


def test_positive_exact_ops_and_nz_initializers():
    m = projections()
    r = _relayout(m)
    assert [n.op_type for n in m.graph] == ["MatMulNZ", "MatMulNZ", "Add", "Cast", "MatMulNZ"]
    assert r.counts == {"matches": 3, "weights_relaid": 3, "padding_bytes": 2 * 8 * 64 * 4 + 14 * 64 * 2}
    inits = {k: (v.dtype.name, tuple(v.shape)) for k, v in m.graph.initializers.items()}
    assert inits == {"W1.nz": ("FLOAT", (3, 64, 16)), "W2.nz.t": ("FLOAT", (2, 64, 16)), "bias": ("FLOAT", (24,)),
                     "W3.nz": ("BFLOAT16", (4, 64, 16))}
    np.testing.assert_array_equal(m.graph.initializers["W1.nz"].const_value.numpy(), nd_to_nz(W1))
    np.testing.assert_array_equal(m.graph.initializers["W2.nz.t"].const_value.numpy(), nd_to_nz(W2.T.copy()))
    assert m.graph.initializers["W1.nz"].metadata_props["kimi.layout"] == "nz16x16"
    assert [v.name for v in m.graph.outputs] == ["y1", "y2", "y3"]
    # idempotent: a second run finds nothing left to relayout
    assert _relayout(m).counts["matches"] == 0


def test_block_option():
    m = projections()
    _relayout(m, block=(16, 32))
    assert tuple(m.graph.initializers["W1.nz"].shape) == (2, 64, 32)


@pytest.mark.parametrize("reason, kw, opts", [
    ("weight_not_initializer", {"w1_input": True}, {}),
    ("not_2d", {"w1": rng.standard_normal((2, 64, 40)).astype(np.float32)}, {}),
    ("too_small", {}, {"min_elements": 10 ** 6}),
    ("gemm_attrs", {"gemm_attrs": {"transB": 1, "alpha": 2.0}}, {}),
])
def test_negative_each_refusal(reason, kw, opts):
    m = projections(**kw)
    r = _relayout(m, **opts)
    assert r.counts.get(f"refused.{reason}", 0) >= 1, r.counts


def test_negative_integer_weight_is_refused():
    x = h.make_tensor_value_info("x", T.INT32, [3, 64])
    w = onnx.numpy_helper.from_array(np.ones((64, 40), np.int32), "W")
    g = h.make_graph([h.make_node("MatMul", ["x", "W"], ["y"])], "g", [x],
                     [h.make_tensor_value_info("y", T.INT32, [3, 40])], [w])
    m = ir.serde.deserialize_model(h.make_model(g, opset_imports=[h.make_opsetid("", 23)]))
    r = _relayout(m)
    assert r.counts == {"matches": 0, "weights_relaid": 0, "padding_bytes": 0, "refused.dtype": 1}


def test_numerical_ort_before_vs_after():
    x = rng.standard_normal((3, 64)).astype(np.float32)
    before = run(projections(), {"x": x})
    m = projections()
    _relayout(m)
    after = run(m, {"x": x})
    for k in before:
        assert np.linalg.norm(after[k] - before[k]) / np.linalg.norm(before[k]) < 1e-6, k


@pytest.mark.slow
def test_nz_build_gives_the_same_logits(tmp_path, tiny_build, tiny_cache):
    """kimi-k3.1-tiny with relayout_nz vs without, through the runtime: relative error < 1e-6 (fp32). The nz build
    starts from the session build's cache (its trace and shared passes hit)."""
    from kimi_compile.build import build
    from kimi_compile.recipe import load_recipe
    from kimi_compile.runtime import load

    plain = tiny_build[1]
    nz = build(load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-nz.yaml")), tmp_path / "nz", cache=tiny_cache)
    assert sum(r["counts"].get("matches", 0) for r in nz.manifest["pass_log"] if r["name"] == "relayout_nz") >= 30
    assert nz.manifest["graphs"]["decode"]["op_histogram"]["kimi.MatMulNZ"] >= 15  # the rest live in kimi.KDA/MoE
    prompts = [[5, 17, 3, 99, 123, 7, 8, 9, 10, 11], [42, 43, 44]]
    a, b = load(plain.artifact), load(nz.artifact)
    ca, cb = a.new_cache(2, 64), b.new_cache(2, 64)
    la, lb = a.prefill(prompts, ca), b.prefill(prompts, cb)
    errs = [np.linalg.norm(lb - la) / np.linalg.norm(la)]
    tok = la[:, -1].argmax(-1).tolist()
    for _ in range(8):
        da, db = a.decode(tok, ca), b.decode(tok, cb)
        errs.append(np.linalg.norm(db - da) / np.linalg.norm(da))
        tok = da.argmax(-1).tolist()
    assert max(errs) < 1e-6, errs
