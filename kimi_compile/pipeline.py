"""Recipe -> one flat, ordered list of named passes, and the loop that runs them: compile cache, verifier, numerical
check and IR dumps around every pass live here, so no pass (and not the build) repeats them.

A pass is an onnx_ir pass class `VerbNounPass` in passes/verb_noun.py with a stable `name`, a `version` (part of the
cache key), an `Options` dataclass filled from the recipe (validated with the recipe's key path), and a `run(model,
stats)` that records what it changed in `stats`; calling the pass returns a `KimiPassResult` carrying those counts
and near misses. A pass declares what it changes beyond the graph body (`changes_signature`: it rewrites the graph's
inputs/outputs, e.g. splits a cache into quantized pools); the loop reacts to the declaration, never to a pass name.

    passes = resolve(recipe)                               # [CleanupPass(...), FuseIndexerPass(...), ...]
    result = run(traced, passes, cache=cache, keys=keys, check=verifier)
    result.graphs["decode"], result.records, result.keys, result.rebased
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import pkgutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import onnx
import onnx_ir as ir

from kimi_compile import graph_io, ops
from kimi_compile.functions import attach_functions
from kimi_compile.passbase import KimiPass, KimiPassResult, PassStats  # noqa: F401  (the pass API, re-exported)
from kimi_compile.recipe import Recipe, RecipeError, coerce_options


def _discover() -> dict[str, str]:
    """Pass name -> module: every public module of kimi_compile.passes (passes/verb_noun.py holds the pass named
    verb_noun; `pass_class` checks the name)."""
    from kimi_compile import passes

    return {m.name: f"{passes.__name__}.{m.name}" for m in pkgutil.iter_modules(passes.__path__)
            if not m.name.startswith("_")}


PASS_MODULES = _discover()


class VerifyError(RuntimeError):
    pass


def pass_class(name: str) -> type[KimiPass]:
    cls = getattr(importlib.import_module(PASS_MODULES[name]), "PASS")
    if cls.name != name:
        raise TypeError(f"{PASS_MODULES[name]}.PASS is named {cls.name!r}; a pass module's PASS carries its name")
    return cls


def resolve(recipe: Recipe) -> list[KimiPass]:
    """Instantiate the enabled passes in recipe order, validating their options. A pass whose Options has a `rules`
    field gets the recipe's precision rules there; one with a `dtype` field gets `model.dtype`; fields named like
    the recipe's parallel layout (tp, ep, sequence_parallel) get its values."""
    source = recipe.source or recipe.name
    precision = recipe.to_dict()["precision"]
    out = []
    for i, spec in enumerate(recipe.passes):
        if spec.name not in PASS_MODULES:
            raise RecipeError(source, f"passes[{i}].name", f"unknown pass {spec.name!r}; known: {sorted(PASS_MODULES)}")
        if not spec.enabled:
            continue
        cls = pass_class(spec.name)
        options = dict(spec.options)
        fields = {f.name for f in dataclasses.fields(cls.Options)}
        if precision and "rules" in fields:
            options.setdefault("rules", [dict(r) for r in precision])
        if "dtype" in fields:
            options.setdefault("dtype", recipe.model.dtype)
        for k, v in dataclasses.asdict(recipe.parallel).items():
            if k in fields:
                if k in options and options[k] != v:
                    raise RecipeError(source, f"passes[{i}].options.{k}", f"the parallel layout is set in "
                                                                         f"parallel.{k} ({v}), not here")
                options[k] = v
        out.append(cls(coerce_options(cls.Options, options, f"passes[{i}].options", source)))
    return out


def verify_model(model: ir.Model, where: str) -> None:
    """The verifier: ONNX checker, registry check of every kimi.* node (and its function body)."""
    for graph in (model.graph, *model.functions.values()):
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.domain == ops.DOMAIN:
                try:
                    ops.lookup(node.op_type, node=node.name)
                except ops.UnknownOpError as e:
                    raise VerifyError(f"{where}: {e}") from None
                if (ops.DOMAIN, node.op_type, node.overload) not in model.functions and \
                        ops.lookup(node.op_type).kind != "partition":  # per-rank graphs only (ops.KINDS)
                    raise VerifyError(f"{where}: node {node.name!r} ({ops.DOMAIN}.{node.op_type}) has no function body")
    # large in-memory weights are not copied into the proto (a multi-GB model would pass protobuf's 2 GiB limit):
    # they stand in as external references, checked below as typed graph inputs like weights in external files
    stubs = {}
    for name, v in model.graph.initializers.items():
        t = v.const_value
        if t is not None and not isinstance(t, ir.ExternalTensor) and t.nbytes > (1 << 20):
            stubs[name] = t
            v.const_value = ir.ExternalTensor("stub", 0, t.nbytes, t.dtype, shape=t.shape, name=name)
    try:
        proto = ir.to_proto(model)
    finally:
        for name, t in stubs.items():
            model.graph.initializers[name].const_value = t
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for t in external:
        proto.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        proto.graph.initializer.remove(t)
    try:
        onnx.checker.check_model(proto, full_check=False)
    except onnx.checker.ValidationError as e:
        raise VerifyError(f"{where}: ONNX checker: {str(e).splitlines()[0]}") from None


@dataclasses.dataclass
class PassRecord:
    name: str
    version: int
    phase: str
    counts: dict
    ms: float
    modified: bool
    nodes_before: int
    nodes_after: int
    near_misses: int = 0
    cached: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def options_dict(p: KimiPass) -> dict:
    return dataclasses.asdict(p.options)


class Check(Protocol):
    """The numerical check around each pass (`kimi_compile.verify.Verifier`): `__call__(phase, model, after,
    rebase)` returns a log row and raises VerifyError when `after` broke tolerance; `rebase=True` (the pass changed
    the signature) re-derives the feeds for the new signature and makes this graph the new expectation."""

    def __call__(self, phase: str, model: ir.Model, after: str, rebase: bool) -> dict: ...


@dataclasses.dataclass
class PipelineResult:
    graphs: dict[str, ir.Model]  # phase -> optimized graph
    keys: dict[str, str]  # phase -> compile-cache key of its last stage
    records: list[PassRecord]
    rebased: dict[str, ir.Model]  # phase -> graph right after the first signature-changing pass (if any)
    verify_log: list[dict]
    cache_hits: list[bool]


def run(graphs: dict[str, ir.Model], passes: list[KimiPass], *, cache=None, keys: dict[str, str] | None = None,
        check: Check | None = None, dump_dir: str | Path | None = None,
        say: Callable[[str], None] = lambda _msg: None) -> PipelineResult:
    """Run `passes` in order on every phase graph. Around each pass: the verifier before and after; with `cache`
    (a CompileCache) and `keys` (phase -> key of the input stage), each pass's output is a cache entry keyed by
    (input key, pass name, version, options, phase); `check` runs the numerics after the input and after each
    pass; `dump_dir` receives the IR text after each pass (`<dump_dir>/<phase>/<NN>_<pass>.txt`). A partition pass
    (`partitions`, more than one rank) forks each graph: rank r's copy runs `for_rank(r)` and the passes after it,
    and comes out as phase `<phase>.rank<r>` (no numerical check there: one rank's graph runs with its peers)."""
    out = PipelineResult({}, {}, [], {}, [], [])
    for phase, m in graphs.items():
        key = (keys or {}).get(phase, "")
        if check is not None:
            out.verify_log.append(check(phase, m, "trace", False))
        _run_passes(out, phase, m, key, passes, 0, cache=cache, check=check, dump_dir=dump_dir, say=say)
    return out


def _run_passes(out: PipelineResult, phase: str, m: ir.Model, key: str, passes: list[KimiPass], start: int, *,
                cache, check, dump_dir, say, partitioned: bool = False) -> None:
    """Passes[start:] on one graph; a partition pass at index > start forks it (at start: this is one rank's copy)."""
    from kimi_compile.cache import cache_key

    for i in range(start, len(passes)):
        p = passes[i]
        if p.partitions and p.ranks() > 1 and not (partitioned and i == start):
            base, _, prev = phase.partition(".rank")  # a second partition (tp, then cp): world rank c * tp + t
            inner = math.prod(q.ranks() for q in passes[:i] if q.partitions)
            for r in range(p.ranks()):
                name = f"{base}.rank{r * inner + int(prev)}" if prev else f"{phase}.rank{r}"
                _run_passes(out, name, _copy(m), key, [*passes[:i], p.for_rank(r), *passes[i + 1:]],
                            i, cache=cache, check=check, dump_dir=dump_dir, say=say, partitioned=True)
            return
        key = cache_key(stage="pass", prev=key, name=p.name, version=p.version, options=options_dict(p),
                        phase=phase)
        if cache is None:
            rec = _run_one(m, p, phase, say)
        else:
            def produce(d: Path, m=m, p=p) -> None:
                r = _run_one(m, p, phase, say)
                graph_io.save({"graph": m}, d, share_root=cache.root)  # unchanged weights stay where they are
                (d / "record.json").write_text(json.dumps(r.to_dict()))

            entry, hit = cache.get_or_create("pass", key, produce)
            out.cache_hits.append(hit)
            rec = PassRecord(**{**json.loads((entry / "record.json").read_text()), "cached": hit})
            m = graph_io.load(entry, "graph")
            attach_functions(m)
        if p.changes_signature and rec.modified and phase not in out.rebased and not partitioned:
            out.rebased[phase] = m.clone()
        if check is not None and not partitioned:
            out.verify_log.append(check(phase, m, p.name, p.changes_signature and rec.modified))
        if dump_dir is not None:
            d = Path(dump_dir) / phase
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i:02d}_{p.name}.txt").write_text(str(m))
        out.records.append(rec)
    out.graphs[phase], out.keys[phase] = m, key


def _copy(m: ir.Model) -> ir.Model:
    """A copy of the graph (initializer tensors shared, not copied) with the same function bodies."""
    return ir.Model(m.graph.clone(), ir_version=m.ir_version, producer_name=m.producer_name,
                    producer_version=m.producer_version, domain=m.domain, model_version=m.model_version,
                    doc_string=m.doc_string, functions=list(m.functions.values()),
                    metadata_props=dict(m.metadata_props))


def _run_one(model: ir.Model, p: KimiPass, phase: str, say: Callable[[str], None]) -> PassRecord:
    say(f"{phase}: pass {p.name}")
    verify_model(model, f"{phase}: before pass {p.name}")
    before = len(model.graph)
    t0 = time.perf_counter()
    result = p(model)
    ms = (time.perf_counter() - t0) * 1e3
    verify_model(result.model, f"{phase}: after pass {p.name}")
    return PassRecord(p.name, p.version, phase, dict(result.counts), round(ms, 3), result.modified, before,
                      len(result.model.graph), len(result.near_misses))
