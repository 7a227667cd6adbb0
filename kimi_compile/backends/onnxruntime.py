"""ONNX Runtime backend (CPU by default; CUDA through onnxruntime-gpu's execution provider).

build: the graphs as ONNX with shared external weights (backends/serialize.py); the files do not depend on the
provider. load: one InferenceSession per phase on the providers asked for (recipe `backend.options.providers`, or
`load(..., providers=[...])` / `kimi-compile run --providers cuda,cpu`), in order of preference. A provider this
onnxruntime does not have (CUDA without the onnxruntime-gpu package, or its CUDA libraries missing) is dropped with
a note saying why and what to install, and the session runs on the CPU; `Executor.providers` is what it runs on,
`Executor.notes` what was dropped. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from kimi_compile.backends.serialize import write_graphs

NAME = "onnxruntime"
BUILD_VERSION = 3  # bump when the files build() writes change (part of the cache key)
PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
# fp32 graphs stay fp32 on the GPU: the CUDA provider's default TF32 matmuls gave kimi-k3.1-tiny prefill logits 2.6e-2
# from the CPU provider's on the H200 (and other greedy tokens); bench/results/ort_gpu_2026-12-04.json
PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"use_tf32": "0"}}

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Options:
    """backend.options of an onnxruntime recipe."""

    providers: tuple[str, ...] = ("cpu",)  # in order of preference: cuda, cpu


def options(raw: dict | None, source: str = "recipe") -> Options:
    from kimi_compile.recipe import RecipeError, coerce_options

    opts = coerce_options(Options, {k: v for k, v in (raw or {}).items() if not k.startswith("_")},
                          "backend.options", source)
    providers = tuple(opts.providers)
    bad = [p for p in providers if p not in PROVIDERS]
    if bad or not providers:
        raise RecipeError(source, "backend.options.providers",
                          f"expected a non-empty list of {', '.join(PROVIDERS)}, got {list(providers)}")
    return dataclasses.replace(opts, providers=providers)


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("onnxruntime")


def build(graphs: dict, out_dir: Path, options_: dict | None = None) -> dict[str, Any]:
    """Serialize the optimized graphs with shared external weights; returns {phase: {"file": rel_path}}."""
    options(options_)  # refuse bad options at build time, not at load
    ranks = sorted(p for p in graphs if ".rank" in p)
    if ranks:
        raise ValueError(_PARTITIONED.format(what=f"graphs {', '.join(ranks)} are partitioned"))
    return write_graphs(graphs, out_dir)


_PARTITIONED = ("onnxruntime backend: {what} (one graph per rank, with collectives); ONNX Runtime runs one rank. "
                "Partitioned artifacts run on the cuda backend over torch.distributed (backend.name: cuda; "
                "torchrun --nproc-per-node N -m kimi_compile run ARTIFACT)")


def resolve_providers(wanted: list[str] | tuple[str, ...], available: list[str]) -> tuple[list[str], list[str]]:
    """(ONNX Runtime provider names to use, notes on what was dropped). CPU always closes the list."""
    use, notes = [], []
    for p in wanted:
        name = PROVIDERS.get(p)
        if name is None:
            raise ValueError(f"providers: unknown provider {p!r}; expected {', '.join(PROVIDERS)}")
        if name in available:
            if name not in use:
                use.append(name)
        elif p == "cuda":
            notes.append("CUDA execution provider unavailable: this onnxruntime has only "
                         f"{', '.join(available)}; install onnxruntime-gpu (in place of onnxruntime) on a machine "
                         "with CUDA to run on the GPU. Running on the CPU.")
    if PROVIDERS["cpu"] not in use:
        use.append(PROVIDERS["cpu"])
    return use, notes


class Executor:
    """Runs a phase graph: `run(phase, feeds) -> {output_name: array}`."""

    def __init__(self, artifact_dir: Path, graphs: dict, threads: int | None = None,
                 providers: list[str] | tuple[str, ...] = ("cpu",)):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        so.log_severity_level = 3
        use, self.notes = resolve_providers(providers, ort.get_available_providers())
        if "CUDAExecutionProvider" in use and hasattr(ort, "preload_dlls"):
            try:  # the CUDA and cuDNN libraries of the nvidia-* wheels (as torch installs them), when present
                ort.preload_dlls()
            except Exception as e:  # noqa: BLE001  (then the provider's own loader says what is missing)
                self.notes.append(f"onnxruntime.preload_dlls failed ({type(e).__name__}: {e})")
        self.sessions = {}
        for phase, g in graphs.items():
            self.sessions[phase] = ort.InferenceSession(str(Path(artifact_dir) / g["file"]), so,
                                                        providers=[(p, PROVIDER_OPTIONS.get(p, {})) for p in use])
        self.providers = list(next(iter(self.sessions.values())).get_providers()) if self.sessions else use
        if "CUDAExecutionProvider" in use and "CUDAExecutionProvider" not in self.providers:
            self.notes.append("onnxruntime-gpu is installed but could not start its CUDA execution provider (CUDA "
                              "or cuDNN libraries missing, or no GPU); running on the CPU")
        for note in self.notes:
            log.warning("%s", note)
        self.output_names = {p: [o.name for o in s.get_outputs()] for p, s in self.sessions.items()}

    def run(self, phase: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.sessions[phase].run(None, feeds)
        return dict(zip(self.output_names[phase], outs))


def load(artifact_dir: Path, manifest: dict, providers: list[str] | None = None, **kwargs) -> Executor:
    """`providers` overrides the recipe's backend.options.providers."""
    world = int((manifest.get("parallel") or {}).get("world", 1))
    if world > 1:
        raise ValueError(_PARTITIONED.format(what=f"{artifact_dir} is partitioned for {world} ranks"))
    if providers is None:
        providers = list(options(manifest.get("recipe", {}).get("backend", {}).get("options"),
                                 str(artifact_dir)).providers)
    return Executor(artifact_dir, manifest["graphs"], providers=providers, **kwargs)
