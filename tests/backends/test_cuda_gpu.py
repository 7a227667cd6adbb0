"""The cuda backend on a GPU (skipped without CUDA): the tiny presets' tokens equal the fp32 reference's, CUDA-graph
replay is bit-identical to eager execution of the same program, and the small preset has no reference fallback.
The bf16 + quantized accuracy of the small preset against the fp32 reference is measured by bench/e2e_gpu.py
(--sections accuracy) in the same call as the benchmark."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("cuda backend GPU tests need a CUDA GPU", allow_module_level=True)

from kimi_compile.build import build  # noqa: E402
from kimi_compile.cache import CompileCache  # noqa: E402
from kimi_compile.recipe import load_recipe, with_overrides  # noqa: E402
from kimi_compile.runtime import load  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 250, 7, 12, 40, 41, 8, 300, 2, 77], [9, 8, 7], [400, 1, 2, 3, 4, 5, 6]]


# a folder of artifacts built beforehand (on any machine: `kimi-compile build` of the recipes below, named
# <recipe>.ort, <recipe>.cuda (its backend overridden) and kimi-k3.1-tiny-cuda): the tests then spend GPU-machine time on the GPU, not tracing
PREBUILT = os.environ.get("KIMI_GPU_TEST_ARTIFACTS")


@pytest.fixture(scope="module", params=["kimi-k3-tiny", "kimi-k3.1-tiny"])
def tiny_pair(request, tmp_path_factory):
    if PREBUILT:
        return os.path.join(PREBUILT, f"{request.param}.ort"), os.path.join(PREBUILT, f"{request.param}.cuda")
    tmp = tmp_path_factory.mktemp(request.param)
    cache = CompileCache(root=tmp / "cache")
    recipe = load_recipe(os.path.join(ROOT, "recipes", f"{request.param}.yaml"))
    ort = build(recipe, tmp / "ort", cache=cache)
    cuda = build(with_overrides(recipe, backend="cuda", target="cuda"), tmp / "cuda", cache=cache)
    return ort.artifact, cuda.artifact


def test_tiny_tokens_equal_the_fp32_reference_on_the_gpu(tiny_pair):
    ort_dir, cuda_dir = tiny_pair
    want = load(ort_dir).generate(PROMPTS, 32, stop_at_eos=False)  # ONNX Runtime = the reference (--verify'd)
    sess = load(cuda_dir)
    assert sess.backend.device.type == "cuda" and sess.backend.graphs
    assert sess.generate(PROMPTS, 32, stop_at_eos=False) == want


def test_tiny_logits_are_within_1e4_of_the_fp32_reference_on_the_gpu(tiny_pair):
    """fp32 on the GPU is fp32: the prefill's and 12 teacher-forced decode steps' last-token logits (the reference's
    greedy tokens fed to both) within 1e-4 relative error of ONNX Runtime's. (fla's chunk_kda in float32 computed in
    TF32: about 1e-3 here, and it flipped a greedy token of kimi-k3-tiny whose top-1 margin is 0.0011 on H100.)"""
    ort_dir, cuda_dir = tiny_pair
    ref, gpu = load(ort_dir), load(cuda_dir)
    assert gpu.backend.device.type == "cuda"
    cr, cg = ref.new_cache(len(PROMPTS)), gpu.new_cache(len(PROMPTS))
    lr, lg = ref.prefill_last(PROMPTS, cr), gpu.prefill_last(PROMPTS, cg)
    for step in range(12):
        a = np.asarray(lr, dtype=np.float64)
        b = lg.float().cpu().numpy().astype(np.float64)
        err = np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1)
        assert err.max() < 1e-4, (step, err)
        tokens = a.argmax(-1).tolist()
        lr, lg = ref._decode(tokens, cr), gpu._decode(tokens, cg)


def _greedy_rows(sess, prompts, steps: int = 12) -> torch.Tensor:
    """The last-token logits of a prefill and of `steps` greedy decode steps, copied to the host."""
    cache = sess.new_cache(len(prompts))
    last = sess.prefill_last(prompts, cache)
    rows = []
    for _ in range(steps):
        rows.append(last.float().cpu().clone())
        last = sess._decode(last.argmax(-1).tolist(), cache)
    return torch.stack(rows)


def test_graph_replay_is_bit_identical_to_eager(tiny_pair):
    _, cuda_dir = tiny_pair
    P = [p[:3] for p in PROMPTS]
    outs = {}
    for graphs in (False, True):
        sess = load(cuda_dir)
        sess.backend.graphs = graphs
        outs[graphs] = _greedy_rows(sess, P)
        if graphs:
            spec = next(iter(sess.backend.program("decode")._specs.values()))
            assert spec.graph is not None, spec.capture_error
    assert torch.equal(outs[True], outs[False])


def test_small_preset_has_no_reference_fallback_on_the_gpu(tmp_path):
    """The GPU coverage the build records for kimi-k3.1-small-cuda: every kimi.* node runs a kernel."""
    from kimi_compile.backends.cuda.program import Program

    recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-small-cuda.yaml"))
    art = os.environ.get("KIMI_SMALL_ARTIFACT")
    if art is None:
        art = build(recipe, tmp_path / "small", cache=CompileCache(root=tmp_path / "cache")).artifact
    man = json.loads(open(os.path.join(art, "manifest.json")).read())
    for phase, cov in man["backend"]["gpu_coverage"].items():
        assert cov["fallbacks"] == [], (phase, cov["fallbacks"])
    sess = load(art)
    for phase in ("prefill", "decode"):
        rows = sess.backend.program(phase).coverage()
        assert rows and all(r["impl"].startswith("kernel:") for r in rows), rows
    assert np.all(np.asarray(sess.generate([[1, 2, 3, 4]], 4, stop_at_eos=False)) >= 0)


def test_stream_plan_replay_is_bit_identical_to_one_stream(tmp_path):
    """kimi-k3.1-tiny-cuda carries an assign_streams plan (3 streams): its decode, captured as a CUDA graph with
    side streams forked and joined by events, gives exactly the logits of the same program on one stream."""
    if PREBUILT:
        art = os.path.join(PREBUILT, "kimi-k3.1-tiny-cuda")
    else:
        recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-cuda.yaml"))
        art = build(recipe, tmp_path / "cuda", cache=CompileCache(root=tmp_path / "cache")).artifact
    P = [p[:5] for p in PROMPTS]
    outs = {}
    for streams in (False, True):
        sess = load(art)
        sess.backend.streams = streams
        outs[streams] = _greedy_rows(sess, P)
        prog = sess.backend.program("decode")
        assert prog.streams == (3 if streams else 1), prog.streams
        spec = next(iter(prog._specs.values()))
        assert spec.graph is not None, spec.capture_error
        assert spec.multi_stream == streams
    assert torch.equal(outs[True], outs[False])


_FRESH_RUN = """
import json, os, sys
from triton import knobs
from kimi_compile.runtime import load
compiled, hits = [], []
knobs.compilation.listener = lambda **kw: (hits if kw["cache_hit"] else compiled).append(kw["src"].name)
sess = load(sys.argv[1])
out = [sess.generate(batch, 6, stop_at_eos=False) for batch in json.loads(sys.argv[2])]
print(json.dumps({"kernel_cache": sess.backend.kernel_cache, "tokens": out, "compiled": compiled, "hits": hits}))
"""


def test_warmed_artifact_runs_without_compiling_on_a_fresh_cache(tmp_path):
    """`kimi-compile warm` (its own process, as a user runs it) packs the kernels into the artifact; a process with an
    empty Triton cache then gets them installed and, serving shapes warm covers (one prompt of a length in a warmed
    class; a batch of 3-token prompts, decode at their bucket), compiles nothing (Triton's compilation listener sees
    only cache hits, and no cache entry appears that the artifact did not ship) and gives the tokens of a process
    that compiled its own."""
    import shutil
    import subprocess
    import sys

    art = tmp_path / "art"
    if PREBUILT:
        shutil.copytree(os.path.join(PREBUILT, "kimi-k3.1-tiny-cuda"), art)
    else:
        recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-cuda.yaml"))
        build(recipe, art, cache=CompileCache(root=tmp_path / "cache"))
    P = [[PROMPTS[0][:13]], [p[:3] for p in PROMPTS]]

    def fresh(name: str, env_extra: dict | None = None):
        cache = tmp_path / name
        cache.mkdir()
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache), **(env_extra or {})}
        r = subprocess.run([sys.executable, "-c", _FRESH_RUN, str(art), json.dumps(P)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1]), {p.name for p in cache.iterdir() if p.is_dir()}

    cold, cold_entries = fresh("cold")
    assert cold["kernel_cache"]["status"] == "none" and cold_entries and cold["compiled"]  # nothing shipped
    r = subprocess.run([sys.executable, "-m", "kimi_compile", "warm", str(art), "--batch", "1,4", "--json",
                        "--prompt-tokens", "40"], env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "unused")},
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    index = json.loads((art / "kernels" / "index.json").read_text())
    shipped = {rel.split("/")[0] for rel in index["files"]}
    assert summary["entries"] == len(shipped) >= len(cold_entries) // 2
    warm, warm_entries = fresh("warm")
    kc = warm["kernel_cache"]
    assert kc["status"] == "installed" and kc["copied"] == kc["files"] > 0 and not kc["skipped"], kc
    assert warm["compiled"] == [] and warm["hits"], warm["compiled"]  # every kernel from the artifact's cache
    assert warm_entries <= shipped, sorted(warm_entries - shipped)
    assert warm["tokens"] == cold["tokens"]
