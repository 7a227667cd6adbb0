"""Recipe -> one flat, ordered list of named passes; runs them with a verifier around each and a report.

A pass is an onnx_ir pass class `VerbNounPass` in passes/verb_noun.py with a stable `name`, a `version` (part of the
cache key), an `Options` dataclass filled from the recipe (validated with the recipe's key path), and a `counts`
dict saying what it changed. `PASSES` maps recipe names to classes; a recipe naming an unknown pass fails with the
key path.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir

from kimi_compile import ops
from kimi_compile.recipe import PassSpec, RecipeError, coerce_options

PASS_MODULES = {
    "cleanup": "kimi_compile.passes.cleanup",
    "infer_shapes": "kimi_compile.passes.infer_shapes",
    "fuse_indexer": "kimi_compile.passes.fuse_indexer",
    "fuse_sparse_mla": "kimi_compile.passes.fuse_sparse_mla",
    "fuse_kda": "kimi_compile.passes.fuse_kda",
    "fuse_moe": "kimi_compile.passes.fuse_moe",
    "fuse_attn_res": "kimi_compile.passes.fuse_attn_res",
    "quantize": "kimi_compile.passes.quantize",  # issue 5
    "relayout_nz": "kimi_compile.passes.relayout_nz",  # issue 5
}


class VerifyError(RuntimeError):
    pass


class KimiPass(ir.passes.InPlacePass):
    """Base class: subclasses set `name`, `version`, `Options` and implement `run(model) -> bool` (modified),
    recording what they did in `self.counts`."""

    name = "base"
    version = 1

    @dataclasses.dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options: Any = None):
        super().__init__()
        self.options = options if options is not None else self.Options()
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.counts = {}
        modified = self.run(model)
        return ir.passes.PassResult(model, bool(modified))

    def run(self, model: ir.Model) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


def pass_class(name: str) -> type[KimiPass]:
    mod = importlib.import_module(PASS_MODULES[name])
    cls = getattr(mod, "PASS")
    return cls


def resolve(passes: tuple[PassSpec, ...], source: str, precision: list[dict] | tuple = ()) -> list[KimiPass]:
    """Instantiate the enabled passes in recipe order, validating their options. A pass whose Options has a `rules`
    field (quantize) gets the recipe's precision rules there (`Recipe.to_dict()["precision"]`)."""
    out = []
    for i, spec in enumerate(passes):
        if spec.name not in PASS_MODULES:
            raise RecipeError(source, f"passes[{i}].name", f"unknown pass {spec.name!r}; known: {sorted(PASS_MODULES)}")
        if not spec.enabled:
            continue
        cls = pass_class(spec.name)
        options = dict(spec.options)
        if precision and "rules" in {f.name for f in dataclasses.fields(cls.Options)}:  # issue 5: precision rules
            options.setdefault("rules", [dict(r) for r in precision])
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
                if (ops.DOMAIN, node.op_type, "") not in model.functions:
                    raise VerifyError(f"{where}: node {node.name!r} ({ops.DOMAIN}.{node.op_type}) has no function body")
    proto = ir.to_proto(model)
    # weights in external files the checker cannot see from here are checked as typed graph inputs instead
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
    cached: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def options_dict(p: KimiPass) -> dict:
    return dataclasses.asdict(p.options)


def run_pipeline(model: ir.Model, passes: list[KimiPass], phase: str,
                 check: Callable[[ir.Model, str], None] | None = None) -> list[PassRecord]:
    """Run passes in order on one phase graph; verify before and after each; `check(model, pass_name)` (the --verify
    numerics) runs after each pass and raises on the first one that breaks tolerance."""
    verify_model(model, f"{phase}: traced graph")
    records = []
    for p in passes:
        before = len(model.graph)
        t0 = time.perf_counter()
        result = p(model)
        ms = (time.perf_counter() - t0) * 1e3
        model = result.model
        verify_model(model, f"{phase}: after pass {p.name}")
        if check is not None:
            check(model, p.name)
        records.append(PassRecord(p.name, p.version, phase, dict(p.counts), round(ms, 3), result.modified, before,
                                  len(model.graph)))
    return records
