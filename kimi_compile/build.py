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
from kimi_compile.artifact import ArtifactWriter
from kimi_compile.cache import CompileCache, cache_key
from kimi_compile.coverage import coverage
from kimi_compile.functions import attach_functions
from kimi_compile.recipe import Recipe
from kimi_compile.report import REPORTS
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
          progress: Callable[[str], None] | None = None) -> BuildResult:
    from kimi_compile import backends, pipeline
    from kimi_compile.verify import Verifier

    say = progress or (lambda msg: log.info(msg))
    cache = cache or CompileCache()
    t_start = time.perf_counter()
    backend = backends.get(recipe.backend.name)
    passes = pipeline.resolve(recipe)
    opts = trace_options(recipe)
    with tempfile.TemporaryDirectory(prefix="kimi-build-") as work:
        src = ModelSource(recipe, Path(work), say)
        traced, trace_key, trace_hit = _trace_stage(src, opts, cache, say)
        check = Verifier(src.model(), opts, recipe.verify.tolerance, run=getattr(backend, "run_graph", None)) \
            if verify else None
        result = pipeline.run({p: m.clone() for p, m in traced.items()}, passes, cache=cache,
                              keys=dict.fromkeys(PHASES, trace_key), check=check, say=say)
        entry, record, backend_hit = _backend_stage(backend, recipe, result, cache, say)
        hits = {"trace": [trace_hit], "pass": result.cache_hits, "backend": [backend_hit]}
        stats = {k: {"hits": sum(v), "misses": len(v) - sum(v)} for k, v in hits.items()}
        accuracy = None
        if recipe.precision and result.rebased and recipe.verify.accuracy:
            from kimi_compile.accuracy import evaluate

            say("accuracy report: quantized vs unquantized")
            accuracy = evaluate(traced, result.rebased, src.config, opts.block_size)
        with ArtifactWriter(Path(out_dir), reports=REPORTS) as w:
            for f in sorted(entry.rglob("*")):
                rel = f.relative_to(entry).as_posix()
                if f.is_file() and rel.startswith(("graphs/", "engines/")):
                    w.add_file(rel, src_path=f, link_ok=False)
            w.manifest.update(_manifest(recipe, src, backend, record, traced, result, stats, accuracy, opts,
                                        round(time.perf_counter() - t_start, 2)))
            w.commit()
            manifest = dict(w.manifest)
    return BuildResult(Path(out_dir), manifest, stats)


def _trace_stage(src: ModelSource, opts: TraceOptions, cache: CompileCache, say) -> tuple[dict, str, bool]:
    """The traced prefill and decode graphs (functions attached), their cache key and whether the cache hit."""
    vers = versions()
    key = cache_key(stage="trace", config=src.config.to_dict(), weights=src.fingerprint,
                    options=dataclasses.asdict(opts), torch=vers["torch"], onnx=vers["onnx"],
                    onnxscript=vers["onnxscript"], onnx_ir=vers["onnx_ir"], kimi_compile=__version__)

    def produce(d: Path) -> None:
        from kimi_compile.trace import trace

        say("tracing prefill and decode graphs")
        graph_io.save(trace(src.model(), opts), d)  # one copy of the weights for both phases

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
                             "op_histogram": dict(sorted(hist.items(), key=lambda kv: -kv[1]))}
    layouts = cache_layouts(cfg, opts.block_size, graphs["prefill"])
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
        "op_coverage": {p: coverage(traced[p], graphs[p], cfg) for p in PHASES},
        "compile_cache": stats,
        "verify": result.verify_log,
        **({"accuracy": accuracy} if accuracy is not None else {}),
        "build_seconds": seconds,
        "runtime": {"block_size": opts.block_size, "vocab_size": cfg.vocab_size,
                    "eos_token_id": cfg.eos_token_id, "max_seq_len": recipe.export.max_seq_len,
                    "max_batch": recipe.export.max_batch, "prefill_chunk": recipe.export.prefill_chunk,
                    "caches": [{"name": c["name"], "shape": c["shape"], "dtype": c["dtype"]} for c in layouts]},
    }
