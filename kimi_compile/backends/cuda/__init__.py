"""The cuda backend: the optimized graphs run as a static program of torch calls and our kernels (program.py), with
a static memory plan (memory.py), caches on the device updated in place, and decode steps replayed as CUDA graphs
per batch-size bucket (graphs.py).

build: the same ONNX files as the onnxruntime backend (backends/serialize.py) plus, per phase, the GPU op coverage
(which kimi.* nodes run a kernel and which fall back to their reference, with the reason). load: an `Executor` on
`device` (default cuda when torch sees a GPU, else cpu: the same executor on CPU tensors, kimi.* ops through their
references or torch-composed kernels, so CI tests the lowering, the plan and the numerics without a GPU).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from kimi_compile.backends.serialize import write_graphs

NAME = "cuda"
BUILD_VERSION = 4  # bump when what build() writes changes (part of the cache key)


@dataclasses.dataclass(frozen=True)
class Options:
    """Recipe `backend.options` of the cuda backend."""

    graphs: bool = True  # replay steps as CUDA graphs (on a GPU)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # decode batches are padded up to one of these
    prefill_graphs: bool = False  # capture prefill chunks too (one graph per chunk shape)
    streams: bool = True  # replay the assign_streams plan on side streams (false: every step on the main stream)

    def __post_init__(self):
        b = self.batch_buckets
        if not b or any(x < 1 for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"batch_buckets must be increasing positive ints, got {list(b)}")


def options(raw: dict | None, source: str = "recipe") -> Options:
    from kimi_compile.recipe import coerce_options

    return coerce_options(Options, {k: v for k, v in (raw or {}).items() if not k.startswith("_")},
                          "backend.options", source)


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("torch")


def tables_fingerprint() -> str:
    """What the kernel tables offer (op -> kernel chain): part of the backend stage's cache key, since the build
    records the GPU coverage they give."""
    from kimi_compile import ops

    chains = []
    for op, k in sorted(ops.kernels("CUDA").items()):
        names = []
        while k is not None:
            names.append(f"{k.name}@{'/'.join(k.devices)}")
            k = k.fallback
        chains.append(f"{op}:{'>'.join(names)}")
    return ";".join(chains)


def memory_plans(graphs: dict, export: dict, opts: Options) -> dict[str, dict[str, dict]]:
    """The static memory plan's size per phase and input shape, computed at build time by running each graph on
    meta tensors (shapes only; kernels' torch forms): decode at every batch bucket (the artifact's full context
    capacity, as the runtime allocates it with graphs on), prefill at one sequence of export.prefill_chunk tokens.
    {phase: {shape: {peak_bytes, lower_bound_bytes, buffers, without_reuse_bytes}}}."""
    import torch

    from kimi_compile.backends.cuda.onnx_ops import torch_dtype
    from kimi_compile.backends.cuda.program import Program

    mb = -(-int(export["max_seq_len"]) // int(export["block_size"]))
    cases = {"decode": [(b, 1) for b in opts.batch_buckets if b <= int(export["max_batch"])] or [(1, 1)],
             "prefill": [(1, int(export["prefill_chunk"]))]}
    out: dict[str, dict[str, dict]] = {}
    for phase, m in graphs.items():
        prog = Program(m, "meta", weights=False, kernel_device="cpu")
        for B, T in cases.get(phase.partition(".rank")[0], []):  # a rank's graph: its phase's cases
            dims = {"batch": B, "seq": T, "max_blocks": mb, "num_blocks": B * mb + 1}
            feeds = {v.name: torch.empty([d if isinstance(d, int) else dims[str(d)] for d in v.shape],
                                         dtype=torch_dtype(v.dtype), device="meta") for v in m.graph.inputs}
            prog.run(feeds)
            spec = prog._specs[prog.signature(feeds)]
            out.setdefault(phase, {})[f"{B}x{T}"] = spec.plan.summary()
    return out


def build(graphs: dict, out_dir: Path, opts: dict | None = None) -> dict[str, Any]:
    from kimi_compile.backends.cuda.program import Program

    o = options(opts)  # validated here too: a bad option fails the build, not the first run
    export = (opts or {}).get("_build", {}).get("export")
    plans = memory_plans(graphs, export, o) if export else {}

    from kimi_compile.lowering import target_capability

    cap = target_capability((opts or {}).get("_build", {}).get("target"))  # "sm90" -> (9, 0); "cuda": unknown
    coverage = {phase: Program(m, "meta", weights=False, kernel_device="cuda", capability=cap).coverage()
                for phase, m in graphs.items()}
    record = write_graphs(graphs, out_dir)
    record["_gpu_coverage"] = {phase: {"nodes": rows, "fallbacks": [r for r in rows if r["impl"] == "reference"]}
                               for phase, rows in coverage.items()}
    record["_memory_plan"] = plans
    return record


def run_graph(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One graph on CPU tensors (the verifier's runner for graphs ONNX Runtime cannot feed)."""
    import onnx_ir as ir
    import torch

    from kimi_compile.backends.cuda.program import Program, _to_torch, to_numpy

    cpu = torch.device("cpu")
    out = Program(model, "cpu").run({k: _to_torch(np.array(v), ir.DataType.from_numpy(np.asarray(v).dtype), cpu)
                                     for k, v in feeds.items()}, plan=False)
    return {k: to_numpy(v).astype(np.float32) if v.is_floating_point() else to_numpy(v) for k, v in out.items()}


class Executor:
    """Runs the artifact's phase graphs on one device: `run(phase, feeds) -> {output name: tensor}`. Caches are
    device tensors from `zeros()`; the graphs update them in place (the `<cache>.out` outputs are those tensors)."""

    def __init__(self, artifact_dir: Path, manifest: dict, device: str | None = None, plan: bool = True,
                 graphs: bool | None = None, rank: int | None = None, kernel_cache: bool = True):
        """`rank`: which rank's graphs a partitioned artifact runs here (manifest `parallel`; the ranks run together,
        each in its own process, over torch.distributed: backends/cuda/distributed.py). `kernel_cache`: on a GPU,
        install the kernels the artifact ships (`kimi-compile warm`; kernel_cache.py) into Triton's cache first;
        what it did is in `self.kernel_cache`."""
        import torch

        self.torch = torch
        self.dir = Path(artifact_dir)
        self.manifest = manifest
        world = int(manifest.get("parallel", {}).get("world", 1))
        if world > 1 and rank is None:
            raise ValueError(f"{artifact_dir} is partitioned for {world} ranks: load it with a rank, one process per "
                             f"rank (torchrun --nproc-per-node {world} -m kimi_compile run ...)")
        self.rank = rank if world > 1 else None
        self.options = options(manifest.get("recipe", {}).get("backend", {}).get("options"), str(artifact_dir))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.plan = plan
        self.graphs = (self.options.graphs if graphs is None else graphs) and self.device.type == "cuda"
        # shapes follow the capture setting at load: turning `graphs` off afterwards runs the same static-shape
        # program eagerly (like against like: same caches, same batch bucket, only the launch mode differs)
        self._static = self.graphs
        self._programs: dict[str, Any] = {}
        self._weights: dict[tuple, Any] = {}  # device weights shared by the phases' programs (Program weight_pool)
        self._streams = self.options.streams
        if self.device.type == "cuda":  # float32 graphs compute in float32 (no TF32 in GEMMs and convolutions)
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.kernel_cache = {"status": "off"}
        if kernel_cache and self.device.type == "cuda":
            self.kernel_cache = _install_kernels(self.dir)

    @property
    def streams(self) -> bool:
        """Replay the stream plan (the recipe's `streams` option); changing it rebuilds the programs on next use."""
        return self._streams

    @streams.setter
    def streams(self, value: bool) -> None:
        if bool(value) != self._streams:
            self._programs.clear()
        self._streams = bool(value)

    @property
    def static_shapes(self) -> bool:
        """With graphs, caches take the artifact's full capacity and batches their bucket: one capture serves
        every request of a bucket."""
        return self._static

    def batch_bucket(self, batch: int) -> int:
        if not self._static:
            return batch
        return next((b for b in self.options.batch_buckets if b >= batch), batch)

    def program(self, phase: str):
        if phase not in self._programs:
            import onnx_ir as ir

            from kimi_compile.backends.cuda.program import Program
            from kimi_compile.functions import attach_functions

            key = phase if self.rank is None else f"{phase}.rank{self.rank}"
            m = ir.load(self.dir / self.manifest["graphs"][key]["file"])
            attach_functions(m)
            self._programs[phase] = Program(m, self.device, streams=self.streams, weight_pool=self._weights)
        return self._programs[phase]

    def preload(self) -> None:
        """Build every phase's program now (its weights on the device) instead of at the phase's first run."""
        for phase in dict.fromkeys(k.partition(".rank")[0] for k in self.manifest.get("graphs", {})):
            self.program(phase)

    def zeros(self, shape, dtype: str):
        """A cache tensor on the device; `dtype` as the manifest names it (numpy / ml_dtypes names)."""
        import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy)
        import onnx_ir as ir

        from kimi_compile.backends.cuda.onnx_ops import torch_dtype

        dt = torch_dtype(ir.DataType.from_numpy(np.dtype(dtype)))
        return self.torch.zeros(tuple(shape), dtype=dt, device=self.device)

    def run(self, phase: str, feeds: dict) -> dict:
        torch = self.torch
        from kimi_compile.backends.cuda.program import _to_torch

        dev = {k: v.to(self.device) if isinstance(v, torch.Tensor) else
               _to_torch(np.asarray(v), None, self.device) for k, v in feeds.items()}
        if phase == "prefill" and int((self.manifest.get("parallel") or {}).get("cp", 1)) > 1:
            from kimi_compile.backends.cuda.context_parallel import run_prefill

            return run_prefill(self, dev)  # this rank's pieces of every sequence (docs/context_parallel.md)
        graphs = self.graphs and (phase == "decode" or self.options.prefill_graphs)
        T, pad = dev["input_ids"].shape[1], self._sequence_pad(phase, dev["input_ids"].shape[1])
        if pad:  # sequence parallel: the tokens split evenly over the ranks (extra rows are padding: lengths)
            dev["input_ids"] = torch.nn.functional.pad(dev["input_ids"], (0, pad))
        out = self.program(phase).run(dev, plan=self.plan, graphs=graphs)
        return {**out, "logits": out["logits"][:, :T]} if pad else out

    def _sequence_pad(self, phase: str, T: int) -> int:
        par = self.manifest.get("parallel") or {}
        if phase != "prefill" or not par.get("sequence_parallel"):
            return 0
        return -T % int(par["tp"])

    def stack(self, rows: list):
        return self.torch.stack(rows)

    def host(self, x) -> np.ndarray:
        from kimi_compile.backends.cuda.program import to_numpy

        return to_numpy(x) if isinstance(x, self.torch.Tensor) else np.asarray(x)


def _install_kernels(artifact_dir: Path) -> dict:
    """The artifact's compiled kernels into Triton's cache; a broken kernel cache only costs compile time, so it
    warns (naming the file) and the kernels compile on first use."""
    import logging

    from kimi_compile.backends.cuda.kernel_cache import install_for_triton

    try:
        return install_for_triton(artifact_dir)
    except ImportError as e:  # torch without triton: the program's kernels fall back to their torch forms
        return {"status": "no triton", "error": str(e)}
    except Exception as e:  # noqa: BLE001 (a broken kernel cache: serving goes on, the kernels compile)
        logging.getLogger(__name__).warning("kernel cache of %s not installed (%s: %s); kernels compile on first use",
                                            artifact_dir, type(e).__name__, e)
        return {"status": "error", "error": str(e)}


def load(artifact_dir: Path, manifest: dict, threads: int | None = None, device: str | None = None, **kw) -> Executor:
    """The runtime's entry: an Executor with every phase's program built (weights read onto the device) here, so
    that loading is the slow step and a first request pays only what its shapes need."""
    ex = Executor(artifact_dir, manifest, device=device, **kw)
    ex.preload()
    return ex


def init_distributed(manifest: dict) -> dict:
    """For a partitioned artifact: join its process group (backends/cuda/distributed.py); the executor options of
    this process's rank ({"rank", "device"})."""
    from kimi_compile.backends.cuda.distributed import init

    rank, device = init(manifest)
    return {"rank": rank, "device": device}
