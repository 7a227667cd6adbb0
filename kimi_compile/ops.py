"""The op registry: every `kimi.*` op is defined once, in its plugins/<op>/ folder, and registered here.

A plugin module calls `register(OpDef(...))` at import time. `lookup("IndexerTopK")` returns the definition or raises
`UnknownOpError` naming the node; `ensure_loaded()` imports every plugin package once. Backends and passes look ops up
here and never grow a branch per op (DESIGN.md §3, "Ops").

An OpDef carries:
- the schema: domain ``kimi``, name, version, input/output names, attributes with defaults;
- ``function``: a zero-argument callable returning the ONNX FunctionProto body (plugins/<op>/body.py, standard ops)
  that ONNX Runtime inlines; its default-domain opset must equal ``ONNX_OPSET``;
- ``infer``: shape and dtype inference, ``infer(input_types, attrs) -> [TensorType, ...]``;
- ``reference``: a numpy or torch reference with the same semantics, for tests and verification;
- ``kind``: who puts the op in a graph, one of KINDS: "fused" (a pass, in place of standard ops: fusions and
  relayouts; op coverage counts these), "primitive" (the trace: what tracing cannot express, such as paged cache
  reads and writes), "quant" (the quantize pass: quantize / dequantize / fake-quant), "partition" (a partition
  pass, in the per-rank graphs of a partitioned artifact only, between explicit collectives: ONNX Runtime refuses
  those artifacts, so such an op may have no ONNX body; its reference and its cuda kernel define it).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any

DOMAIN = "kimi"
ONNX_OPSET = 23  # default-domain opset of traced graphs and of every function body
KINDS = ("fused", "primitive", "quant", "partition")


class UnknownOpError(KeyError):
    """A `kimi.*` node names an op that no plugin registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class TensorType:
    """Shape (ints for static dims, strings for symbolic ones, None for unknown) and ONNX element type."""

    shape: tuple[int | str | None, ...] | None
    dtype: int  # onnx.TensorProto.DataType value


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)
    function: Callable[[], Any] | None = None
    infer: Callable[[Sequence[TensorType | None], dict[str, Any]], list[TensorType]] | None = None
    reference: Callable[..., Any] | None = None
    version: int = 1
    domain: str = DOMAIN
    doc: str = ""
    float32_ports: frozenset[str] = frozenset()  # inputs/outputs that stay float32 in a bf16/fp16 graph (states)
    kind: str = "fused"  # one of KINDS

    @property
    def qualified(self) -> str:
        return f"{self.domain}.{self.name}"


PLUGINS = "kimi_compile.plugins"
_REGISTRY: dict[tuple[str, str], OpDef] = {}
_LOADED = False


def register(op: OpDef) -> OpDef:
    if op.kind not in KINDS:
        raise ValueError(f"op {op.qualified}: kind must be one of {KINDS}, got {op.kind!r}")
    key = (op.domain, op.name)
    old = _REGISTRY.get(key)
    if old is not None and old is not op and old.version != op.version:
        raise ValueError(f"op {op.qualified} registered twice with versions {old.version} and {op.version}")
    _REGISTRY[key] = op
    return op


def _plugins_package():
    """The plugins package, found by name: the registry discovers plugins (which import it), never the reverse."""
    return importlib.import_module(PLUGINS)


def ensure_loaded() -> None:
    """Import every plugin package so that its ops are registered."""
    global _LOADED
    if _LOADED:
        return
    for info in pkgutil.iter_modules(_plugins_package().__path__):
        if info.ispkg:
            importlib.import_module(f"kimi_compile.plugins.{info.name}")
    _LOADED = True


def plugin_modules(submodule: str) -> list:
    """Import `kimi_compile.plugins.<op>.<submodule>` for every plugin folder that has it (e.g. "tensorrt")."""
    mods = []
    for info in pkgutil.iter_modules(_plugins_package().__path__):
        if not info.ispkg:
            continue
        name = f"kimi_compile.plugins.{info.name}.{submodule}"
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    return mods


def lookup(name: str, domain: str = DOMAIN, *, node: str | None = None) -> OpDef:
    ensure_loaded()
    op = _REGISTRY.get((domain, name))
    if op is None:
        where = f" (node {node!r})" if node else ""
        known = ", ".join(sorted(n for d, n in _REGISTRY if d == domain)) or "none"
        raise UnknownOpError(f"unknown op {domain}.{name}{where}: no plugin registers it; known {domain} ops: {known}")
    return op


def registered() -> list[OpDef]:
    ensure_loaded()
    return sorted(_REGISTRY.values(), key=lambda o: o.qualified)


def kernels(table: str) -> dict:
    """Every op folder's `<table>` dict (e.g. "CUDA" from plugins/<op>/cuda.py), merged: {op name: Kernel}."""
    out: dict[str, Kernel] = {}
    for mod in plugin_modules(table.lower()):
        for name, k in getattr(mod, table, {}).items():
            lookup(name)  # a table may only name registered ops
            out[name] = k
    return out
