"""`kimi-compile build`: recipe -> model -> trace -> passes -> backend -> verified artifact, every stage cached.

    build(recipe, out) = load the model source, trace (cached), run the pipeline (kimi_compile.pipeline: every pass
    cached, verified and optionally checked against the reference), lower with the backend (cached), write the
    artifact (manifest + files + reports, atomically).

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

from kimi_compile import __version__, graph_io, ops
from kimi_compile.artifact import ArtifactWriter, check_out_dir
from kimi_compile.cache import CompileCache, cache_key
from kimi_compile.coverage import coverage, stream_layers
from kimi_compile.events import BuildEvents
from kimi_compile.functions import attach_functions
from kimi_compile.recipe import Recipe
from kimi_compile.report import REPORTS, summary
from kimi_compile.tokenizer import ARTIFACT_DIR as TOKENIZER_DIR, TOKENIZER_FILES, describe as describe_tokenizer
from kimi_compile.trace_spec import PHASES, TraceOptions, cache_layouts, signature

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
        if f.suffix in (".json", ".safetensors") and f.name not in TOKENIZER_FILES:  # the weights and config only
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


# ---- the build ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BuildResult:
    artifact: Path
    manifest: dict
    cache_hits: dict


class ModelSource:
    """The recipe's model: its config at once; its weights (the reference model) only when a stage needs them."""

    def __init__(self, recipe: Recipe, workdir: Path, say: Callable[[str], None]):
        from kimi_compile.config import from_hf_dict, load_config, preset_hf_dict

        self.recipe, self.workdir, self.say = recipe, workdir, say
        self.fingerprint, self.description = model_source(recipe)
        self.config = load_config(recipe.model.checkpoint) if recipe.model.checkpoint else \
            from_hf_dict(preset_hf_dict(recipe.model.preset))
        self._model = None

    def model(self):
        if self._model is None:
            self.say("loading model weights")
            self._model = load_model(self.recipe, self.workdir)
        return self._model


def trace_options(recipe: Recipe) -> TraceOptions:
    """The trace's options: the cache page size from the recipe; the KDA chunk (the chunked form's block, 64, as in
    the kernels) is not the prefill chunk (export.prefill_chunk: tokens per prefill step, a runtime setting)."""
    return TraceOptions(block_size=recipe.export.block_size)


def build(recipe: Recipe, out_dir: str | Path, *, verify: bool = False, cache: CompileCache | None = None,
          progress: Callable[[str], None] | None = None, events: BuildEvents | None = None) -> BuildResult:
    """`events` receives a start and an end record per stage (kimi_compile.events); `progress(label)` is the plain
    form: called with each stage's and step's label."""
    from kimi_compile import backends, pipeline
    from kimi_compile.verify import Verifier

    ev = events or BuildEvents()
    if progress is not None:
        ev.sinks.append(lambda rec: progress(rec["label"]) if rec["event"] in ("start", "note") else None)
    ev.sinks.append(_log_sink)
    say = ev.note
    out_state = check_out_dir(out_dir)  # refuse a non-artifact --out before any work
    cache = cache or CompileCache()
    t_start = time.perf_counter()
    backend = backends.get(recipe.backend.name)
    passes = pipeline.resolve(recipe)
    opts = trace_options(recipe)
    with tempfile.TemporaryDirectory(prefix="kimi-build-") as work, cache.pinned():
        src = ModelSource(recipe, Path(work), say)
        _check_parallel(recipe, src.config)
        with ev.stage("trace", "prefill and decode graphs") as info:
            traced, trace_key, trace_hit = _trace_stage(src, opts, cache, say)
            info["cached"] = trace_hit
        check = None
        if verify:
            with ev.stage("reference", "reference outputs for --verify"):
                check = Verifier(src.model(), opts, recipe.verify.tolerance, run=getattr(backend, "run_graph", None))
        with ev.stage("passes", f"{len(passes)} passes x {len(PHASES)} phases" + (", each verified" if verify else "")) \
                as info:
            result = pipeline.run({p: m.clone() for p, m in traced.items()}, passes, cache=cache,
                                  keys=dict.fromkeys(PHASES, trace_key), check=check, say=say)
            info["cached"] = all(result.cache_hits)
        with ev.stage("backend", f"{recipe.backend.name} for {recipe.target}") as info:
            entry, record, backend_hit = _backend_stage(backend, recipe, result, cache, say)
            info["cached"] = backend_hit
        hits = {"trace": [trace_hit], "pass": result.cache_hits, "backend": [backend_hit]}
        stats = {k: {"hits": sum(v), "misses": len(v) - sum(v)} for k, v in hits.items()}
        accuracy = None
        if recipe.precision and result.rebased and recipe.verify.accuracy:
            from kimi_compile.accuracy import evaluate

            with ev.stage("accuracy", "quantized vs unquantized"):
                accuracy = evaluate(traced, result.rebased, src.config, opts.block_size)
        with ev.stage("artifact", f"writing {out_dir}"), \
                ArtifactWriter(Path(out_dir), reports=REPORTS, expect=out_state) as w:
            for f in sorted(entry.rglob("*")):
                rel = f.relative_to(entry).as_posix()
                if f.is_file() and rel.startswith(("graphs/", "engines/")):
                    w.add_file(rel, src_path=f, link_ok=False)
            tok = _add_tokenizer(w, recipe)
            w.manifest.update(_manifest(recipe, src, backend, record, traced, result, stats, accuracy, opts,
                                        round(time.perf_counter() - t_start, 2)))
            w.manifest["stages"] = list(ev.stages)
            if tok:
                w.manifest["tokenizer"] = tok
            w.manifest["summary"] = summary(w.manifest)
            w.commit()
            manifest = dict(w.manifest)
    return BuildResult(Path(out_dir), manifest, stats)


def _check_parallel(recipe: Recipe, cfg) -> None:
    """The parallel layout against the model's sizes (presets are checked when the recipe is read; a checkpoint's
    config only now)."""
    from kimi_compile.recipe import RecipeError, parallel_problems

    if recipe.parallel.world > 1:
        for key, msg in parallel_problems(cfg, recipe.parallel):
            raise RecipeError(recipe.source, key, f"{msg} ({_model_name(recipe)})")


def _model_name(recipe: Recipe) -> str:
    return f"checkpoint {recipe.model.checkpoint}" if recipe.model.checkpoint else f"preset {recipe.model.preset}"


def _log_sink(rec: dict) -> None:
    if rec["event"] in ("start", "note"):
        log.info("%s: %s", rec["stage"], rec["label"])


def _add_tokenizer(w: ArtifactWriter, recipe: Recipe) -> dict | None:
    """Copies the checkpoint's tokenizer files into the artifact (kimi_compile.tokenizer); their description."""
    if not recipe.model.checkpoint:
        return None
    root = Path(recipe.model.checkpoint)
    info = describe_tokenizer(root)
    if info is not None:
        for name in info["files"]:
            w.add_file(f"{TOKENIZER_DIR}/{name}", src_path=root / name, link_ok=False)
    return info


def _trace_stage(src: ModelSource, opts: TraceOptions, cache: CompileCache, say) -> tuple[dict, str, bool]:
    """The traced prefill and decode graphs (functions attached), their cache key and whether the cache hit."""
    vers = versions()
    key = cache_key(stage="trace", config=src.config.to_dict(), weights=src.fingerprint,
                    options=dataclasses.asdict(opts), torch=vers["torch"], onnx=vers["onnx"],
                    onnxscript=vers["onnxscript"], onnx_ir=vers["onnx_ir"], kimi_compile=__version__)

    def produce(d: Path) -> None:
        from kimi_compile.trace import trace

        model = src.model()
        say("tracing prefill and decode graphs")
        graph_io.save(trace(model, opts), d)  # one copy of the weights for both phases

    entry, hit = cache.get_or_create("trace", key, produce)
    graphs = {p: graph_io.load(entry, p) for p in PHASES}
    for m in graphs.values():
        attach_functions(m)
    return graphs, key, hit


def _backend_stage(backend, recipe: Recipe, result, cache: CompileCache, say) -> tuple[Path, dict, bool]:
    key = cache_key(stage="backend", graphs=result.keys, backend=recipe.backend.name, version=backend.version(),
                    build_version=backend.BUILD_VERSION, options=recipe.backend.options, target=recipe.target,
                    export=dataclasses.asdict(recipe.export),
                    tables=getattr(backend, "tables_fingerprint", lambda: "")())

    def produce(d: Path) -> None:
        say(f"backend {recipe.backend.name}: lowering")
        rec = backend.build(result.graphs, d, {**recipe.backend.options, "_build": {
            "target": recipe.target, "export": dataclasses.asdict(recipe.export)}})
        (d / "record.json").write_text(json.dumps(rec))

    entry, hit = cache.get_or_create("backend", key, produce)
    return entry, json.loads((entry / "record.json").read_text()), hit


def _manifest(recipe, src, backend, record, traced, result, stats, accuracy, opts, seconds) -> dict:
    """The manifest sections the build fills (DESIGN.md §3 "Artifact"); the writer adds files and the schema."""
    graphs, cfg = result.graphs, src.config
    extra = {k[1:]: v for k, v in record.items() if k.startswith("_")}  # backend-wide facts (`_name` keys)
    graph_info = {}
    for phase, rec in ((k, v) for k, v in record.items() if not k.startswith("_")):
        hist: dict[str, int] = {}
        for n in graphs[phase].graph:
            k = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
            hist[k] = hist.get(k, 0) + 1
        graph_info[phase] = {**rec, **signature(graphs[phase]), "node_count": len(graphs[phase].graph),
                             "op_histogram": dict(sorted(hist.items(), key=lambda kv: -kv[1])),
                             # plans passes leave on the graph (JSON in "kimi.*_plan" metadata: the stream plan, ...)
                             **{k[len("kimi."):]: json.loads(v) for k, v in graphs[phase].metadata_props.items()
                                if k.startswith("kimi.") and k.endswith("_plan")}}
    for phase, info in graph_info.items():
        if isinstance(info.get("stream_plan"), dict):  # the plan per decoder layer (report: Gantt per layer kind)
            info["stream_plan"]["layers"] = stream_layers(graphs[phase], info["stream_plan"], cfg)
    layouts = cache_layouts(cfg, opts.block_size, _first_rank(graphs, "prefill"))  # a rank's caches (its heads)
    return {
        "tool": {"name": "kimi-compile", "version": __version__},
        "versions": versions(),
        "recipe": recipe.to_dict(),
        "model_config": cfg.to_dict(),
        "model_source": src.description,
        "backend": {"name": recipe.backend.name, "version": backend.version(), "target": recipe.target, **extra},
        "graphs": graph_info,
        "cache_layouts": layouts,
        "bytes_per_token": sum(c["bytes_per_token"] for c in layouts),
        "pass_log": [r.to_dict() for r in result.records],
        "precision_plan": [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in recipe.precision],
        "plugins": {o.qualified: o.version for o in ops.registered()},
        "op_coverage": {p: coverage(traced[p], _first_rank(graphs, p), cfg) for p in PHASES},
        "compile_cache": stats,
        "verify": result.verify_log,
        **({"accuracy": accuracy} if accuracy is not None else {}),
        "build_seconds": seconds,
        "runtime": {"block_size": opts.block_size, "vocab_size": cfg.vocab_size,
                    "eos_token_id": cfg.eos_token_id, "max_seq_len": recipe.export.max_seq_len,
                    "max_batch": recipe.export.max_batch, "prefill_chunk": recipe.export.prefill_chunk,
                    "caches": [{"name": c["name"], "shape": c["shape"], "dtype": c["dtype"]} for c in layouts]},
        **({"parallel": _parallel(recipe, graphs, record, cfg)} if recipe.parallel.world > 1 else {}),
    }


def _first_rank(graphs: dict, phase: str):
    """The phase graph, or rank 0's copy of it in a partitioned build (`<phase>.rank0`)."""
    return graphs[phase] if phase in graphs else graphs[f"{phase}.rank0"]


def _parallel(recipe: Recipe, graphs: dict, record: dict, cfg) -> dict:
    """The parallel layout of a partitioned artifact (DESIGN.md §3 "Parallelism"): ranks, their process groups,
    each rank's graphs and weights file with the bytes it holds (sharded: its slices; replicated: whole tensors
    every rank keeps), how to launch it, and with cp > 1 the prefill balance of the model under each layout."""
    p = recipe.parallel
    ranks = []
    for r in range(p.world):
        own = {ph: f"{ph}.rank{r}" for ph in PHASES}
        weights = record[own["prefill"]]["weights"]  # the backend counted what it wrote (backends/serialize.py)
        ranks.append({"rank": r, "graphs": own, "weights": weights,
                      "weight_bytes": record["_weight_bytes"][Path(weights).name]})
    groups = {"tp": [list(range(c * p.tp, (c + 1) * p.tp)) for c in range(p.cp)]}
    if p.cp > 1:  # context parallel: the ranks holding one model's pieces of a sequence (one group per tp index)
        groups["cp"] = [[t + c * p.tp for c in range(p.cp)] for t in range(p.tp)]
    out = {"tp": p.tp, "ep": p.ep, "cp": p.cp, "cp_layout": p.cp_layout, "sequence_parallel": p.sequence_parallel,
           "world": p.world, "groups": groups, "ranks": ranks,
           "launch": f"torchrun --nproc-per-node {p.world} -m kimi_compile run ARTIFACT --prompt-ids ..."}
    if p.cp > 1:
        from kimi_compile.cp_layout import balance_table

        out["cp_balance"] = {"model": "per-rank indexer + attention FLOPs of one sequence under the causal mask "
                                      "(kimi_compile/cp_layout.py: a token-count model of the graphs' dominant "
                                      "terms, not a measurement)",
                             "rows": balance_table(cfg, worlds=sorted({2, 4, 8, p.cp}))}
    return out
