"""Runs the TensorRT engines of an artifact: `Executor(artifact_dir, manifest).run(phase, feeds) -> outputs`.

Order of loading: (1) register the kimi plugins the engines need (every plugins/<op>/tensorrt.py may define
`register(trt)`), and refuse with the op named if a required creator is missing; (2) deserialize each engine with the
runtime of the flavour it was built by; (3) on the first run of a phase, create its execution context and device
buffers. Device memory comes from the CUDA runtime through ctypes (libcudart), so no torch is needed.

Caches stay on the device between steps: a cache input `X` and its output `X.out` are bound to two device buffers
that swap after every step (TensorRT aliases an output to an input only for plugins that declare it; where the engine
reports an aliased input, both bind one buffer). `run()` returns host copies of the outputs, as the Session expects;
when the next step's feed for `X` is the very array returned for `X.out`, its upload is skipped.

What runs where (measured): on the CPU-only build machine, deserialization fails (tensorrt_rtx: "cudaError 35: CUDA
driver version is insufficient"); on the H200 the tensorrt_rtx runtime refuses compute capability 9.0. Everything
after deserialization (contexts, buffers, enqueue) has not been executed on our machines.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from pathlib import Path

import numpy as np

DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
               "int32": 4, "int64": 8, "bool": 1, "fp8": 1, "e8m0": 1, "int4": 1, "fp4": 1}


class EngineLoadError(RuntimeError):
    """An engine cannot be loaded on this machine; the message says which engine and TensorRT's reason."""


def _np_dtype(trt_dtype) -> np.dtype:
    name = str(trt_dtype).rsplit(".", 1)[-1].lower()
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"float": "float32", "half": "float16", "int8": "int8", "uint8": "uint8", "int32": "int32",
                     "int64": "int64", "bool": "bool", "fp8": "uint8", "e8m0": "uint8"}[name])


def _logger(trt):
    class Capture(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if int(severity) <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(msg.strip())

    lg = Capture()
    lg.min_severity = trt.ILogger.Severity.WARNING
    return lg


def _validity(trt, runtime, plan: bytes) -> str:
    try:
        validity, diag = runtime.get_engine_validity(plan[: runtime.engine_header_size])
    except Exception as e:  # noqa: BLE001  (absent in full TensorRT, or no GPU to compare with)
        return f"validity check unavailable ({type(e).__name__})"
    names = [n for n, v in trt.EngineInvalidityDiagnostics.__members__.items() if int(diag) & int(v)]
    return f"validity {str(validity).rsplit('.', 1)[-1]}" + (f" ({', '.join(names)})" if names else "")


def inspect_plan(trt, plan: bytes) -> tuple[dict | None, str | None]:
    """(engine inspector JSON, None) when the plan deserializes here; else (None, TensorRT's reason)."""
    logger = _logger(trt)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        return None, (logger.errors[0] if logger.errors else "deserialize_cuda_engine returned None")[:300]
    inspector = engine.create_engine_inspector()
    return json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON)), None


def register_plugins(trt, required: list[str]) -> list[str]:
    """Call `register(trt)` of every plugins/<op>/tensorrt.py that has one; check the required creators exist."""
    from kimi_compile import ops

    ops.ensure_loaded()
    done = []
    for mod in ops.plugin_modules("tensorrt"):
        if hasattr(mod, "register"):
            mod.register(trt)
            done.append(mod.__name__.split(".")[-2])
    reg = trt.get_plugin_registry()
    for p in required:
        ns, _, name = p.partition("::")
        if reg.get_creator(name, "1", ns) is None:
            raise EngineLoadError(f"engine needs plugin {p}, which is not registered: the plugin for kimi.{name} "
                                  f"must be registered before deserialization (plugins/*/tensorrt.py register())")
    return done


class _Cuda:
    """The few CUDA runtime calls the executor needs, through ctypes."""

    H2D, D2H, D2D = 1, 2, 3

    def __init__(self):
        names = [ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.13", "libcudart.so.12"]
        try:
            import nvidia.cuda_runtime as cr  # the nvidia-cuda-runtime wheel, when present

            names += [str(p) for p in Path(cr.__path__[0]).glob("lib/libcudart.so*")]
        except ImportError:
            pass
        self.lib = None
        for n in names:
            if not n:
                continue
            try:
                self.lib = ctypes.CDLL(n)
                break
            except OSError:
                continue
        if self.lib is None:
            raise EngineLoadError("the CUDA runtime library (libcudart) is not loadable: install the CUDA runtime "
                                  "(e.g. pip install nvidia-cuda-runtime) to run TensorRT engines")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.lib.cudaGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"CUDA {what} failed: {self.lib.cudaGetErrorString(rc).decode()} ({rc})")

    def malloc(self, n: int) -> int:
        p = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(max(n, 1))), "cudaMalloc")
        return p.value

    def free(self, p: int) -> None:
        self.lib.cudaFree(ctypes.c_void_p(p))

    def copy(self, dst: int, src: int, n: int, kind: int) -> None:
        self._check(self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n), kind),
                    "cudaMemcpy")

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreate(ctypes.byref(s)), "cudaStreamCreate")
        return s.value or 0

    def sync(self, s: int) -> None:
        self._check(self.lib.cudaStreamSynchronize(ctypes.c_void_p(s)), "cudaStreamSynchronize")


class _Buffer:
    def __init__(self, cuda: _Cuda):
        self.cuda, self.ptr, self.size = cuda, 0, 0

    def ensure(self, n: int) -> int:
        if n > self.size:
            if self.ptr:
                self.cuda.free(self.ptr)
            self.ptr, self.size = self.cuda.malloc(n), n
        return self.ptr


class Executor:
    """Loads the engines of every phase; `run(phase, feeds)` executes one step."""

    def __init__(self, artifact_dir: str | Path, manifest: dict, threads: int | None = None):
        from kimi_compile.backends.tensorrt import load_trt

        self.dir = Path(artifact_dir)
        trt_info = manifest.get("backend", {}).get("trt") or manifest.get("_trt") or {}
        graphs = manifest["graphs"]
        flavour = trt_info.get("flavour") or next(iter(graphs.values())).get("flavour", "auto")
        self.trt, self.flavour = load_trt(flavour)
        required = sorted({x["plugin"] for g in graphs.values() for x in g.get("lowering", []) if x["kind"] == "plugin"})
        self.plugins = register_plugins(self.trt, required)
        self.logger = _logger(self.trt)
        self.runtime = self.trt.Runtime(self.logger)
        self.engines = {}
        for phase, g in graphs.items():
            plan = (self.dir / g["file"]).read_bytes()
            engine = self.runtime.deserialize_cuda_engine(plan)
            if engine is None:
                why = self.logger.errors[-1] if self.logger.errors else "deserialize_cuda_engine returned None"
                raise EngineLoadError(
                    f"{g['file']}: {self.flavour} {self.trt.__version__} cannot load the {phase} engine on this "
                    f"machine ({_validity(self.trt, self.runtime, plan)}): {why}; engines built for "
                    f"{', '.join(g.get('compute_capabilities', []))} run only on a GPU of that compute capability")
            self.engines[phase] = engine
        self.cuda = _Cuda()
        self.stream = self.cuda.stream()
        self.contexts: dict = {}
        self.buffers: dict[tuple[str, str], _Buffer] = {}
        self.pairs: dict[str, list[_Buffer]] = {}  # cache name -> [current, next]
        self.last: dict[str, int] = {}  # cache name -> id() of the host array last returned for it

    def _names(self, phase: str):
        e = self.engines[phase]
        names = [e.get_tensor_name(i) for i in range(e.num_io_tensors)]
        ins = [n for n in names if e.get_tensor_mode(n) == self.trt.TensorIOMode.INPUT]
        return ins, [n for n in names if n not in ins]

    def run(self, phase: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        engine = self.engines[phase]
        ctx = self.contexts.get(phase)
        if ctx is None:
            ctx = self.contexts[phase] = engine.create_execution_context()
        ins, outs = self._names(phase)
        caches = {n for n in ins if n + ".out" in outs}
        for n in ins:
            if n not in feeds:
                raise ValueError(f"{phase}: feed {n!r} missing; the engine takes {ins}")
            a = np.ascontiguousarray(feeds[n], dtype=_np_dtype(engine.get_tensor_dtype(n)))
            ctx.set_input_shape(n, a.shape)
            if n in caches:
                pair = self.pairs.setdefault(n, [_Buffer(self.cuda), _Buffer(self.cuda)])
                ptr = pair[0].ensure(a.nbytes)
                if self.last.get(n) != id(feeds[n]):
                    self.cuda.copy(ptr, a.ctypes.data, a.nbytes, _Cuda.H2D)
            else:
                ptr = self.buffers.setdefault((phase, n), _Buffer(self.cuda)).ensure(a.nbytes)
                self.cuda.copy(ptr, a.ctypes.data, a.nbytes, _Cuda.H2D)
            ctx.set_tensor_address(n, ptr)
        shapes = {}
        for n in outs:
            shape = tuple(ctx.get_tensor_shape(n))
            dt = _np_dtype(engine.get_tensor_dtype(n))
            nbytes = int(np.prod(shape)) * dt.itemsize
            base = n[: -len(".out")] if n.endswith(".out") and n[: -len(".out")] in caches else None
            if base is not None:
                alias = engine.get_aliased_input_tensor(n) if hasattr(engine, "get_aliased_input_tensor") else None
                pair = self.pairs[base]
                ptr = pair[0].ptr if alias == base else pair[1].ensure(nbytes)
            else:
                ptr = self.buffers.setdefault((phase, n), _Buffer(self.cuda)).ensure(nbytes)
            ctx.set_tensor_address(n, ptr)
            shapes[n] = (shape, dt, ptr, nbytes)
        if not ctx.execute_async_v3(self.stream):
            raise RuntimeError(f"{phase}: TensorRT enqueue failed: {self.logger.errors[-1:]}")
        self.cuda.sync(self.stream)
        result = {}
        for n, (shape, dt, ptr, nbytes) in shapes.items():
            host = np.empty(shape, dtype=dt)
            self.cuda.copy(host.ctypes.data, ptr, nbytes, _Cuda.D2H)
            result[n] = host
        for base, pair in self.pairs.items():
            if base in caches and base + ".out" in result:
                if pair[1].ptr and (engine.get_aliased_input_tensor(base + ".out")
                                    if hasattr(engine, "get_aliased_input_tensor") else None) != base:
                    pair.reverse()  # the step's output buffer is the next step's input
                self.last[base] = id(result[base + ".out"])
        return result

    def close(self) -> None:
        for b in [*self.buffers.values(), *(x for p in self.pairs.values() for x in p)]:
            if b.ptr:
                self.cuda.free(b.ptr)
                b.ptr = 0
