"""`kimi-compile build`: recipe -> model -> trace -> passes -> backend -> verified artifact, every stage cached.

Stages and cache keys (DESIGN.md §3, "Compile cache"):
    trace    model config + weights fingerprint + torch/onnx/onnxscript versions + trace options
    pass     previous stage key + pass name/version/options + phase
    backend  final pass key + backend name/version/options/target
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kimi_compile import __version__, ops
from kimi_compile.coverage import coverage
from kimi_compile.functions import attach_functions
from kimi_compile.artifact import ArtifactWriter
from kimi_compile.cache import CompileCache, cache_key
from kimi_compile.recipe import Recipe

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    pass


def versions() -> dict[str, str]:
    """Installed versions of the toolchain, read from package metadata (no heavy imports on a warm build)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"kimi_compile": __version__, "python": platform.python_version()}
    for name, dist in (("torch", "torch"), ("onnx", "onnx"), ("onnx_ir", "onnx-ir"), ("onnxscript", "onnxscript"),
                       ("onnxruntime", "onnxruntime"), ("numpy", "numpy")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def _fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.suffix in (".json", ".safetensors"):
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def model_source(recipe: Recipe) -> tuple[str, str]:
    """(weights fingerprint, description) without building the model: a checkpoint's file hashes, or the preset,
    seed and generator version of a random checkpoint."""
    if recipe.model.checkpoint:
        path = Path(recipe.model.checkpoint)
        if not (path / "config.json").is_file():
            raise BuildError(f"model.checkpoint: {path} is not an HF checkpoint directory (no config.json)")
        return _fingerprint(path), str(path)
    from kimi_compile.config import preset_hf_dict

    spec = {"preset": recipe.model.preset, "seed": recipe.model.seed, "init": RANDOM_INIT_VERSION,
            "config": preset_hf_dict(recipe.model.preset)}
    return cache_key(**spec), f"preset {recipe.model.preset} seed {recipe.model.seed}"


RANDOM_INIT_VERSION = 1  # bump when weights.init_random changes what a seed produces


def load_model(recipe: Recipe, workdir: Path):
    """The reference model from the recipe: a checkpoint dir, or a seeded random checkpoint of the preset (written
    as an HF checkpoint first, so the real loading path runs)."""
    import torch

    from kimi_compile.model import load_pretrained, random_checkpoint

    if recipe.model.checkpoint:
        path = Path(recipe.model.checkpoint)
    else:
        path = random_checkpoint(recipe.model.preset, recipe.model.seed, workdir / "checkpoint")
    return load_pretrained(path, dtype=torch.float32)


# ---- numerical check -------------------------------------------------------------------------------------------


def reference_feeds(model, opts, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """Fresh random, ragged feeds for both phases (decode starts from the reference prefill's caches)."""
    import torch

    from kimi_compile.trace import StepGraph, cache_specs

    cfg = model.config
    rng = np.random.default_rng(seed)
    B, MB, BS = 2, 4, opts.block_size
    NB = B * MB + 1
    T = min(2 * BS - 3, MB * BS - 2)
    lens = np.array([T, max(2, T // 2)], dtype=np.int64)
    bt = (np.arange(B * MB, dtype=np.int64).reshape(B, MB) + 1)
    caches = {}
    for s in cache_specs(cfg, BS):
        shape = [B if d == "batch" else NB if d == "num_blocks" else d for d in s.shape]
        caches[s.name] = np.zeros(shape, dtype=np.float32)
    prefill = {"input_ids": rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int64),
               "start": np.zeros(B, np.int64), "lengths": lens, "block_table": bt, **caches}
    ref = StepGraph(model, BS, False, opts.kda_chunk)
    with torch.no_grad():
        outs = ref(*[torch.from_numpy(v) for v in prefill.values()])
    specs = cache_specs(cfg, BS)
    after = {s.name: outs[1 + i].numpy() for i, s in enumerate(specs)}
    decode = {"input_ids": rng.integers(0, cfg.vocab_size, (B, 1)).astype(np.int64), "start": lens.copy(),
              "lengths": np.ones(B, np.int64), "block_table": bt, **after}
    return {"prefill": prefill, "decode": decode}


def reference_outputs(model, opts, phase: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch

    from kimi_compile.trace import StepGraph, cache_specs

    ref = StepGraph(model, opts.block_size, phase == "decode", opts.kda_chunk)
    with torch.no_grad():
        outs = ref(*[torch.from_numpy(v) for v in feeds.values()])
    names = ["logits", *[s.name + ".out" for s in cache_specs(model.config, opts.block_size)]]
    return {n: o.numpy() for n, o in zip(names, outs)}


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> float:
    """Worst relative error: logits on valid rows, and every cache output."""
    worst = 0.0
    lens = feeds["lengths"]
    for name, w in want.items():
        g = got[name]
        if name == "logits":
            g = np.concatenate([g[b, : lens[b]] for b in range(len(lens))])
            w = np.concatenate([w[b, : lens[b]] for b in range(len(lens))])
        denom = float(np.linalg.norm(w)) or 1.0
        worst = max(worst, float(np.linalg.norm(g.astype(np.float64) - w)) / denom)
    return worst


def ort_run(model_ir, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnx_ir as ir
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    model_ir = ir.external_data.load_to_model(model_ir)
    sess = ort.InferenceSession(ir.to_proto(model_ir).SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


# ---- the build ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BuildResult:
    artifact: Path
    manifest: dict
    cache_hits: dict


def build(recipe: Recipe, out_dir: str | Path, *, verify: bool = False, cache: CompileCache | None = None,
          progress: Callable[[str], None] | None = None) -> BuildResult:
    import onnx_ir as ir

    from kimi_compile import backends, pipeline
    from kimi_compile.config import from_hf_dict, load_config, preset_hf_dict

    say = progress or (lambda msg: log.info(msg))
    cache = cache or CompileCache()
    hits: dict[str, list[bool]] = {}
    if recipe.parallel.tp != 1 or recipe.parallel.cp != 1:
        raise BuildError("parallel: tp/cp > 1 need the partition passes, which this build does not have yet; "
                         "set parallel.tp and parallel.cp to 1")
    backend = backends.get(recipe.backend.name)
    from kimi_compile.trace_spec import PHASES, TraceOptions, cache_layouts, signature

    opts = TraceOptions(block_size=recipe.export.block_size, kda_chunk=recipe.export.prefill_chunk)
    passes = pipeline.resolve(recipe.passes, recipe.source or recipe.name,
                              precision=recipe.to_dict()["precision"])  # issue 5: quantize gets the precision rules
    vers = versions()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kimi-build-") as work:
        weights_fp, source = model_source(recipe)
        cfg = load_config(recipe.model.checkpoint) if recipe.model.checkpoint else \
            from_hf_dict(preset_hf_dict(recipe.model.preset))
        _model = []

        def model():  # built only when a stage misses or --verify needs the reference
            if not _model:
                say("loading model")
                _model.append(load_model(recipe, Path(work)))
            return _model[0]
        trace_key = cache_key(stage="trace", config=cfg.to_dict(), weights=weights_fp, options=dataclasses.asdict(opts),
                              torch=vers["torch"], onnx=vers["onnx"], onnxscript=vers["onnxscript"],
                              onnx_ir=vers["onnx_ir"], kimi_compile=__version__)

        def produce_trace(d: Path) -> None:
            from kimi_compile.trace import trace

            say("tracing prefill and decode graphs")
            for phase, m in trace(model(), opts).items():
                ir.save(m, d / f"{phase}.onnx", external_data=f"{phase}.data")

        entry, hit = cache.get_or_create("trace", trace_key, produce_trace)
        hits.setdefault("trace", []).append(hit)
        graphs = {p: ir.load(entry / f"{p}.onnx") for p in PHASES}
        traced = {p: ir.load(entry / f"{p}.onnx") for p in PHASES}  # kept for the coverage report
        for m in graphs.values():
            attach_functions(m)

        feeds = reference_feeds(model(), opts) if verify else None
        expected = {p: reference_outputs(model(), opts, p, feeds[p]) for p in PHASES} if verify else None
        verify_log: list[dict] = []
        pass_log: list[dict] = []
        final_keys = {}
        quantized: dict[str, Any] = {}  # issue 5: each phase right after the quantize pass (for the accuracy report)
        rebased_prefill = None
        for phase in PHASES:
            key = trace_key
            m = graphs[phase]
            if verify:
                err = compare(ort_run(m, feeds[phase]), expected[phase], feeds[phase])
                verify_log.append({"phase": phase, "after": "trace", "rel_err": err})
                if err > recipe.verify.tolerance:
                    raise BuildError(f"--verify: the traced {phase} graph differs from the reference "
                                     f"(rel err {err:.2e} > {recipe.verify.tolerance:.0e})")
            for p in passes:
                key = cache_key(stage="pass", prev=key, name=p.name, version=p.version,
                                options=pipeline.options_dict(p), phase=phase)
                cur = m
                rec: dict[str, Any] = {}

                def produce_pass(d: Path, cur=cur, p=p) -> None:
                    say(f"{phase}: pass {p.name}")
                    r = pipeline.run_pipeline(cur, [p], phase)[0]
                    ir.save(cur, d / "graph.onnx", external_data="graph.data")
                    (d / "record.json").write_text(json.dumps(r.to_dict()))

                entry, hit = cache.get_or_create("pass", key, produce_pass)
                hits.setdefault("pass", []).append(hit)
                rec = json.loads((entry / "record.json").read_text())
                rec["cached"] = hit
                m = ir.load(entry / "graph.onnx")
                attach_functions(m)
                if p.name == "quantize" and rec.get("modified"):  # issue 5: the cache signature changed
                    from kimi_compile.accuracy import rebase_feeds

                    quantized[phase] = ir.load(entry / "graph.onnx")
                    attach_functions(quantized[phase])
                    if verify:  # later passes are checked against the quantized graph on feeds of its signature
                        feeds[phase] = rebase_feeds(m, feeds[phase], rebased_prefill)
                        got = ort_run(m, feeds[phase])
                        err = compare({"logits": got["logits"]}, {"logits": expected[phase]["logits"]}, feeds[phase])
                        verify_log.append({"phase": phase, "after": p.name, "rel_err": err, "rebased": True,
                                           "note": "quantization error vs the fp32 reference (not checked); later "
                                                   "passes are compared with this graph"})
                        expected[phase] = got
                        rebased_prefill = got if phase == "prefill" else rebased_prefill
                        pass_log.append(rec)
                        continue
                if verify:
                    err = compare(ort_run(m, feeds[phase]), expected[phase], feeds[phase])
                    verify_log.append({"phase": phase, "after": p.name, "rel_err": err})
                    if err > recipe.verify.tolerance:
                        raise BuildError(f"--verify: pass {p.name!r} broke the {phase} graph (rel err {err:.2e} > "
                                         f"{recipe.verify.tolerance:.0e}); the graph before it was within tolerance")
                pass_log.append(rec)
            graphs[phase] = m
            final_keys[phase] = key

        backend_key = cache_key(stage="backend", graphs=final_keys, backend=recipe.backend.name,
                                version=backend.version(), build_version=backend.BUILD_VERSION,
                                options=recipe.backend.options, target=recipe.target,
                                export=dataclasses.asdict(recipe.export))

        def produce_backend(d: Path) -> None:
            say(f"backend {recipe.backend.name}: writing engines")
            rec = backend.build(graphs, d, {**recipe.backend.options, "_build": {
                "target": recipe.target, "export": dataclasses.asdict(recipe.export)}})
            (d / "record.json").write_text(json.dumps(rec))

        entry, hit = cache.get_or_create("backend", backend_key, produce_backend)
        hits.setdefault("backend", []).append(hit)
        brec = json.loads((entry / "record.json").read_text())
        shared = brec.pop("_shared_initializers", 0)
        trt_info = brec.pop("_trt", None)

        out_dir = Path(out_dir)
        with ArtifactWriter(out_dir) as w:
            for f in sorted(entry.rglob("*")):
                rel = f.relative_to(entry).as_posix()
                if f.is_file() and rel.startswith(("graphs/", "engines/")):
                    w.add_file(rel, src_path=f, link_ok=False)
            graph_info = {}
            for phase, g in brec.items():
                hist: dict[str, int] = {}
                for n in graphs[phase].graph:
                    k = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
                    hist[k] = hist.get(k, 0) + 1
                graph_info[phase] = {**g, **signature(graphs[phase]), "node_count": len(graphs[phase].graph),
                                     "op_histogram": dict(sorted(hist.items(), key=lambda kv: -kv[1]))}
            layouts = cache_layouts(cfg, opts.block_size, graphs["prefill"])  # issue 5: as the passes left them
            accuracy = None
            if recipe.precision and quantized:  # issue 5: quantized vs unquantized on a fixed prompt set
                from kimi_compile.accuracy import evaluate

                say("accuracy report: quantized vs unquantized")
                for t in traced.values():
                    attach_functions(t)
                accuracy = evaluate(traced, quantized, cfg, opts.block_size)
            w.manifest.update({
                "tool": {"name": "kimi-compile", "version": __version__},
                "versions": vers,
                "recipe": recipe.to_dict(),
                "model_config": cfg.to_dict(),
                "model_source": source,
                "backend": {"name": recipe.backend.name, "version": backend.version(), "target": recipe.target,
                            "shared_initializers": shared, **({"trt": trt_info} if trt_info else {})},
                "graphs": graph_info,
                "cache_layouts": layouts,
                "bytes_per_token": sum(c["bytes_per_token"] for c in layouts),
                "pass_log": pass_log,
                "precision_plan": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r
                                   for r in recipe.precision],
                "plugins": {o.qualified: o.version for o in ops.registered()},
                "op_coverage": {p: coverage(traced[p], graphs[p], cfg) for p in PHASES},
                "compile_cache": {k: {"hits": sum(v), "misses": len(v) - sum(v)} for k, v in hits.items()},
                "verify": verify_log,
                **({"accuracy": accuracy} if accuracy is not None else {}),
                "build_seconds": round(time.perf_counter() - t_start, 2),
                "runtime": {"block_size": opts.block_size, "vocab_size": cfg.vocab_size,
                            "eos_token_id": cfg.eos_token_id, "max_seq_len": recipe.export.max_seq_len,
                            "caches": [{"name": c["name"], "shape": c["shape"], "dtype": c["dtype"]}
                                       for c in layouts]},
            })
            w.commit()
            manifest = dict(w.manifest)
    return BuildResult(out_dir, manifest, {k: {"hits": sum(v), "misses": len(v) - sum(v)} for k, v in hits.items()})
