"""TensorRT backend: optimized ONNX per phase -> serialized TensorRT engines, built ahead of time.

Two flavours, whichever is installed (recipe `backend.options.flavour` picks one; `auto` prefers `tensorrt`):
    tensorrt       NVIDIA TensorRT (datacenter GPUs): builds for the GPU of the build machine; needs that GPU.
    tensorrt_rtx   TensorRT for RTX: builds CPU-only for the compute capabilities named by the recipe target (sm75,
                   sm80, sm86, sm89, sm120, sm121). Its runtime runs them on those GPUs only: it refuses the H200
                   (compute capability 9.0), so on our machines engines are built and inspected, never executed.

build(graphs, out_dir, options) per phase:
    1. write the graph with external weights into a scratch dir;
    2. lower every kimi.* node per op and flavour (lowering.py: the op folder's tensorrt.py; native layers from the
       inlined ONNX body, or a `kimi::<Op>` plugin when one is registered);
    3. parse with the TensorRT ONNX parser into a strongly typed network; an error names the ONNX node, its op and
       the kimi node it came from;
    4. one optimization profile: batch 1..export.max_batch, prefill T 2..export.max_seq_len, max_blocks up to
       ceil(max_seq_len / block_size), num_blocks up to max_batch * max_blocks + 1; decode T = 1;
    5. builder options from the recipe; the timing cache (tensorrt only: tensorrt_rtx's timing-cache calls are
       no-ops) is written into the backend stage directory of the compile cache, next to the engines;
    6. serialize engines/<phase>.engine; the record names flavour, version, compute capabilities, the lowering of
       every kimi node, the engine's I/O tensors with their profile ranges and byte sizes, and its layers (engine
       inspector JSON when the engine deserializes here, else the builder's own layer report from its verbose log,
       written to engines/<phase>.layers.json).

The recipe context (target and export section) comes in `options["_build"]`; kimi_compile.build passes it.
Imports tensorrt lazily: without it, `version()` and `build()` raise BackendError naming the extra to install.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from kimi_compile.backends import BackendError
from kimi_compile.backends.tensorrt import lowering as tl

NAME = "tensorrt"
_BASE_BUILD_VERSION = 1  # bump when the files build() writes change
FLAVOURS = ("tensorrt", "tensorrt_rtx")
EXTRAS = {"tensorrt_rtx": "tensorrt-rtx", "tensorrt": "tensorrt"}
INSTALL_HINT = ("pip install 'kimi-compile[tensorrt-rtx]' (CPU-only ahead-of-time engine builds for RTX GPUs) or "
                "pip install 'kimi-compile[tensorrt]' (NVIDIA TensorRT; builds on the target GPU)")
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
PREFILL_MIN_T = 2  # the runtime pads prefill to T >= 2 (runtime/session.py)


@dataclasses.dataclass(frozen=True)
class TensorRTOptions:
    """recipe `backend.options` for tensorrt."""

    flavour: Literal["auto", "tensorrt", "tensorrt_rtx"] = "auto"
    extra_targets: list[str] = dataclasses.field(default_factory=list)  # more compute capabilities (tensorrt_rtx)
    optimization_level: int = dataclasses.field(default=3, metadata={"min": 0, "max": 5})
    workspace_mb: int = dataclasses.field(default=0, metadata={"min": 0})  # 0 = TensorRT's default
    opt_batch: int = dataclasses.field(default=1, metadata={"positive": True})
    opt_seq_len: int = dataclasses.field(default=64, metadata={"positive": True})
    lowering: dict = dataclasses.field(default_factory=dict)  # {Op: native|plugin} overrides the op tables
    layer_report: bool = True  # collect the engine's layers from the builder's verbose log


def _parse_options(options: dict | None) -> TensorRTOptions:
    from kimi_compile.recipe import coerce_options

    opts = {k: v for k, v in (options or {}).items() if not k.startswith("_")}
    return coerce_options(TensorRTOptions, opts, "backend.options", "recipe")


# ---- flavour -------------------------------------------------------------------------------------------------------


def _try_import(flavour: str):
    try:
        trt = importlib.import_module(flavour)
        trt.Builder  # noqa: B018  (the PyPI `tensorrt` stub imports but has no bindings)
        return trt
    except Exception:  # noqa: BLE001  ImportError, or a stub failing in its own way
        return None


def load_trt(flavour: str = "auto"):
    """(module, flavour) of the TensorRT to use; BackendError naming the extra when none is importable."""
    order = FLAVOURS if flavour == "auto" else (flavour,)
    for f in order:
        trt = _try_import(f)
        if trt is not None:
            return trt, f
    if flavour == "auto":
        raise BackendError(f"backend tensorrt: neither tensorrt nor tensorrt_rtx is importable; {INSTALL_HINT}")
    raise BackendError(f"backend tensorrt: backend.options.flavour is {flavour!r} but {flavour} is not importable; "
                       f"pip install 'kimi-compile[{EXTRAS[flavour]}]'")


def version() -> str:
    """`<flavour> <version>` of the TensorRT `auto` picks (the recipe's flavour option is in the cache key too)."""
    trt, flavour = load_trt("auto")
    return f"{flavour} {trt.__version__}"


def __getattr__(name: str):  # BUILD_VERSION: the base version + the lowering tables, so a lowering change misses
    if name == "BUILD_VERSION":
        tables = {f: tl.table_fingerprint(f) for f in FLAVOURS}
        digest = hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()[:12]
        return f"{_BASE_BUILD_VERSION}+lowering.{digest}"
    raise AttributeError(name)


# ---- logging -------------------------------------------------------------------------------------------------------


def _logger(trt, verbose: bool):
    class Capture(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[tuple[int, str]] = []
            self.layer_report: str | None = None

        def log(self, severity, msg):
            sev = int(severity)
            if msg.startswith("Layers:\n") or msg.startswith("Engine Layer Information"):
                self.layer_report = msg
            elif sev <= int(trt.ILogger.Severity.WARNING):
                self.messages.append((sev, msg))

        def errors(self) -> list[str]:
            return [m for s, m in self.messages if s <= int(trt.ILogger.Severity.ERROR)]

    lg = Capture()
    lg.min_severity = trt.ILogger.Severity.VERBOSE if verbose else trt.ILogger.Severity.WARNING
    return lg


# ---- profiles ------------------------------------------------------------------------------------------------------


def dim_ranges(phase: str, export: dict, opts: TensorRTOptions) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every symbolic dim name of the traced graphs."""
    bs, max_len, max_batch = int(export["block_size"]), int(export["max_seq_len"]), int(export["max_batch"])
    mb = math.ceil(max_len / bs)
    opt_b = min(opts.opt_batch, max_batch)
    opt_t = max(PREFILL_MIN_T, min(opts.opt_seq_len, max_len))
    opt_mb = max(1, math.ceil(opt_t / bs))
    ranges = {"batch": (1, opt_b, max_batch), "max_blocks": (1, opt_mb, mb),
              "num_blocks": (2, opt_b * opt_mb + 1, max_batch * mb + 1)}
    ranges["seq"] = (PREFILL_MIN_T, opt_t, max_len) if phase == "prefill" else (1, 1, 1)
    return ranges


def _profile_shapes(model, ranges: dict[str, tuple[int, int, int]], phase: str) -> dict[str, dict[str, list[int]]]:
    out = {}
    for v in model.graph.input:
        dims = v.type.tensor_type.shape.dim
        mins, opts_, maxs = [], [], []
        for i, d in enumerate(dims):
            if d.HasField("dim_value"):
                mins.append(d.dim_value), opts_.append(d.dim_value), maxs.append(d.dim_value)
                continue
            name = d.dim_param
            if name not in ranges:
                raise BackendError(f"backend tensorrt ({phase}): input {v.name!r} dim {i} is {name or '?'!r}, which "
                                   f"has no profile range; known symbolic dims: {sorted(ranges)}")
            lo, mid, hi = ranges[name]
            mins.append(lo), opts_.append(mid), maxs.append(hi)
        out[v.name] = {"min": mins, "opt": opts_, "max": maxs}
    return out


# ---- build ---------------------------------------------------------------------------------------------------------


def _registry_has(trt):
    reg = trt.get_plugin_registry()

    def has(name: str, version: str, namespace: str) -> bool:
        try:
            return reg.get_creator(name, version, namespace) is not None
        except Exception:  # noqa: BLE001
            return False

    return has


def _targets(trt, flavour: str, target: str, extra: list[str]) -> list[str]:
    wanted = [target, *[t for t in extra if t != target]]
    if flavour == "tensorrt_rtx":
        for t in wanted:
            if t not in RTX_TARGETS:
                raise BackendError(f"target {t!r}: tensorrt_rtx builds for {', '.join(RTX_TARGETS)} (not sm90: its "
                                   f"runtime refuses Hopper); set the recipe target or backend.options.extra_targets")
    return wanted


def _configure(trt, builder, flavour: str, targets: list[str], opts: TensorRTOptions):
    config = builder.create_builder_config()
    if hasattr(config, "set_compute_capability"):
        config.num_compute_capabilities = len(targets)
        for i, t in enumerate(targets):
            config.set_compute_capability(getattr(trt.ComputeCapability, t.upper()), i)
    config.builder_optimization_level = opts.optimization_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if opts.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, opts.workspace_mb << 20)
    return config


def build(graphs: dict, out_dir: Path, options: dict | None = None) -> dict[str, Any]:
    """Build one engine per phase into out_dir/engines; returns {phase: record, "_trt": backend-wide record}."""
    import onnx
    import onnx_ir as ir

    opts = _parse_options(options)
    ctx = (options or {}).get("_build") or {}
    if "target" not in ctx or "export" not in ctx:
        raise BackendError("backend tensorrt: build() needs options['_build'] = {'target': recipe.target, 'export': "
                           "recipe export section} (kimi_compile/build.py passes it)")
    trt, flavour = load_trt(opts.flavour)
    targets = _targets(trt, flavour, ctx["target"], opts.extra_targets)
    out_dir = Path(out_dir)
    (out_dir / "engines").mkdir(parents=True, exist_ok=True)
    has = _registry_has(trt)
    record: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kimi-trt-") as work:
        for phase, model in graphs.items():
            t0 = time.perf_counter()
            src = Path(work) / f"{phase}.onnx"
            ir.save(model, src, external_data=f"{phase}.weights")
            proto = onnx.load(str(src), load_external_data=False)
            lowered, lowerings, origin = tl.lower_model(proto, flavour, has, opts.lowering)
            node_ops = {n.name: n.op_type for n in lowered.graph.node}
            lowered_path = Path(work) / f"{phase}.trt.onnx"
            onnx.save(lowered, str(lowered_path))
            t_lower = time.perf_counter() - t0
            rec = _build_phase(trt, flavour, phase, lowered, lowered_path, origin, node_ops, targets, opts,
                               ctx["export"], out_dir)
            rec["lowering"] = lowerings
            rec["seconds"]["lower"] = round(t_lower, 3)
            record[phase] = rec
    record["_trt"] = {
        "flavour": flavour, "version": trt.__version__, "compute_capabilities": targets,
        "options": dataclasses.asdict(opts), "build_version": __getattr__("BUILD_VERSION"),
        "lowering_table": tl.table_fingerprint(flavour),
        "plugins_required": sorted({x["plugin"] for p in graphs for x in record[p]["lowering"]
                                    if x["kind"] == "plugin"}),
        "plugins_planned": tl.planned_plugins(flavour),  # declared in the op tables, not implemented yet
        "executed": False,
        "note": (f"engines built ahead of time by {flavour} {trt.__version__}"
                 + (" on a CPU-only machine" if flavour == "tensorrt_rtx" else "")
                 + f" for {', '.join(targets)}; running them needs a GPU that this runtime accepts "
                 + ("(tensorrt_rtx: " + ", ".join(RTX_TARGETS) + "; not the H200, compute capability 9.0)"
                    if flavour == "tensorrt_rtx" else "(the build GPU's compute capability)")),
    }
    return record


def _build_phase(trt, flavour, phase, lowered, path, origin, node_ops, targets, opts, export, out_dir) -> dict:
    logger = _logger(trt, opts.layer_report)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    t0 = time.perf_counter()
    if not parser.parse_from_file(str(path)):
        raise BackendError(_parse_failure(phase, parser, lowered, origin, node_ops, logger))
    t_parse = time.perf_counter() - t0
    config = _configure(trt, builder, flavour, targets, opts)
    profile = builder.create_optimization_profile()
    shapes = _profile_shapes(lowered, dim_ranges(phase, export, opts), phase)
    for name, s in shapes.items():
        profile.set_shape(name, s["min"], s["opt"], s["max"])
    config.add_optimization_profile(profile)
    timing = None
    if flavour == "tensorrt":
        tdir = out_dir / "timing"
        tdir.mkdir(exist_ok=True)
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
        timing = (tdir / f"{phase}.cache", cache)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    t_build = time.perf_counter() - t0
    if plan is None:
        raise BackendError(_build_failure(phase, logger, origin, node_ops))
    data = bytes(plan)
    rel = f"engines/{phase}.engine"
    (out_dir / rel).write_bytes(data)
    rec: dict[str, Any] = {
        "file": rel, "format": "tensorrt-engine", "flavour": flavour, "version": trt.__version__,
        "compute_capabilities": targets, "engine_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
        "strongly_typed": True, "profiles": [shapes],
        "io": _io(network, shapes),
        "network_layers": network.num_layers,
        "seconds": {"parse": round(t_parse, 3), "build": round(t_build, 3)},
        "warnings": sorted({m.splitlines()[0][:200] for s, m in logger.messages
                            if s == int(trt.ILogger.Severity.WARNING)})[:20],
    }
    if timing is not None:
        timing[0].write_bytes(bytes(timing[1].serialize()))
        rec["timing_cache"] = f"timing/{phase}.cache"
    else:
        rec["timing_cache"] = None
        rec["timing_cache_note"] = ("tensorrt_rtx: timing-cache calls are no-ops (it picks kernels when a context "
                                    "is created on the GPU; its runtime cache lives on the deployment machine)")
    rec.update(_layers(trt, data, logger, origin, phase, out_dir))
    return rec


def _io(network, shapes) -> list[dict]:
    from kimi_compile.backends.tensorrt.executor import DTYPE_BYTES

    out = []
    for mode, n, get in (("input", network.num_inputs, network.get_input),
                         ("output", network.num_outputs, network.get_output)):
        for i in range(n):
            t = get(i)
            dt = str(t.dtype).rsplit(".", 1)[-1].lower()
            d = {"name": t.name, "mode": mode, "dtype": dt, "shape": list(t.shape)}
            if t.name in shapes:
                d["min"], d["max"] = shapes[t.name]["min"], shapes[t.name]["max"]
                d["max_bytes"] = math.prod(d["max"]) * DTYPE_BYTES.get(dt, 4)
            out.append(d)
    return out


# ---- layers --------------------------------------------------------------------------------------------------------

_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]]+)\]")
_IO = re.compile(r"\{ Name: (.*?), (?:Location: \w+, )?Dimensions: \[([^\]]*)\].*?Datatype: (\w+)")


def parse_layer_report(text: str) -> list[dict]:
    """The builder's verbose engine-layer report (one 'Name: ..., LayerType: ...' line per engine layer)."""
    layers = []
    for line in text.splitlines():
        if not line.startswith("Name: "):
            continue
        m = re.match(r"Name: (.*?), LayerType: ([^,]*),", line)
        if not m:
            continue
        ins = line.split(", Inputs: [", 1)[1] if ", Inputs: [" in line else ""
        ins, _, outs = ins.partition("Outputs: [")
        layers.append({
            "name": m.group(1), "type": m.group(2),
            "inputs": [{"name": a, "dims": b, "dtype": c} for a, b, c in _IO.findall(ins)],
            "outputs": [{"name": a, "dims": b, "dtype": c} for a, b, c in _IO.findall(outs)],
            "tactic": (re.search(r"TacticName: ([^,]*),", line) or re.search(r"TacticValue: ([^,]*),", line)
                       or [None, None])[1],
            "onnx_nodes": _ONNX_LAYER.findall(line.split("Metadata:", 1)[1]) if "Metadata:" in line else [],
        })
    return layers


def _layers(trt, plan: bytes, logger, origin, phase, out_dir) -> dict:
    """Engine layers: from the engine inspector when the engine deserializes on this machine, else the report."""
    from kimi_compile.backends.tensorrt.executor import inspect_plan

    info, why = inspect_plan(trt, plan)
    if info is not None:
        layers = [{"name": x.get("Name", ""), "type": x.get("LayerType", ""),
                   "onnx_nodes": _ONNX_LAYER.findall(x.get("Metadata", "") or "")} for x in info.get("Layers", [])]
        source = "engine inspector"
    elif logger.layer_report:
        layers, source = parse_layer_report(logger.layer_report), "builder verbose layer report"
    else:
        layers, source = [], "none"
    rel = f"engines/{phase}.layers.json"
    (out_dir / rel).write_text(json.dumps({"source": source, "inspector_unavailable": why, "layers": layers},
                                          indent=1))
    by_type: dict[str, int] = {}
    kimi: dict[str, list[str]] = {}
    for x in layers:
        by_type[x["type"]] = by_type.get(x["type"], 0) + 1
        for n in x["onnx_nodes"]:
            if n in origin:
                kimi.setdefault(origin[n]["node"], [])
                if x["name"] not in kimi[origin[n]["node"]]:
                    kimi[origin[n]["node"]].append(x["name"])
    return {"layers": {"source": source, "inspector_unavailable": why, "count": len(layers),
                       "by_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1])), "file": rel,
                       "names": [f"{x['type']}: {x['name']}" for x in layers]},
            "kimi_op_layers": {k: {"engine_layers": len(v), "examples": v[:5]} for k, v in kimi.items()}}


# ---- errors --------------------------------------------------------------------------------------------------------


def _parse_failure(phase, parser, lowered, origin, node_ops, logger) -> str:
    lines = [f"backend tensorrt: the TensorRT ONNX parser refused the {phase} graph:"]
    nodes = list(lowered.graph.node)
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        name = e.node_name() or (nodes[e.node()].name if 0 <= e.node() < len(nodes) else "")
        where = tl.describe_node(name, origin, node_ops) if name else f"node #{e.node()} ({e.node_operator()})"
        lines.append(f"  {where}: {e.desc().strip()}")
    if parser.num_errors == 0:
        lines += [f"  {m.strip()}" for m in logger.errors()[:5]]
    return "\n".join(lines[:12])


def _build_failure(phase, logger, origin, node_ops) -> str:
    errors = logger.errors() or ["(no error message from TensorRT)"]
    lines = [f"backend tensorrt: building the {phase} engine failed:"]
    for msg in errors[:5]:
        lines.append(f"  {msg.strip()[:400]}")
        blamed = tl.blame(msg, origin, node_ops)
        if blamed:
            lines.append(f"    -> {'; '.join(blamed[:3])}")
    return "\n".join(lines)


# ---- runtime -------------------------------------------------------------------------------------------------------


def load(artifact_dir: Path, manifest: dict, **kwargs):
    from kimi_compile.backends.tensorrt.executor import Executor

    return Executor(artifact_dir, manifest, **kwargs)
