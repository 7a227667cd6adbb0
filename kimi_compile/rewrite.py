"""Small helpers for fusion passes written as explicit graph walks: match (refusing with a reason), replace, tag.

A fusion pass subclasses `FusionPass`, yields anchor nodes, and for each anchor either returns a match or raises
`Refuse(reason)`. Refusals are counted per reason in the pass result (`refused.<reason>`), and with
`KIMI_COMPILE_DEBUG_FUSION=1` (or the pass option `debug: true`) each near miss is logged with the anchor node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.pipeline import KimiPass

log = logging.getLogger("kimi_compile.fusion")


class Refuse(Exception):
    """A candidate does not match; `reason` is a short stable key (it becomes a pass count)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def producer(v: ir.Value | None, op_type: str | tuple[str, ...], reason: str, domain: str = "") -> ir.Node:
    """The node producing `v`, which must be of `op_type`; else Refuse(reason)."""
    types = (op_type,) if isinstance(op_type, str) else op_type
    n = v.producer() if v is not None else None
    if n is None or n.op_type not in types or n.domain != domain:
        got = "a graph input or constant" if n is None else f"{n.domain + '.' if n.domain else ''}{n.op_type}"
        raise Refuse(reason, f"expected {'/'.join(types)} producing {v.name if v else None!r}, found {got}")
    return n


def const(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of `v` (initializer or Constant node), else None."""
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    n = v.producer()
    if n is not None and n.op_type == "Constant" and n.domain == "":
        attr = next(iter(n.attributes.values()))
        val = attr.value
        if isinstance(val, ir.TensorProtocol):
            return val.numpy()
        return np.asarray(val)
    return None


def attr(n: ir.Node, name: str, default: Any = None) -> Any:
    a = n.attributes.get(name)
    return default if a is None else a.value


def is_graph_input(v: ir.Value | None, graph: ir.Graph, name: str | None = None) -> bool:
    return v is not None and v in graph.inputs and (name is None or v.name == name)


def sole_consumer(v: ir.Value, reason: str) -> ir.Node:
    uses = list(v.uses())
    if len(uses) != 1:
        raise Refuse(reason, f"{v.name!r} has {len(uses)} consumers")
    return uses[0].node


def consumers(v: ir.Value) -> list[ir.Node]:
    return [u.node for u in v.uses()]


def replace_uses(old: ir.Value, new: ir.Value) -> None:
    ir.convenience.replace_all_uses_with(old, new)


class Builder:
    """Inserts new nodes before an anchor, in order."""

    def __init__(self, graph: ir.Graph, anchor: ir.Node, rule: str):
        self.graph, self.anchor, self.rule = graph, anchor, rule
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], attributes: dict | None = None,
           domain: str = "", num_outputs: int = 1, name: str | None = None) -> ir.Value | Sequence[ir.Value]:
        node = ir.node(op_type, list(inputs), attributes=attributes or {}, domain=domain, num_outputs=num_outputs,
                       name=name)
        if domain == DOMAIN:
            node.metadata_props["kimi.rule"] = self.rule
        for key in ("namespace", "pkg.torch.onnx.class_hierarchy"):  # keep the layer attribution (coverage)
            if key in self.anchor.metadata_props:
                node.metadata_props[key] = self.anchor.metadata_props[key]
        self.graph.insert_before(self.anchor, node)
        self.nodes.append(node)
        return node.outputs[0] if num_outputs == 1 else node.outputs

    def const(self, array: Any, dtype: Any = None) -> ir.Value:
        arr = np.asarray(array, dtype=dtype)
        return self.op("Constant", [], {"value": ir.tensor(arr)})


class FusionPass(KimiPass):
    """Base for fusions: `anchors(model)` -> candidates; `match(model, node)` -> data or Refuse;
    `rewrite(model, node, data)`. Dead nodes are removed afterwards; the result counts matches and refusals."""

    rule = "base"
    rewrite_each = True  # False: collect every match first, then rewrite_all (fusions that group matches)

    @dataclasses.dataclass(frozen=True)
    class Options:
        debug: bool = False

    def anchors(self, model: ir.Model) -> Iterable[ir.Node]:  # pragma: no cover - abstract
        raise NotImplementedError

    def match(self, model: ir.Model, node: ir.Node) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def rewrite(self, model: ir.Model, node: ir.Node, data: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def rewrite_all(self, model: ir.Model, found: list) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, model: ir.Model) -> bool:
        import onnx_ir.passes.common as common

        debug = getattr(self.options, "debug", False) or os.environ.get("KIMI_COMPILE_DEBUG_FUSION") == "1"
        matches, refused = 0, {}
        self.near_misses: list[dict] = []
        before = len(model.graph)
        found = []
        for node in list(self.anchors(model)):
            try:
                data = self.match(model, node)
            except Refuse as r:
                refused[r.reason] = refused.get(r.reason, 0) + 1
                self.near_misses.append({"anchor": node.name, "op": node.op_type, "reason": r.reason,
                                         "detail": r.detail})
                if debug:
                    log.warning("[%s] refused %s (%s): %s %s", self.name, node.name, node.op_type, r.reason, r.detail)
                continue
            if self.rewrite_each:
                self.rewrite(model, node, data)
            else:
                found.append((node, data))
            matches += 1
        if found:
            self.rewrite_all(model, found)
        common.RemoveUnusedNodesPass()(model)
        if matches:
            from kimi_compile.functions import attach_functions

            attach_functions(model)
        self.counts = {"matches": matches, "nodes_removed": before - len(model.graph),
                       **{f"refused.{k}": v for k, v in sorted(refused.items())}}
        log.info("[%s] matches=%d", self.name, matches)
        return matches > 0


__all__ = ["Builder", "FusionPass", "Refuse", "attr", "const", "consumers", "is_graph_input", "producer",
           "replace_uses", "sole_consumer", "onnx"]
