"""TensorRT backend: per-op lowering (runs without TensorRT), engine builds with tensorrt_rtx's CPU-only AOT build
(skipped when tensorrt_rtx is not importable), error attribution, and the executor's refusal on a machine without a
GPU that the runtime accepts. Nothing here executes an engine: no machine of ours can."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

from kimi_compile import ops
from kimi_compile.backends import BackendError
from kimi_compile.backends import tensorrt as trt_backend
from kimi_compile.backends.tensorrt import lowering as tl

HAVE_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
needs_rtx = pytest.mark.skipif(not HAVE_RTX, reason="tensorrt_rtx is not installed "
                                                     "(pip install 'kimi-compile[tensorrt-rtx]')")
REPO = Path(__file__).resolve().parents[2]
CTX = {"target": "sm89", "export": {"block_size": 4, "max_seq_len": 16, "max_batch": 2}}


def _fn_proto(op: str) -> onnx.FunctionProto:
    p = ops.lookup(op).function()
    return p if isinstance(p, onnx.FunctionProto) else p.to_function_proto()


def paged_model(with_quant: bool = True) -> onnx.ModelProto:
    """pool [NB,4,8] <- PagedWrite(slots, values); y = PagedGather(pool', block_table) (-> QDQFP8Tile)."""
    f = TP.FLOAT
    nodes = [oh.make_node("PagedWrite", ["pool", "slots", "values"], ["pool.out"], name="write", domain="kimi"),
             oh.make_node("PagedGather", ["pool.out", "block_table"], ["g"], name="gather", domain="kimi")]
    if with_quant:
        nodes.append(oh.make_node("QDQMX", ["g"], ["y"], name="qdq", domain="kimi", block=8))
    else:
        nodes.append(oh.make_node("Identity", ["g"], ["y"], name="id"))
    g = oh.make_graph(nodes, "paged", [
        oh.make_tensor_value_info("pool", f, ["num_blocks", 4, 8]),
        oh.make_tensor_value_info("slots", TP.INT64, ["batch"]),
        oh.make_tensor_value_info("values", f, ["batch", 8]),
        oh.make_tensor_value_info("block_table", TP.INT64, ["batch", "max_blocks"])],
        [oh.make_tensor_value_info("y", f, None), oh.make_tensor_value_info("pool.out", f, None)])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", ops.ONNX_OPSET), oh.make_opsetid("kimi", 1)])
    m.functions.extend(_fn_proto(o) for o in ("PagedWrite", "PagedGather", *(("QDQMX",) if with_quant else ())))
    return m


def _ort(m: onnx.ModelProto, feeds):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _feeds(rng):
    return {"pool": rng.standard_normal((5, 4, 8)).astype(np.float32), "slots": np.array([5, 9], np.int64),
            "values": (rng.standard_normal((2, 8)) * 3).astype(np.float32),
            "block_table": np.array([[1, 2], [3, 4]], np.int64)}


# ---- lowering (no TensorRT needed) -----------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["tensorrt", "tensorrt_rtx"])
def test_lowering_inlines_every_kimi_node_with_traceable_names(flavour):
    low, recs, origin = tl.lower_model(paged_model(), flavour, lambda *a: False)
    assert [r["op"] for r in recs] == ["kimi.PagedWrite", "kimi.PagedGather", "kimi.QDQMX"]
    assert all(r["kind"] == "native" for r in recs)
    assert {r["source"] for r in recs} == {"plugins/paged_cache/tensorrt.py", "plugins/quant/tensorrt.py"}
    assert not [n for n in low.graph.node if n.domain == "kimi"] and not list(low.functions)
    assert "kimi" not in {o.domain for o in low.opset_import}
    body = [n for n in low.graph.node if n.name.startswith("write/")]
    assert body and all(origin[n.name] == {"node": "write", "op": "PagedWrite"} for n in body)
    assert "ScatterND" in {n.op_type for n in body}
    assert "QuantizeLinear" in {n.op_type for n in low.graph.node if n.name.startswith("qdq/")}  # explicit Q/DQ
    assert not [n for n in low.graph.node if n.op_type == "Cast" and n.name.startswith("qdq/")
                and oh.get_attribute_value(n.attribute[0]) == TP.FLOAT8E4M3FN]


def test_lowered_graph_matches_original_on_onnxruntime():
    rng = np.random.default_rng(0)
    feeds = _feeds(rng)
    m = paged_model()
    low, _, _ = tl.lower_model(m, "tensorrt_rtx", lambda *a: False)
    want, got = _ort(m, feeds), _ort(low, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)  # the Q/DQ rewrite is exact: same FP8 rounding as the Cast


@pytest.mark.parametrize("op,attrs", [("QDQFP8Tile", {"tile": 8}), ("QDQFP8Tile", {"tile": 8, "scale_fmt": "ue8m0"}),
                                      ("QDQMX", {"block": 8, "rounding": "ceil"})])
def test_quant_rewrite_is_exact(op, attrs):
    g = oh.make_graph([oh.make_node(op, ["x"], ["y"], name="q", domain="kimi", **attrs)], "q",
                      [oh.make_tensor_value_info("x", TP.FLOAT, [3, 16])], [oh.make_tensor_value_info("y", TP.FLOAT,
                                                                                                         None)])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", ops.ONNX_OPSET), oh.make_opsetid("kimi", 1)])
    m.functions.append(_fn_proto(op))
    low, _, _ = tl.lower_model(m, "tensorrt", lambda *a: False)
    assert not [n for n in low.graph.node if n.op_type == "Constant" and "value_string" in
                {a.name for a in n.attribute}]  # string attribute comparisons folded (TensorRT has no strings)
    x = {"x": (np.random.default_rng(1).standard_normal((3, 16)) * 50).astype(np.float32)}
    np.testing.assert_array_equal(_ort(low, x)[0], _ort(m, x)[0])


def test_plugin_lowering_needs_a_registered_creator():
    low, rec = tl.choose("KDARecurrence", "tensorrt", lambda *a: False)
    assert rec["kind"] == "native" and "not registered" in rec["fallback_from"]
    low, rec = tl.choose("KDARecurrence", "tensorrt", lambda name, v, ns: (name, ns) == ("KDARecurrence", "kimi"))
    assert rec["kind"] == "plugin" and rec["plugin"] == "kimi::KDARecurrence" and rec["aot"] is True
    with pytest.raises(tl.LoweringError, match="KDARecurrence.*not registered"):
        tl.choose("KDARecurrence", "tensorrt", lambda *a: False, {"KDARecurrence": "plugin"})
    low, rec = tl.choose("KDARecurrence", "tensorrt", lambda *a: True, {"KDARecurrence": "native"})
    assert rec["kind"] == "native" and rec["source"] == "recipe backend.options.lowering"


def test_plugin_node_carries_the_parser_plugin_attributes():
    m = paged_model(with_quant=False)
    low, recs, _ = tl.lower_model(m, "tensorrt", lambda name, v, ns: True,)
    # PagedWrite/PagedGather declare no plugin: still native even when every creator "exists"
    assert [r["kind"] for r in recs] == ["native", "native"]
    g = oh.make_graph([oh.make_node("KDARecurrence", list("qkvgbs"), ["o", "s2"], name="kda", domain="kimi")], "k",
                      [oh.make_tensor_value_info(x, TP.FLOAT, None) for x in "qkvgbs"],
                      [oh.make_tensor_value_info("o", TP.FLOAT, None)])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", ops.ONNX_OPSET), oh.make_opsetid("kimi", 1)])
    low, recs, _ = tl.lower_model(m, "tensorrt", lambda *a: True)
    (n,) = low.graph.node
    attrs = {a.name: oh.get_attribute_value(a) for a in n.attribute}
    assert (n.op_type, n.domain, attrs["plugin_namespace"], attrs["aot"]) == ("KDARecurrence", "kimi", b"kimi", 1)
    assert not list(low.functions)  # the parser must not expand the body of a plugin node


def test_missing_tensorrt_names_the_extra(monkeypatch):
    monkeypatch.setattr(trt_backend, "_try_import", lambda flavour: None)
    with pytest.raises(BackendError, match=r"kimi-compile\[tensorrt-rtx\]"):
        trt_backend.version()
    with pytest.raises(BackendError, match=r"pip install 'kimi-compile\[tensorrt\]'"):
        trt_backend.load_trt("tensorrt")


def test_profile_ranges_and_unknown_dims():
    opts = trt_backend._parse_options({})
    r = trt_backend.dim_ranges("prefill", {"block_size": 16, "max_seq_len": 256, "max_batch": 8}, opts)
    assert r["seq"] == (2, 64, 256) and r["batch"] == (1, 1, 8) and r["max_blocks"][2] == 16
    assert r["num_blocks"][2] == 8 * 16 + 1
    assert trt_backend.dim_ranges("decode", {"block_size": 16, "max_seq_len": 256, "max_batch": 8}, opts)["seq"] == \
        (1, 1, 1)
    m = paged_model()
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "pages"
    with pytest.raises(BackendError, match="input 'pool' dim 0 is 'pages'"):
        trt_backend._profile_shapes(m, r, "prefill")


def test_options_are_validated():
    from kimi_compile.recipe import RecipeError

    with pytest.raises(RecipeError, match="backend.options.flavor"):
        trt_backend._parse_options({"flavor": "tensorrt_rtx"})
    with pytest.raises(RecipeError, match="optimization_level"):
        trt_backend._parse_options({"optimization_level": 9})


# ---- engines (tensorrt_rtx, CPU-only AOT build) -------------------------------------------------------------------


def _ir(m: onnx.ModelProto):
    import onnx_ir as ir

    return ir.serde.deserialize_model(m)


@needs_rtx
def test_build_engine_records_lowering_io_and_layers(tmp_path):
    rec = trt_backend.build({"prefill": _ir(paged_model())}, tmp_path,
                            {"flavour": "tensorrt_rtx", "_build": CTX})
    p = rec["prefill"]
    assert (tmp_path / p["file"]).stat().st_size == p["engine_bytes"] > 0
    assert p["flavour"] == rec["_trt"]["flavour"] == "tensorrt_rtx"
    assert p["compute_capabilities"] == ["sm89"] and p["strongly_typed"]
    assert [x["op"] for x in p["lowering"]] == ["kimi.PagedWrite", "kimi.PagedGather", "kimi.QDQMX"]
    io = {x["name"]: x for x in p["io"]}
    assert io["pool"]["max"] == [2 * 4 + 1, 4, 8] and io["pool"]["max_bytes"] == 9 * 4 * 8 * 4
    assert p["layers"]["count"] > 0 and p["layers"]["source"] in ("builder verbose layer report", "engine inspector")
    layers = json.loads((tmp_path / p["layers"]["file"]).read_text())["layers"]
    assert any(n.startswith("write/") for x in layers for n in x["onnx_nodes"])
    assert set(p["kimi_op_layers"]) <= {"write", "gather", "qdq"} and p["kimi_op_layers"]
    assert rec["_trt"]["executed"] is False and "CPU-only" in rec["_trt"]["note"]
    assert p["timing_cache"] is None and "no-ops" in p["timing_cache_note"]


@needs_rtx
def test_parse_failure_names_the_onnx_node_and_kimi_op(tmp_path):
    m = paged_model(with_quant=False)
    bad = oh.make_function("kimi", "PagedGather", ["pool", "block_table"], ["out"], [
        oh.make_node("Unique", ["pool"], ["out"], name="uniq")], [oh.make_opsetid("", ops.ONNX_OPSET)])
    fns = [f for f in m.functions if f.name != "PagedGather"] + [bad]
    del m.functions[:]
    m.functions.extend(fns)
    with pytest.raises(BackendError) as e:
        trt_backend.build({"prefill": _ir(m)}, tmp_path, {"flavour": "tensorrt_rtx", "_build": CTX})
    msg = str(e.value)
    assert "node 'gather/uniq' (Unique), lowered from node 'gather' (kimi.PagedGather)" in msg, msg


@needs_rtx
def test_rtx_refuses_hopper_target(tmp_path):
    with pytest.raises(BackendError, match="sm90"):
        trt_backend.build({"prefill": _ir(paged_model())}, tmp_path,
                          {"flavour": "tensorrt_rtx", "_build": {**CTX, "target": "sm90"}})


@needs_rtx
def test_executor_refuses_precisely_without_an_accepted_gpu(tmp_path):
    from kimi_compile.backends.tensorrt.executor import EngineLoadError, Executor

    rec = trt_backend.build({"prefill": _ir(paged_model())}, tmp_path, {"flavour": "tensorrt_rtx", "_build": CTX})
    manifest = {"graphs": {"prefill": rec["prefill"]}, "backend": {"name": "tensorrt", "trt": rec["_trt"]}}
    try:
        Executor(tmp_path, manifest)
    except EngineLoadError as e:
        assert "engines/prefill.engine" in str(e) and "cannot load the prefill engine" in str(e)
    else:  # a GPU of compute capability 8.x/12.x would load it: then the engine is real and running is next
        pytest.skip("this machine has a GPU that tensorrt_rtx accepts; the load path succeeded")


@needs_rtx
@pytest.mark.slow
def test_tiny_recipe_builds_prefill_and_decode_engines(tmp_path, tiny_build):
    """The traced kimi-k3.1-tiny graphs (the session's ONNX Runtime build, same passes) -> both engines, CPU-only."""
    import onnx_ir as ir

    from kimi_compile.functions import attach_functions

    res = tiny_build[1]
    graphs = {p: ir.load(res.artifact / g["file"]) for p, g in res.manifest["graphs"].items()}
    for g in graphs.values():
        attach_functions(g)
    rec = trt_backend.build(graphs, tmp_path / "trt", {"flavour": "tensorrt_rtx", "_build": {
        "target": "sm89", "export": res.manifest["recipe"]["export"]}})
    for phase in ("prefill", "decode"):
        p = rec[phase]
        assert (tmp_path / "trt" / p["file"]).is_file() and p["layers"]["count"] > 0
        in_graph = {f"kimi.{n.op_type}" for n in graphs[phase].graph if n.domain == "kimi"}
        assert {x["op"] for x in p["lowering"]} == in_graph
        assert {"kimi.KDA", "kimi.IndexerTopK", "kimi.SparseMLA", "kimi.MoE"} <= in_graph  # the fused graph
        assert any(k.startswith("node_KDA") for k in p["kimi_op_layers"])
    seq = {x["name"]: x for x in rec["prefill"]["io"]}["input_ids"]
    assert seq["min"] == [1, 2] and seq["max"] == [8, 256]
    assert {x["name"]: x for x in rec["decode"]["io"]}["input_ids"]["max"] == [8, 1]


@needs_rtx
@pytest.mark.slow
def test_trt_recipe_builds_then_warm_rebuild_hits_the_backend_cache(tmp_path, monkeypatch, tiny_cache):
    from kimi_compile.artifact import load_manifest
    from kimi_compile.build import build
    from kimi_compile.recipe import load_recipe

    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(tiny_cache.root))  # the session build's trace hits
    recipe = load_recipe(REPO / "recipes/kimi-k3.1-tiny-trt.yaml")
    cold = build(recipe, tmp_path / "a")
    assert cold.cache_hits["backend"] == {"hits": 0, "misses": 1}
    warm = build(recipe, tmp_path / "a")
    assert warm.cache_hits["backend"] == {"hits": 1, "misses": 0}
    m = load_manifest(tmp_path / "a")  # checks every file's sha256
    assert m["backend"]["trt"]["flavour"] == "tensorrt_rtx" and m["backend"]["trt"]["executed"] is False
    for phase in ("prefill", "decode"):
        assert m["files"][f"engines/{phase}.engine"]["bytes"] == m["graphs"][phase]["engine_bytes"]
