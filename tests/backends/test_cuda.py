"""The cuda backend's executor on CPU tensors (CI has no GPU): lowering, kernels that run on any device, the memory
plan, in-place caches and numerics against ONNX Runtime and the PyTorch reference. The GPU half is
tests/backends/test_cuda_gpu.py (skipped without CUDA)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx_ir as ir
import pytest
import torch

from kimi_compile.backends.cuda import memory, program
from kimi_compile.backends.cuda.program import Program
from kimi_compile.build import build, trace_options
from kimi_compile.functions import attach_functions
from kimi_compile.recipe import load_recipe, parse_recipe, with_overrides
from kimi_compile.runtime import load
from kimi_compile.verify import compare, reference_feeds, reference_outputs
from tests.conftest import ROOT, _cache_copy

PROMPTS = [[5, 17, 3, 99, 250, 7, 12, 40, 41, 8, 300, 2, 77], [9, 8, 7], [400, 1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def k31_pair(tiny_build, tmp_path_factory):
    """kimi-k3.1-tiny on onnxruntime (the session's tiny_build) and on cuda (same passes: only the backend misses)."""
    recipe, ort_res, _, _ = tiny_build
    tmp = tmp_path_factory.mktemp("cuda_k31")
    cuda = build(with_overrides(recipe, backend="cuda", target="cuda"), tmp / "cuda",
                 cache=_cache_copy(tiny_build, tmp / "cache"))
    return ort_res.artifact, cuda.artifact


@pytest.fixture(scope="module")
def k3_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda_k3")
    from kimi_compile.cache import CompileCache

    cache = CompileCache(root=tmp / "cache")
    recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3-tiny.yaml"))
    ort = build(recipe, tmp / "ort", cache=cache)
    cuda = build(with_overrides(recipe, backend="cuda", target="cuda"), tmp / "cuda", cache=cache)
    return ort.artifact, cuda.artifact


@pytest.mark.parametrize("pair", ["k3_pair", "k31_pair"])
def test_greedy_tokens_equal_onnxruntime_for_32_steps(pair, request):
    ort_dir, cuda_dir = request.getfixturevalue(pair)
    want = load(ort_dir).generate(PROMPTS, 32, stop_at_eos=False)
    sess = load(cuda_dir)
    assert sess.backend.device.type == "cpu"
    assert sorted(sess.backend._programs) == ["decode", "prefill"]  # built at load, before any request
    assert sess.generate(PROMPTS, 32, stop_at_eos=False) == want
    # the second request reuses the specialized programs (planned runs, no new specialization at the same shapes)
    assert sess.generate(PROMPTS, 32, stop_at_eos=False) == want


def test_seeded_sampling_matches_onnxruntime(k31_pair):
    ort_dir, cuda_dir = k31_pair
    kw = dict(temperature=0.8, seed=11, stop_at_eos=False)
    assert load(cuda_dir).generate(PROMPTS, 8, **kw) == load(ort_dir).generate(PROMPTS, 8, **kw)


def _programs(artifact, device="cpu"):
    import json

    man = json.loads((artifact / "manifest.json").read_text())
    out = {}
    for phase, g in man["graphs"].items():
        m = ir.load(artifact / g["file"])
        attach_functions(m)
        out[phase] = Program(m, device)
    return out, man


def test_logits_and_caches_match_the_reference(k31_pair, tiny_models):
    """fp32: every output (logits on valid rows, every cache) within 1e-4 of the PyTorch reference, on fresh ragged
    inputs, in the first (specializing) run and in the planned runs after it."""
    _, cuda_dir = k31_pair
    recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny.yaml"))
    from kimi_compile.build import load_model

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as work:
        model = load_model(recipe, Path(work))
    opts = trace_options(recipe)
    progs, _ = _programs(cuda_dir)
    for seed in (1, 2):
        feeds = reference_feeds(model, opts, seed=seed)
        for phase, f in feeds.items():
            want = reference_outputs(model, opts, phase, f)
            for _ in range(2):  # specialize, then the planned program
                got = progs[phase].run({k: torch.from_numpy(v.copy()) for k, v in f.items()})
                err = compare({k: v.numpy() for k, v in got.items()}, want, f)
                assert err < 1e-4, (phase, seed, err)


def test_caches_are_updated_in_place(k31_pair):
    """The graph's `<cache>.out` outputs are the input tensors themselves (no per-step copy)."""
    _, cuda_dir = k31_pair
    progs, man = _programs(cuda_dir)
    rng = np.random.default_rng(0)
    B, MB = 2, 4
    feeds = {"input_ids": torch.from_numpy(rng.integers(0, 100, (B, 1))), "start": torch.tensor([3, 1]),
             "lengths": torch.ones(B, dtype=torch.long), "block_table": torch.arange(1, B * MB + 1).view(B, MB)}
    for c in man["runtime"]["caches"]:
        shape = [B if d == "batch" else B * MB + 1 if d == "num_blocks" else d for d in c["shape"]]
        feeds[c["name"]] = torch.zeros(shape)
    for _ in range(2):
        out = progs["decode"].run(feeds)
        for c in man["runtime"]["caches"]:
            assert out[c["name"] + ".out"] is feeds[c["name"]], c["name"]


def _specialized(artifact):
    progs, man = _programs(artifact)
    rng = np.random.default_rng(1)
    B, MB, T = 2, 4, 11
    feeds = {"input_ids": torch.from_numpy(rng.integers(0, 100, (B, T))), "start": torch.zeros(B, dtype=torch.long),
             "lengths": torch.tensor([T, 5]), "block_table": torch.arange(1, B * MB + 1).view(B, MB)}
    for c in man["runtime"]["caches"]:
        shape = [B if d == "batch" else B * MB + 1 if d == "num_blocks" else d for d in c["shape"]]
        feeds[c["name"]] = torch.zeros(shape)
    clone = {k: v.clone() for k, v in feeds.items()}
    eager = progs["prefill"].run(feeds)
    spec = next(iter(progs["prefill"]._specs.values()))
    return spec, clone, eager


def test_kernels_declaring_out_write_into_their_planned_slots(k31_pair):
    """A kernel with Kernel.out (here AttnResMerge's, MoE's and KDA's torch forms, the CPU's kernels) is given its
    output's planned slot and writes into it (the executor copies nothing for that output), with the same numbers as
    the first, unplanned run, whose outputs the kernel allocated."""
    _, cuda_dir = k31_pair
    spec, feeds, eager = _specialized(cuda_dir)
    kinds = ("kimi.AttnResMerge", "kimi.MoE", "kimi.KDA")
    merges = [s for s in spec.steps if s.op in kinds]
    assert {s.op for s in merges} == set(kinds) and all(s.writes_out for s in merges)
    into_slot = []
    for s in merges:
        def wrapped(x, a, out=None, _fn=s.fn):
            res = _fn(x, a, out=out)
            into_slot.append(out is not None and res[0] is out[0])
            return res
        s.fn = wrapped
    planned = spec.run({k: v.clone() for k, v in feeds.items()})
    assert len(into_slot) == len(merges) and all(into_slot), into_slot
    for k in eager:
        assert torch.equal(planned[k], eager[k]), k


def test_copy_first_passes_the_slots_on():
    """A kernel whose in-place pair the executor dropped (its input cloned first) still gets out= (Kernel.out)."""
    seen = []
    run = program._copy_first(lambda x, a, **kw: seen.append((x[0] is not orig, kw)) or (x[0],), 0)
    orig = torch.zeros(2)
    slot = torch.empty(2)
    run([orig], {}, out=(slot,))
    run([orig], {})
    assert seen == [(True, {"out": (slot,)}), (True, {})]


def test_memory_plan_never_aliases_two_live_buffers(k31_pair):
    _, cuda_dir = k31_pair
    spec, feeds, eager = _specialized(cuda_dir)
    plan = spec.plan
    plan.validate()
    assert plan.lower_bound <= plan.peak <= sum(b.size for b in plan.buffers)
    assert plan.peak < sum(b.size for b in plan.buffers) / 2  # the plan reuses memory
    direct = {s.op for s in spec.steps if s.index in spec.direct}
    assert {"MatMul", "Add"} <= direct, direct  # these write straight into their slots (no copy)
    planned = spec.run({k: v.clone() for k, v in feeds.items()})
    for k in eager:
        assert torch.equal(planned[k], eager[k]), k  # same program, same numbers, bytes shared only when dead

    # a plan that puts two live buffers on the same bytes is caught by validate() ...
    bufs = sorted(plan.buffers, key=lambda b: b.first)
    a = next(b for b in bufs if b.last > b.first + 1)
    b = next(x for x in bufs if a.first < x.first < a.last and x.size <= a.size)
    bad = memory.MemoryPlan(plan.buffers, {**plan.offsets, b.value: plan.offsets[a.value]}, plan.peak,
                            plan.lower_bound)
    with pytest.raises(AssertionError, match="live together"):
        bad.validate()
    # ... and running it would change the numbers (what the check protects)
    shape_b = spec.slots[b.value].shape
    off, n = plan.offsets[a.value], spec.slots[b.value].numel() * spec.slots[b.value].element_size()
    spec.slots[b.value] = spec.arena[off:off + n].view(spec.slots[b.value].dtype).view(shape_b)
    broken = spec.run({k: v.clone() for k, v in feeds.items()})
    assert any(not torch.equal(broken[k], eager[k]) for k in eager)


def _onnx_case(op: str, gen: torch.Generator):
    """Random inputs and attributes for one ONNX op of the cuda backend's direct-write table."""
    r = lambda *sh: torch.randn(*sh, generator=gen)
    if op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"):
        return [torch.randint(0, 3, (4, 5), generator=gen), torch.randint(0, 3, (5,), generator=gen)], {}
    if op in ("And", "Or", "Xor"):
        return [r(4, 5) > 0, r(4, 5) > 0], {}
    if op == "Not":
        return [r(4, 5) > 0], {}
    if op == "Div":
        return [torch.randint(-9, 9, (4, 5), generator=gen), torch.randint(1, 4, (4, 5), generator=gen)], {}
    if op in ("Log", "Sqrt"):
        return [r(4, 5).abs() + 0.1], {}
    if op == "Where":
        return [r(4, 5) > 0, r(4, 5), r(5)], {}
    if op == "Cast":
        return [r(4, 5) * 300], {"to": 17}  # float32 -> float8e4m3fn, saturating
    if op == "Concat":
        return [r(2, 5).bfloat16(), r(3, 5).bfloat16()], {"axis": 0}
    if op == "MatMul":
        return [r(3, 4, 6).bfloat16(), r(6, 5)], {}
    if op == "RMSNormalization":
        return [r(3, 8).bfloat16(), r(8).bfloat16()], {"epsilon": 1e-5}
    if op in ("Add", "Sub", "Mul"):
        return [r(4, 5).bfloat16(), r(5).bfloat16()], {}
    return [r(4, 5)], {}


def test_onnx_ops_write_into_their_slots_what_their_table_computes():
    """Each op the executor writes straight into its output's planned slot (onnx_ops.OUT_TABLE) gives bit for bit
    what its TABLE entry gives, on random inputs (broadcast, mixed dtypes, a saturating fp8 cast, integer
    division)."""
    from kimi_compile.backends.cuda import onnx_ops

    gen = torch.Generator().manual_seed(0)
    for op, direct in onnx_ops.OUT_TABLE.items():
        x, a = _onnx_case(op, gen)
        (want,) = onnx_ops.TABLE[op](x, a)
        out = torch.full_like(want, 7) if want.dtype != torch.bool else torch.zeros_like(want)
        direct(x, a, out)
        assert out.dtype == want.dtype and out.shape == want.shape, op
        assert torch.equal(out.view(torch.uint8) if out.dtype.itemsize == 1 and out.is_floating_point() else out,
                           want.view(torch.uint8) if want.dtype.itemsize == 1 and want.is_floating_point()
                           else want), op


def _graph_program(nodes, inputs, outputs, inits):
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
                          [numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    return Program(ir.serde.deserialize_model(model), "cpu")


@pytest.mark.parametrize("case", ["slice_output", "transpose_output_read_later"])
def test_graph_outputs_that_view_an_intermediate_keep_its_bytes(case):
    """A graph output that is a view of a planned intermediate (a Slice or a Transpose: not in onnx_ops.VIEWS) keeps
    that intermediate's bytes alive to the end of the step, so no later slot (written directly by its op) overwrites
    it; the planned run equals the eager first run. Both cases failed before the first run recorded such aliases."""
    from onnx import helper

    W = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    if case == "slice_output":
        nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]),
                 helper.make_node("Slice", ["y", "s0", "s1", "ax"], ["logits"]),
                 helper.make_node("Mul", ["x", "x"], ["a"]), helper.make_node("Add", ["a", "x"], ["b"]),
                 helper.make_node("Mul", ["b", "b"], ["c"]), helper.make_node("Add", ["c", "a"], ["z"])]
        prog = _graph_program(nodes, [("x", [4, 8])], [("logits", [1, 8]), ("z", [4, 8])],
                              {"W": W, "s0": np.array([3]), "s1": np.array([4]), "ax": np.array([0])})
        x = torch.randn(4, 8)
    else:
        nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]),
                 helper.make_node("Transpose", ["y"], ["yt"], perm=[1, 0]),
                 helper.make_node("MatMul", ["yt", "W"], ["w2"]), helper.make_node("Mul", ["w2", "w2"], ["z"])]
        prog = _graph_program(nodes, [("x", [8, 8])], [("yt", [8, 8]), ("z", [8, 8])], {"W": W})
        x = torch.randn(8, 8)
    eager = {k: v.clone() for k, v in prog.run({"x": x}).items()}
    for _ in range(2):
        planned = prog.run({"x": x.clone()})
        for k in eager:
            assert torch.equal(planned[k], eager[k]), k


def test_plan_on_random_lifetimes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        bufs = []
        for v in range(int(rng.integers(1, 40))):
            first = int(rng.integers(0, 30))
            bufs.append(memory.Buffer(v, memory.aligned(int(rng.integers(1, 5000))), first,
                                      first + int(rng.integers(0, 10))))
        p = memory.plan(bufs)
        p.validate()
        assert p.lower_bound <= p.peak


def test_gpu_coverage_is_in_the_manifest(k31_pair):
    import json

    _, cuda_dir = k31_pair
    man = json.loads((cuda_dir / "manifest.json").read_text())
    cov = man["backend"]["gpu_coverage"]
    for phase, g in man["graphs"].items():
        kimi = sum(n for op, n in g["op_histogram"].items() if op.startswith("kimi."))
        assert len(cov[phase]["nodes"]) == kimi
        for row in cov[phase]["fallbacks"]:  # every fallback says why
            assert row["impl"] == "reference" and row["reason"]
    # the float32 tiny indexer (head dim 32, float pools) is not the Triton kernel's layout: its torch kernel runs
    idx = [r for r in cov["decode"]["nodes"] if r["op"] == "kimi.IndexerTopK"]
    assert idx and all(r["impl"] == "kernel:torch.indexer_topk" and "MXFP8" in r["reason"] for r in idx)


def test_phases_share_one_copy_of_each_weight(k31_pair):
    """The phases' traces name a weight differently (`val_188` in prefill, `val_506` in decode), yet it is one weight:
    weights.bin stores each distinct content once (its size is the distinct bytes plus alignment) and the executor
    loads it once, both programs holding the same device tensor, which no step writes into."""
    import hashlib
    import json

    from kimi_compile.backends.cuda import Executor
    from kimi_compile.backends.serialize import ALIGN

    _, cuda_dir = k31_pair
    man = json.loads((cuda_dir / "manifest.json").read_text())
    where, content = {}, {}
    for phase in ("prefill", "decode"):
        m = ir.load(cuda_dir / man["graphs"][phase]["file"])
        for name, v in m.graph.initializers.items():
            t = v.const_value
            if isinstance(t, ir.ExternalTensor):
                data = t.tobytes()
                where[phase, name] = (t.offset, t.length)
                content.setdefault(hashlib.sha256(data).hexdigest(), set()).add((t.offset, t.length))
    assert all(len(places) == 1 for places in content.values())  # equal bytes, one place
    pre = {where[k] for k in where if k[0] == "prefill"}
    dec = {where[k] for k in where if k[0] == "decode"}
    assert len(pre & dec) >= 0.9 * len(dec)  # decode's weights are prefill's (names differ)
    distinct = sum(n for _, n in set(where.values()))
    size = (cuda_dir / "graphs" / "weights.bin").stat().st_size
    assert distinct <= size <= distinct + ALIGN * len(content)
    sess = load(cuda_dir)
    ex = sess.backend
    assert isinstance(ex, Executor)
    ex.preload()
    ptrs = {ph: {t.data_ptr() for t in ex.program(ph).consts.values() if t.numel() * t.element_size() >= 1024}
            for ph in ("prefill", "decode")}
    held = {t.data_ptr() for t in (*ex.program("prefill").consts.values(), *ex.program("decode").consts.values())
            if t.numel() * t.element_size() >= 1024}
    assert len(ptrs["prefill"] & ptrs["decode"]) >= 0.9 * len(ptrs["decode"])
    assert len(held) == len(set(where.values()))  # one device tensor per stored weight
    # and nothing writes into them: a prefill and decode steps leave every weight's bytes as loaded
    before = {(ph, i): t.clone() for ph in ("prefill", "decode") for i, t in ex.program(ph).consts.items()}
    sess.generate([p[:6] for p in PROMPTS], 3, stop_at_eos=False)
    assert all(torch.equal(ex.program(ph).consts[i], t) for (ph, i), t in before.items())


def test_node_check_runs_and_finds_the_cpu_kernels_at_rounding_level(k31_pair, tmp_path):
    """bench/node_check.py (the GPU runs' node-by-node check) on CPU tensors, as a user runs it: every kimi.* node's
    kernel within 1e-5 of its reference on the same inputs, top-k index sets equal, and the whole steps within 1e-5
    (the script broke once, unnoticed, when kernels started taking out= slots)."""
    import json
    import subprocess
    import sys

    _, cuda_dir = k31_pair
    out = tmp_path / "node_check.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "node_check.py"), str(cuda_dir), "--out", str(out),
                    "--prompt", "16"], check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    rows = [o for r in res["nodes"] for o in r["outputs"]]
    assert {r["phase"] for r in res["nodes"]} == {"prefill", "decode", "prefill (continued, start > 0)"}
    assert rows and all(o["finite"] and o["rel_err"] < 1e-5 for o in rows if "rel_err" in o)
    assert all(o["index_overlap_min"] == 1.0 for o in rows if "index_overlap_min" in o)
    assert any("index_overlap_min" in o for o in rows)  # the indexer's top-k was compared
    steps = [*res["whole_step"], res["continued_vs_whole_prefill"]]
    assert all(s["rel_err"] < 1e-5 and s["top1_agree"] == 1.0 for s in steps)


def test_bfloat16_graph_runs_with_float32_states(tiny_build, tmp_path):
    """model.dtype bfloat16 + convert_dtype: weights and activations bf16, KDA states and logits float32."""
    recipe = with_overrides(tiny_build[0], backend="cuda", target="cuda")
    d = recipe.to_dict()
    d["model"]["dtype"] = "bfloat16"
    d["passes"].insert(len(d["passes"]) - 1, {"name": "convert_dtype", "enabled": True, "options": {}})
    res = build(parse_recipe(d, "bf16"), tmp_path / "bf16", cache=_cache_copy(tiny_build, tmp_path / "cache"))
    caches = {c["name"]: c["dtype"] for c in res.manifest["runtime"]["caches"]}
    assert {v for k, v in caches.items() if k.startswith("state.")} == {"float32"}
    assert {v for k, v in caches.items() if k.startswith(("kv.", "conv."))} == {"bfloat16"}
    outs = {o["name"]: o["dtype"] for o in res.manifest["graphs"]["decode"]["outputs"]}
    assert outs["logits"] == "FLOAT"
    # float32 only where a contract says so: the executor casts each output to its declared dtype, so one float32
    # activation (AttnResMerge's out, typed from its float32 function body) made every MatMul after it float32
    # (the small preset's decode step at 32K went from 4.3 to 8.4 ms on an H100)
    import onnx

    from kimi_compile import ops

    for phase in ("prefill", "decode"):
        g = onnx.load(res.artifact / "graphs" / f"{phase}.onnx", load_external_data=False).graph
        f32 = {v.name for v in list(g.value_info) + list(g.output) if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
        allowed = set()
        for n in g.node:
            if n.domain == ops.DOMAIN:
                op = ops.lookup(n.op_type)
                allowed |= {o for port, o in zip(op.outputs, n.output) if port in op.float32_ports}
            elif n.op_type == "Cast" and "logits" in n.output:
                allowed.add("logits")
        produced = {o for n in g.node for o in n.output}
        assert (f32 & produced) - allowed == set(), phase
        assert any(n.op_type == "AttnResMerge" for n in g.node)
    toks = load(res.artifact).generate(PROMPTS, 8, stop_at_eos=False)
    assert all(len(t) == 8 for t in toks)


def test_refusals_name_the_field(tiny_build):
    from kimi_compile.backends.cuda import options

    with pytest.raises(ValueError, match="batch_buckets"):
        options({"batch_buckets": [4, 2]})
    d = dataclasses.replace(tiny_build[0]).to_dict()
    d["model"]["dtype"] = "bfloat16"
    from kimi_compile.recipe import RecipeError

    with pytest.raises(RecipeError, match="model.dtype: bfloat16 graphs run on backend cuda only"):
        parse_recipe(d, "x")
    d["backend"], d["target"] = {"name": "cuda", "options": {}}, "cuda"
    with pytest.raises(RecipeError, match="needs the convert_dtype pass"):
        parse_recipe(d, "x")


def test_manifest_memory_plan_is_the_runtime_plan(k31_pair):
    """The build records the plan's peak per decode bucket and prefill chunk (meta tensors, full context capacity);
    the executor's plan for the same shapes on real tensors has the same peak."""
    import json

    _, cuda_dir = k31_pair
    man = json.loads((cuda_dir / "manifest.json").read_text())
    plans = man["backend"]["memory_plan"]
    export = man["recipe"]["export"]
    assert set(plans["decode"]) == {f"{b}x1" for b in (1, 2, 4, 8) if b <= export["max_batch"]}
    assert plans["prefill"] == {f"1x{export['prefill_chunk']}": plans["prefill"][f"1x{export['prefill_chunk']}"]}
    for p in (*plans["decode"].values(), *plans["prefill"].values()):
        assert 0 < p["lower_bound_bytes"] <= p["peak_bytes"] <= p["without_reuse_bytes"]
    progs, _ = _programs(cuda_dir)
    mb = -(-export["max_seq_len"] // export["block_size"])
    B = 4
    dims = {"batch": B, "seq": 1, "max_blocks": mb, "num_blocks": B * mb + 1}
    m = progs["decode"]
    feeds = {}
    for name, i in m.inputs:
        v = m.values[i]
        shape = [d if isinstance(d, int) else dims[str(d)] for d in v.shape]
        feeds[name] = torch.zeros(shape, dtype=torch.int64 if name in ("input_ids", "start", "lengths", "block_table")
                                  else torch.float32)
    feeds["lengths"] = torch.ones(B, dtype=torch.int64)
    m.run(feeds)
    spec = m._specs[m.signature(feeds)]
    assert spec.plan.peak == plans["decode"][f"{B}x1"]["peak_bytes"]


def test_stream_plan_can_be_turned_off(tiny_build, tmp_path):
    """kimi-k3.1-tiny-cuda's graphs carry a 3-stream plan; backend option `streams: false` (or
    `Executor.streams = False` before a phase first runs) builds the single-stream program, with the same tokens
    (on CPU tensors every step runs in order either way: the plan is replayed on a GPU)."""
    from kimi_compile.backends.cuda import options

    assert options({}).streams is True and options({"streams": False}).streams is False
    recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-cuda.yaml"))
    art = build(recipe, tmp_path / "cuda", cache=_cache_copy(tiny_build, tmp_path / "cache")).artifact
    toks = {}
    for streams in (True, False):
        sess = load(art)
        sess.backend.streams = streams
        toks[streams] = sess.generate([p[:5] for p in PROMPTS], 8, stop_at_eos=False)
        assert sess.backend.program("decode").streams == (3 if streams else 1)
        steps = sess.backend.program("decode").steps
        assert any(s.waits for s in steps) == streams
        # the memory plan: a buffer a side stream reads or writes shares its bytes with no other buffer (cross-stream
        # order is only what the events give, so reuse before or after it would race on a GPU)
        spec = next(iter(sess.backend.program("decode")._specs.values()))
        plan, side = spec.plan, [b for b in spec.plan.buffers if b.value in spec.side_values]
        assert bool(side) == streams
        for a in side:
            a0 = plan.offsets[a.value]
            for b in plan.buffers:
                b0 = plan.offsets[b.value]
                assert b is a or a0 + a.size <= b0 or b0 + b.size <= a0, (a, b)
    assert toks[True] == toks[False]
    # the plan per decoder layer in the manifest, the report (table + Gantt chart per layer kind) and inspect
    import json

    from click.testing import CliRunner

    from kimi_compile.cli import main
    from kimi_compile.report import plot_streams, render_report

    man = json.loads((art / "manifest.json").read_text())
    layers = man["graphs"]["decode"]["stream_plan"]["layers"]
    firsts = [r for r in layers if "schedule" in r]
    assert [r["kind"] for r in firsts] == ["kda", "mla+indexer"]
    assert sorted(r["layer"] for r in layers) == list(range(len(layers)))
    for r in firsts:
        assert r["nodes"] == len(r["schedule"]) and r["one_stream_us"] > 0 and r["streams"] >= 2
        assert r["one_stream_us"] == round(sum(x[3] - x[2] for x in r["schedule"]), 3)
    md = render_report(man)
    assert "## Stream plan" in md and "| decode | 3 | mla+indexer |" in md
    assert [c.split(";")[0] for c, _ in plot_streams(man)] == ["Planned schedule of layer 0 (kda)",
                                                                "Planned schedule of layer 3 (mla+indexer)"]
    out = CliRunner().invoke(main, ["inspect", str(art), "--json"])
    assert out.exit_code == 0, out.output
    sp = json.loads(out.output)["stream_plans"]["decode"]
    assert sp["streams"] == 3 and len(sp["layers"]) == len(layers) and "schedule" not in sp["layers"][0]


def test_kernels_follow_the_gpus_compute_capability():
    """A kernel with a least compute capability (Kernel.min_capability: the FP8 Triton kernels need sm_89 for
    float8e4nv) gives way to its fallback on an older GPU, with the reason in the coverage report; on a new enough
    GPU, or where the capability is unknown (a build for target "cuda"), it runs. The build reads the capability from
    its target ("sm90" -> (9, 0)); the FP8 kernels of the CUDA tables declare theirs."""
    from onnx import TensorProto, helper

    from kimi_compile import ops
    from kimi_compile.backends.cuda.program import Program
    from kimi_compile.lowering import FP8_CAPABILITY, Kernel, target_capability

    node = helper.make_node("QuantizeMX", ["x"], ["q", "s"], domain="kimi", block=32)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                          [helper.make_tensor_value_info("q", TensorProto.UINT8, [4, 64]),
                           helper.make_tensor_value_info("s", TensorProto.UINT8, [4, 2])])
    m = ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23),
                                                                       helper.make_opsetid("kimi", 1)]))
    run = lambda x, a: x  # noqa: E731 (never run: lowering only)
    table = {"QuantizeMX": Kernel(run, name="fp8", min_capability=(8, 9),
                                  fallback=Kernel(run, devices=("cuda", "cpu"), name="torch"))}
    for cap, impl in (((8, 0), "kernel:torch"), ((8, 6), "kernel:torch"), ((8, 9), "kernel:fp8"),
                      ((9, 0), "kernel:fp8"), ((12, 0), "kernel:fp8"), (None, "kernel:fp8")):
        (row,) = Program(m, "meta", kernels=table, weights=False, kernel_device="cuda", capability=cap).coverage()
        assert row["impl"] == impl, cap
        if impl == "kernel:torch":
            assert row["reason"] == f"fp8: needs a GPU of compute capability 8.9 or newer, this one is {cap[0]}.{cap[1]}"
    assert [target_capability(t) for t in ("sm90", "sm89", "sm120", "sm100", "cuda", "cpu", "sm9", None)] == \
        [(9, 0), (8, 9), (12, 0), (10, 0), None, None, None, None]
    cuda = ops.kernels("CUDA")
    for op in ("IndexerTopK", "SparseMLA", "QuantizeMX", "QDQMX"):
        assert cuda[op].min_capability == FP8_CAPABILITY and cuda[op].fallback.min_capability is None, op
