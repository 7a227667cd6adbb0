"""An optimized ONNX graph lowered to a static program of torch calls, specialized per input shape, run eagerly or
replayed as a CUDA graph.

Lowering (once per phase graph): every node becomes a `Step`: standard ONNX ops through the one table in
onnx_ops.py; each `kimi.*` op through the `Kernel` its op folder names in `CUDA = {...}` (plugins/<op>/cuda.py),
or, where that kernel does not apply to the node (device, shape, dtype, attributes: `Kernel.supports` says why) or
none exists, through the op's reference (numpy, on host copies): a fallback that `coverage()` lists with its reason.

Specialization (once per input-shape signature, e.g. a decode batch bucket):
  1. static evaluation: steps that depend only on shapes and constants (Shape -> Gather -> Concat -> Reshape
     arguments, Range over a static length, ...) run once on the host; their values are baked in, so no step reads
     shape arguments from the device and the program can be captured;
  2. a recording run gives every intermediate's shape and dtype; liveness over the remaining steps gives the memory
     plan (memory.py); one arena is allocated and every planned intermediate is a view of it;
  3. later runs allocate nothing for planned values: a step's outputs are written into their slots (by the op
     itself for the ONNX ops of onnx_ops.OUT_TABLE and the kernels declaring `Kernel.out`, else copied in).
In-place outputs (a kernel's `inplace` pairs: paged cache writes, KDA states) alias their input: caches are updated
where they live and the graph output `<cache>.out` is the input tensor itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from kimi_compile import ops
from kimi_compile.backends.cuda import memory, onnx_ops
from kimi_compile.lowering import capability_reason

SMALL_CONST = 4096  # initializers up to this many elements also live on the host (shape arithmetic reads them)


@dataclasses.dataclass
class Step:
    index: int
    name: str
    op: str  # "Add", "kimi.KDA", ...
    fn: Callable[[list, dict], tuple]
    inputs: list[int | None]
    outputs: list[int]
    attrs: dict
    impl: str  # "onnx" | "kernel:<name>" | "reference"
    reason: str = ""  # why a kimi.* node runs its reference
    inplace: dict = dataclasses.field(default_factory=dict)  # output position -> input position
    host_inputs: frozenset = frozenset()
    stream: int = 0  # the stream the step runs on (node metadata kimi.stream, from the assign_streams pass)
    waits: tuple[str, ...] = ()  # producers on other streams (kimi.wait): their events are waited on first
    writes_out: bool = False  # fn takes out= (the outputs' planned slots) and writes into them (Kernel.out)


def _attr_value(a: ir.Attr) -> Any:
    t = a.type
    if t == ir.AttributeType.TENSOR:
        return _to_torch(a.value.numpy(), a.value.dtype, torch.device("cpu"))
    if t == ir.AttributeType.GRAPH or t == ir.AttributeType.GRAPHS:
        raise NotImplementedError("cuda backend: control-flow attributes (subgraphs) are not lowered")
    v = a.value
    if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
        return list(v)
    return v


def _to_torch(arr: np.ndarray, dtype: ir.DataType | None, device: torch.device) -> torch.Tensor:
    """numpy (ml_dtypes for bf16/fp8) -> torch without a float32 round trip."""
    arr = np.ascontiguousarray(arr)
    if not arr.flags.writeable:  # memory-mapped external data: torch needs its own bytes
        arr = arr.copy()
    name = arr.dtype.name
    if name == "bfloat16":
        t = torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    elif name.startswith("float8"):
        t = torch.from_numpy(arr.view(np.uint8)).view(onnx_ops.torch_dtype(dtype or ir.DataType.from_numpy(arr.dtype)))
    else:
        t = torch.from_numpy(arr)
    return t.to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """torch -> numpy for the references: bf16/fp16 as float32, float8 as the uint8 codes' float8 type."""
    import ml_dtypes

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kind = ml_dtypes.float8_e4m3fn if t.dtype == torch.float8_e4m3fn else ml_dtypes.float8_e5m2
        return t.view(torch.uint8).numpy().view(kind)
    return t.numpy()


def _from_reference(a: Any, like: ir.Value, device: torch.device) -> torch.Tensor:
    arr = np.asarray(a)
    want = onnx_ops.torch_dtype(like.dtype) if like.dtype is not None else None
    if want in (torch.float8_e4m3fn, torch.float8_e5m2) and arr.dtype == np.uint8:
        return torch.from_numpy(np.ascontiguousarray(arr)).view(want).to(device)
    if arr.dtype.name.startswith(("float8", "bfloat16")):
        arr = arr.astype(np.float32)
    t = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
    return t.to(want) if want is not None and t.dtype != want else t


_MAY_VIEW = onnx_ops.VIEWS | {"Slice", "Transpose", "Expand"}  # ops whose output may share their input's bytes


def _weight_key(v: ir.Value) -> tuple | None:
    """Where an external initializer's bytes live and how they are read (None for inline data): equal keys are the
    same tensor (the artifact writer stores each distinct weight once: serialize.py)."""
    t = v.const_value
    if not isinstance(t, ir.ExternalTensor):
        return None
    return (str(t.path), t.offset, t.length, t.dtype, tuple(int(d) for d in t.shape))


class Program:
    """One phase graph as steps over a value table. `run(feeds)` -> {output name: tensor}."""

    def __init__(self, model: ir.Model, device: str | torch.device, kernels: dict | None = None,
                 *, weights: bool = True, kernel_device: str | None = None, streams: bool = True,
                 weight_pool: dict | None = None, capability: tuple[int, int] | None = None):
        """`weights=False` lowers from shapes alone (device "meta": for the build's coverage report);
        `kernel_device` is the device kernels are chosen for (default: `device`'s type); `streams=False` ignores
        the stream plan (kimi.stream / kimi.wait): every step on the main stream, in graph order. `weight_pool`:
        device weights by where their bytes live (file, offset, length, dtype, shape), shared with the other phases'
        programs, so one weight stored once in the artifact is one tensor on the device. `capability`: the CUDA
        compute capability kernels are chosen for (Kernel.min_capability), by default the device's own (none known
        on a CPU or meta device: every kernel's requirement is then taken as met)."""
        self.device = torch.device(device)
        self.kernel_device = kernel_device or self.device.type
        if capability is None and self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
        self.capability = capability
        self.kernels = ops.kernels("CUDA") if kernels is None else kernels
        g = model.graph
        self.ids: dict[str, int] = {}
        self.values: list[ir.Value] = []

        def vid(v: ir.Value | None) -> int | None:
            if v is None:
                return None
            if v.name not in self.ids:
                self.ids[v.name] = len(self.values)
                self.values.append(v)
            return self.ids[v.name]

        self.inputs = [(v.name, vid(v)) for v in g.inputs]
        self.consts: dict[int, torch.Tensor] = {}
        self.host_consts: dict[int, torch.Tensor] = {}
        for name, v in g.initializers.items():
            i = vid(v)
            if v.const_value is None:
                continue
            if weights:
                key = _weight_key(v) if weight_pool is not None else None
                if key is None or key not in weight_pool:
                    t = _to_torch(v.const_value.numpy(), v.dtype, torch.device("cpu"))
                    loaded = (t.to(self.device), t if t.numel() <= SMALL_CONST else None)
                    if key is not None:
                        weight_pool[key] = loaded
                self.consts[i], host = loaded if key is None else weight_pool[key]
                if host is not None:
                    self.host_consts[i] = host
            else:  # shapes only (planning without the weights' bytes)
                shape = [int(d) for d in v.shape]
                self.consts[i] = torch.empty(shape, dtype=onnx_ops.torch_dtype(v.dtype), device="meta")
                if int(np.prod(shape)) <= SMALL_CONST:
                    arr = v.const_value.numpy()
                    self.host_consts[i] = _to_torch(arr, v.dtype, torch.device("cpu"))
        self.steps: list[Step] = []
        for node in g:
            step = self._lower(node, len(self.steps), [vid(v) for v in node.inputs], [vid(v) for v in node.outputs])
            if streams:
                step.stream = int(node.metadata_props.get("kimi.stream", 0))
                step.waits = tuple(w for w in node.metadata_props.get("kimi.wait", "").split(",") if w)
            self.steps.append(step)
        self.streams = 1 + max((st.stream for st in self.steps), default=0)
        self.outputs = [(v.name, vid(v)) for v in g.outputs]
        self._check_inplace()
        self._specs: dict[tuple, Specialized] = {}

    # ---- lowering -------------------------------------------------------------------------------------------

    def _lower(self, node: ir.Node, index: int, ins: list, outs: list) -> Step:
        attrs = {k: _attr_value(a) for k, a in node.attributes.items()}
        name = node.name or f"{node.op_type}_{index}"
        if node.domain in ("", "ai.onnx"):
            fn = onnx_ops.TABLE.get(node.op_type)
            if fn is None:
                raise NotImplementedError(f"cuda backend: ONNX op {node.op_type} (node {name!r}) has no lowering; "
                                          f"known: {sorted(onnx_ops.TABLE)}")
            host = frozenset(i for i in range(len(ins)) if (node.op_type, i) in onnx_ops.HOST_INPUTS)
            return Step(index, name, node.op_type, fn, ins, outs, attrs, "onnx", host_inputs=host)
        if node.domain != ops.DOMAIN:
            raise NotImplementedError(f"cuda backend: node {name!r} is in domain {node.domain!r}")
        op = ops.lookup(node.op_type, node=name)
        full = {**op.attributes, **attrs}
        kernel, reasons = self.kernels.get(node.op_type), []
        meta = [None if i is None else self.values[i] for i in ins]
        while kernel is not None:
            why = (f"runs on {'/'.join(kernel.devices)}, not {self.kernel_device}"
                   if self.kernel_device not in kernel.devices else
                   (capability_reason(kernel, self.capability) if self.kernel_device == "cuda" else None)
                   or (kernel.supports(meta, full) if kernel.supports else None))
            if not why:
                return Step(index, name, f"kimi.{node.op_type}",
                            _typed(kernel.run, [self.values[o] for o in outs], kernel.out), ins, outs, full,
                            f"kernel:{kernel.name or node.op_type}", reason="; ".join(reasons),
                            inplace=dict(kernel.inplace), writes_out=kernel.out)
            reasons.append(f"{kernel.name or node.op_type}: {why}")
            kernel = kernel.fallback
        kernel = self.kernels.get(node.op_type)
        reason = "; ".join(reasons) or "no cuda kernel for this op"
        inplace = dict(kernel.inplace) if kernel is not None else {}
        outs_v = [self.values[o] for o in outs]
        return Step(index, name, f"kimi.{node.op_type}", _reference_fn(op, outs_v, inplace), ins, outs, full,
                    "reference", reason=reason, inplace=inplace)

    def _check_inplace(self) -> None:
        """An in-place output may alias its input only if nothing reads that input after the step and the input is
        not a weight nor a view of one."""
        last_use: dict[int, int] = {}
        for s in self.steps:
            for i in s.inputs:
                if i is not None:
                    last_use[i] = s.index
        for _, i in self.outputs:
            last_use[i] = len(self.steps)
        weights = set(self.consts)  # weights and what may view their bytes: the next run (and other phases) read them
        for s in self.steps:
            if s.op in _MAY_VIEW and s.inputs and s.inputs[0] in weights:
                weights.update(o for o in s.outputs if o is not None)
        for s in self.steps:
            for o, i in list(s.inplace.items()):
                if s.inputs[i] is None or s.inputs[i] in weights or last_use.get(s.inputs[i], -1) > s.index:
                    del s.inplace[o]
                    if s.impl != "reference":  # the kernel writes in place regardless: copy the input first
                        s.fn = _copy_first(s.fn, i)

    def coverage(self) -> list[dict]:
        """Every kimi.* node: how it runs here (kernel or reference) and, for a reference, why."""
        return [{"node": s.name, "op": s.op, "impl": s.impl, **({"reason": s.reason} if s.reason else {})}
                for s in self.steps if s.op.startswith("kimi.")]

    # ---- running --------------------------------------------------------------------------------------------

    def signature(self, feeds: dict[str, torch.Tensor]) -> tuple:
        return tuple((n, tuple(feeds[n].shape), feeds[n].dtype) for n, _ in self.inputs)

    def run(self, feeds: dict[str, torch.Tensor], *, plan: bool = True, graphs: bool = False
            ) -> dict[str, torch.Tensor]:
        """Run at the feeds' shapes: the first call at a signature specializes (and runs eagerly), later ones run
        the specialized program, replayed as a CUDA graph when `graphs` (captured on the second call)."""
        key = self.signature(feeds)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = Specialized(self, feeds, plan=plan)
            return spec.first_outputs
        if graphs and spec.capture_error is None:
            return spec.replay(feeds)
        return spec.run(feeds)

    @property
    def persistent_inputs(self) -> set[str]:
        """Graph inputs that steps update in place (caches): a captured graph keeps their addresses, so callers
        must pass the same tensors every step."""
        names = {i: n for n, i in self.inputs}
        return {names[s.inputs[i]] for s in self.steps for i in s.inplace.values()
                if s.inputs[i] is not None and s.inputs[i] in names}


def _typed(fn: Callable, outs: list[ir.Value], takes_out: bool = False) -> Callable:
    """A kernel's outputs in the dtypes the graph declares for them (a kernel may compute in another). takes_out:
    `fn` takes out= (Kernel.out), passed on when the executor gives the outputs' slots."""
    want = [onnx_ops.torch_dtype(v.dtype) if v.dtype is not None else None for v in outs]

    def run(x, a, out=None):
        res = tuple(fn(x, a, out=out) if takes_out and out is not None else fn(x, a))
        return tuple(t if w is None or t.dtype == w else t.to(w) for t, w in zip(res, want))
    return run


def _copy_first(fn: Callable, i: int) -> Callable:
    def run(x, a, **kw):  # kw: out= for a kernel that writes into its slots (Kernel.out)
        x = list(x)
        x[i] = x[i].clone()
        return fn(x, a, **kw)
    return run


def _reference_fn(op: ops.OpDef, outs: list[ir.Value], inplace: dict) -> Callable:
    """The op's numpy reference on host copies, outputs cast to the node's declared dtypes; in-place outputs are
    written back into their input tensor (the aliasing contract holds for every implementation)."""
    def run(x, a):
        args = {n: to_numpy(t) for n, t in zip(op.inputs, x) if t is not None}
        res = op.reference(**args, **{k: v for k, v in a.items()})
        res = res if isinstance(res, tuple) else (res,)
        dev = next((t.device for t in x if t is not None), torch.device("cpu"))
        out = []
        for j, (r, v) in enumerate(zip(res, outs)):
            t = _from_reference(r, v, dev)
            if j in inplace:
                dst = x[inplace[j]]
                dst.copy_(t.view(dst.shape).to(dst.dtype))
                t = dst
            out.append(t)
        return tuple(out)
    return run


class Specialized:
    """A program at one input-shape signature: static values baked, memory planned, optionally a CUDA graph.

    Built by the first run at that signature, which runs eagerly (and is that call's result): static steps are
    evaluated on the host as they come (Shape of any value is static once the input shapes are fixed), every other
    step runs on the device and its output shape is recorded for the plan."""

    def __init__(self, prog: Program, feeds: dict[str, torch.Tensor], *, plan: bool):
        self.prog = prog
        self.static: dict[int, torch.Tensor] = dict(prog.host_consts)
        self._static_dev: dict[int, torch.Tensor] = {}
        env = self._env(feeds)
        steps: list[Step] = []
        shapes: dict[int, tuple] = {}
        self.alias: dict[int, int] = {}  # output value -> the input value whose bytes it shares (the first run's)
        dev = prog.device
        for s in prog.steps:
            if self._static_step(s):
                xs = [None if i is None else (env[i] if s.op == "Shape" else self.static[i]) for i in s.inputs]
                for o, t in zip(s.outputs, s.fn(xs, s.attrs)):
                    self.static[o] = t
                    env[o] = t.to(dev) if isinstance(t, torch.Tensor) else t
                continue
            for p in s.host_inputs:
                i = s.inputs[p]
                if i is not None and i not in self.static:
                    raise NotImplementedError(
                        f"cuda backend: node {s.name!r} ({s.op}) takes a shape argument computed from data "
                        f"(value {prog.values[i].name!r}); a static program needs it from shapes and constants")
            steps.append(s)
            args = self._args(s, env)
            storage = {x.untyped_storage().data_ptr(): i for i, x in zip(s.inputs, args)
                       if i is not None and isinstance(x, torch.Tensor) and x.numel()}
            for o, t in zip(s.outputs, s.fn(args, s.attrs)):
                env[o] = t
                shapes[o] = (tuple(t.shape), t.dtype)
                if t.numel() and t.untyped_storage().data_ptr() in storage:  # a view of (or in place on) an input
                    self.alias[o] = storage[t.untyped_storage().data_ptr()]
        self.steps = steps
        self.multi_stream = prog.device.type == "cuda" and prog.streams > 1
        self._streams_setup()
        self.first_outputs = {name: env[i] for name, i in prog.outputs}
        for i, t in self.static.items():  # device copies of every static value now: a captured run must not copy
            if i not in self._static_dev:
                self._static_dev[i] = prog.consts[i] if i in prog.consts else t.to(prog.device)
        self.slots: dict[int, torch.Tensor] = {}
        self.plan: memory.MemoryPlan | None = None
        self.arena: torch.Tensor | None = None
        self.last_use = self._last_use()
        self.graph = None
        self.capture_error: str | None = None
        self.direct: dict[int, Callable] = {}  # step index -> the op written into its output's slot
        if plan:
            self._plan(shapes)
            self.direct = {s.index: onnx_ops.OUT_TABLE[s.op] for s in steps
                           if s.impl == "onnx" and s.op in onnx_ops.OUT_TABLE and len(s.outputs) == 1
                           and s.outputs[0] in self.slots}

    def _static_step(self, s: Step) -> bool:
        if s.op in ("Shape", "Constant"):
            return True
        if s.op.startswith("kimi.") or not any(i is not None for i in s.inputs):
            return False
        return all(i is None or i in self.static for i in s.inputs)

    # liveness and the plan --------------------------------------------------------------------------------------

    def _last_use(self) -> dict[int, int]:
        last: dict[int, int] = {}
        base: dict[int, int] = {}  # view value -> the value whose storage it shares
        graph_outputs = {i for _, i in self.prog.outputs}
        for k, s in enumerate(self.steps):
            for i in s.inputs:
                if i is not None:
                    last[base.get(i, i)] = k
            if s.op in onnx_ops.VIEWS and s.inputs[0] is not None:
                base[s.outputs[0]] = base.get(s.inputs[0], s.inputs[0])
            for o in s.outputs:  # an unplanned output (a graph output) that is a view of an input, e.g. a Slice or a
                src = self.alias.get(o)  # Transpose: the input's bytes live as long as the output does
                if src is not None and o in graph_outputs and o not in base:
                    base[o] = base.get(src, src)
        end = len(self.steps)
        for _, i in self.prog.outputs:
            last[base.get(i, i)] = end
        # A buffer read or written on a side stream shares its bytes with no other buffer, for the whole step: not
        # after it (its readers may still run when a later step on another stream would write those bytes) and not
        # before it (a side stream may write it while the main stream still reads an earlier value placed there;
        # program order says nothing across streams). Planned this way whenever the program has a stream plan, on
        # any device, so the CPU tests check the plan the GPU runs.
        self.side_values: set[int] = set()
        if self.prog.streams > 1:
            for s in self.steps:
                if s.stream:
                    self.side_values.update(base.get(i, i) for i in (*s.inputs, *s.outputs) if i is not None)
            for i in self.side_values:
                last[i] = end
        self.base = base
        return last

    def _plan(self, shapes: dict[int, tuple]) -> None:
        """Plan every intermediate except graph outputs (and the values they view): those leave the step (a cache
        the caller feeds back next step must not share bytes with this step's temporaries)."""
        outputs = {self.base.get(i, i) for _, i in self.prog.outputs}
        bufs, info = [], {}
        for k, s in enumerate(self.steps):
            for j, o in enumerate(s.outputs):
                if o not in shapes or s.op in onnx_ops.VIEWS or j in s.inplace or self.base.get(o, o) in outputs:
                    continue
                shape, dt = shapes[o]
                nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
                info[o] = (shape, dt, nbytes)
                bufs.append(memory.Buffer(o, max(memory.aligned(nbytes), memory.ALIGN),
                                          0 if o in self.side_values else k, max(k, self.last_use.get(o, k))))
        self.plan = memory.plan(bufs)
        self.plan.validate()
        self.arena = torch.empty(self.plan.peak, dtype=torch.uint8, device=self.prog.device)
        for b in bufs:
            shape, dt, nbytes = info[b.value]
            off = self.plan.offsets[b.value]
            self.slots[b.value] = self.arena[off:off + nbytes].view(dt).view(shape)

    # running ---------------------------------------------------------------------------------------------------

    def _env(self, feeds: dict[str, torch.Tensor]) -> list:
        env: list = [None] * len(self.prog.values)
        for i, t in self.prog.consts.items():
            env[i] = t
        dev = self.prog.device
        for i, t in self.static.items():
            if i not in self._static_dev:
                self._static_dev[i] = t.to(dev) if i not in self.prog.consts else self.prog.consts[i]
            env[i] = self._static_dev[i]
        for name, i in self.prog.inputs:
            env[i] = feeds[name]
        return env

    def _args(self, s: Step, env: list) -> list:
        """A step's inputs: shape arguments as host tensors, everything else from the device environment."""
        if not s.host_inputs:
            return [None if i is None else env[i] for i in s.inputs]
        return [None if i is None else (self.static[i] if p in s.host_inputs else env[i])
                for p, i in enumerate(s.inputs)]

    def _streams_setup(self) -> None:
        """Side streams, one event per step another stream waits for, and per step the events it waits on."""
        if not self.multi_stream:
            return
        pos = {s.name: k for k, s in enumerate(self.steps)}
        self.side = [torch.cuda.Stream(device=self.prog.device) for _ in range(self.prog.streams - 1)]
        self.wait_on = [[pos[w] for w in s.waits if w in pos] for s in self.steps]  # static producers: no event
        needed = {k for ws in self.wait_on for k in ws}
        self.events = {k: torch.cuda.Event() for k in needed}
        self.fork = torch.cuda.Event()
        self.joins = [torch.cuda.Event() for _ in self.side]

    def _step(self, s: Step, env: list) -> None:
        direct = self.direct.get(s.index)
        if direct is not None:  # the op computes straight into its output's slot: no copy
            slot = self.slots[s.outputs[0]]
            shape, ptr = slot.shape, slot.data_ptr()
            direct(self._args(s, env), s.attrs, slot)
            if slot.shape != shape or slot.data_ptr() != ptr:  # out= resized it: the shapes changed under the plan
                raise RuntimeError(f"cuda backend: node {s.name!r} ({s.op}) wrote {tuple(slot.shape)} into its "
                                   f"planned {tuple(shape)} slot; the step's shapes differ from the first run's")
            env[s.outputs[0]] = slot
            return
        slots = self.slots
        if s.writes_out and slots:  # the kernel writes into the outputs' slots itself (Kernel.out): no copies
            outs = s.fn(self._args(s, env), s.attrs, out=tuple(slots.get(o) for o in s.outputs))
        else:
            outs = s.fn(self._args(s, env), s.attrs)
        for o, t in zip(s.outputs, outs):
            slot = slots.get(o)
            if slot is not None:
                if t is not slot:
                    slot.copy_(t)
                t = slot
            env[o] = t

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env = self._env(feeds)
        if not self.multi_stream:
            for s in self.steps:
                self._step(s, env)
            return {name: env[i] for name, i in self.prog.outputs}
        main = torch.cuda.current_stream(self.prog.device)
        streams = [main, *self.side]
        self.fork.record(main)
        for st in self.side:  # side streams start after everything queued before this step (input copies, ...)
            st.wait_event(self.fork)
        for k, s in enumerate(self.steps):
            st = streams[s.stream]
            for d in self.wait_on[k]:
                st.wait_event(self.events[d])
            with torch.cuda.stream(st):
                self._step(s, env)
            if s.stream:  # tensors a side stream allocated and others read: the allocator must not reuse them early
                for o in s.outputs:
                    t = env[o]
                    if isinstance(t, torch.Tensor) and t.is_cuda and o not in self.slots:
                        t.record_stream(main)
            ev = self.events.get(k)
            if ev is not None:
                ev.record(st)
        for st, ev in zip(self.side, self.joins):  # join: the step ends when every stream has
            ev.record(st)
            main.wait_event(ev)
        return {name: env[i] for name, i in self.prog.outputs}

    # CUDA graphs -----------------------------------------------------------------------------------------------

    def replay(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Replay the step as one CUDA graph: new values of the per-step inputs are copied into the captured input
        buffers; persistent inputs (caches) must be the captured tensors themselves (else copied, slowly)."""
        if self.graph is None:
            self._capture(feeds)
            if self.graph is None:
                return self.run(feeds)
        for name, buf in self.graph_inputs.items():
            t = feeds[name]
            if t.data_ptr() != buf.data_ptr():
                buf.copy_(t, non_blocking=True)
        self.graph.replay()
        # caches (`<cache>.out`) are the captured tensors the next step reads; every other output (logits) is copied
        # out of the graph's buffers, which the next replay overwrites
        return {n: t if n.endswith(".out") else t.clone() for n, t in self.graph_outputs.items()}

    def _capture(self, feeds: dict[str, torch.Tensor]) -> None:
        persistent = self.prog.persistent_inputs
        self.graph_inputs = {n: (feeds[n] if n in persistent else feeds[n].clone()) for n, _ in self.prog.inputs}
        g = torch.cuda.CUDAGraph()
        try:  # the specializing run was the warm-up (lazy inits, autotuning, one-time weight fusions)
            with torch.cuda.graph(g):
                self.graph_outputs = self.run(self.graph_inputs)
        except Exception as e:  # a step that syncs with the host cannot be captured: stay eager, say why
            self.capture_error = f"{type(e).__name__}: {e}"
            import logging

            logging.getLogger(__name__).warning("CUDA-graph capture failed, running this shape eagerly: %s",
                                                self.capture_error)
            return
        self.graph = g
