"""Small helpers for fusion passes written as explicit graph walks: match (refusing with a reason), replace, tag.

A fusion pass subclasses `FusionPass`, yields anchor nodes, and for each anchor either returns a match or raises
`Refuse(reason)`. Refusals are counted per reason in the pass result (`refused.<reason>`), and with
`KIMI_COMPILE_DEBUG_FUSION=1` (or the pass option `debug: true`) each near miss is logged with the anchor node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.passbase import KimiPass, PassStats
from kimi_compile.plugins.quant.reference import ELEM_BY_ONNX_TYPE, code_table

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


_LOW_FLOAT = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)


def stored_weight(v: ir.Value | None) -> ir.Value | None:
    """The bf16/fp16 initializer `w` when v = Cast(w, to=FLOAT) (a weight stored low by `quantize`), else None."""
    n = v.producer() if v is not None else None
    if n is None or n.op_type != "Cast" or n.domain != "" or attr(n, "to") != ir.DataType.FLOAT:
        return None
    w = n.inputs[0]
    if w is None or w.const_value is None or w.const_value.dtype not in _LOW_FLOAT:
        return None
    return w


def static_last(v: ir.Value) -> int | None:
    """The static size of v's last axis, else None."""
    if v.shape is None or len(v.shape) == 0:
        return None
    d = v.shape[-1]
    return d if isinstance(d, int) else None


def is_const(v: ir.Value | None) -> bool:
    """Whether const(v) would return a value, without materializing it (const() converts a stored bf16 weight to a
    new float32 array)."""
    if v is None:
        return False
    if v.const_value is not None or stored_weight(v) is not None:
        return True
    n = v.producer()
    return n is not None and n.op_type == "Constant" and n.domain == ""


def const(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of `v` (initializer, Constant node, or Cast to float32 of a bf16/fp16 initializer, which
    is exact), else None."""
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    low = stored_weight(v)
    if low is not None:  # Cast(bf16 -> float32) is exact
        return np.asarray(low.const_value.numpy()).astype(np.float32)
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


def weight_like(model: ir.Model, like: ir.Value | None, arr: np.ndarray, what: str) -> ir.Value:
    """A float32 weight derived from `like` (a transpose, split, ...) as a new initializer named by content, so
    prefill and decode share it. When `like` is a low-precision stored weight (Cast(bf16/fp16 initializer)), the
    new weight is stored in that dtype too (exact: its values came from it) and read through a Cast to float32."""
    g = model.graph
    arr = np.ascontiguousarray(np.asarray(arr, dtype=np.float32))
    low = stored_weight(like)
    digest = hashlib.sha1(arr.tobytes()).hexdigest()[:16]
    if low is None:
        name = f"kimi.{what}.{digest}"
        if name not in g.initializers:
            g.register_initializer(ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.FLOAT),
                                            const_value=ir.tensor(arr, name=name)))
        return g.initializers[name]
    dt = low.const_value.dtype
    name = f"kimi.{what}.{digest}.{dt.name.lower()}"
    if name not in g.initializers:
        stored = arr.astype(low.const_value.numpy().dtype)
        assert np.array_equal(stored.astype(np.float32), arr), f"{what}: derived weight is not exact in {dt.name}"
        v = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(dt), const_value=ir.tensor(stored, name=name))
        v.metadata_props.update(low.metadata_props)
        g.register_initializer(v)
    v = g.initializers[name]
    for u in v.uses():
        if u.node.op_type == "Cast" and u.node.graph is g:
            return u.node.outputs[0]
    cast = ir.node("Cast", [v], attributes={"to": ir.DataType.FLOAT}, name=f"{name}.cast")
    cast.metadata_props["kimi.rule"] = "quantize.projection_weight"
    cast.outputs[0].name = f"{name}.f32"
    cast.outputs[0].dtype, cast.outputs[0].shape = ir.DataType.FLOAT, ir.Shape(arr.shape)
    first = next(iter(g), None)
    if first is None:
        g.append(cast)
    else:
        g.insert_before(first, cast)
    return cast.outputs[0]


def quantized_read(v: ir.Value | None) -> dict | None:
    """The read of a quantized cache part, as emitted by `quantize`, else None:
        v = kimi.DequantizeMX|DequantizeFP8Tile(Cast(Gather(TABLE, Cast(PagedGather(P, bt), INT32)), to=FLOAT8),
                                                PagedGather(P.scale, bt))          (code_storage uint8)
        v = kimi.DequantizeMX|DequantizeFP8Tile(PagedGather(P, bt), PagedGather(P.scale, bt))  (P float8-typed)
    -> dict(kind "mx"|"tile", pool=P, scale_pool=P.scale, bt, block, elem "e4m3"|"e5m2")."""
    n = v.producer() if v is not None else None
    if n is None or n.domain != DOMAIN or n.op_type not in ("DequantizeMX", "DequantizeFP8Tile"):
        return None
    pg = n.inputs[0].producer()
    if pg is not None and pg.op_type == "PagedGather" and pg.domain == DOMAIN and pg.inputs[0] is not None and \
            pg.inputs[0].dtype is not None and pg.inputs[0].dtype.value in ELEM_BY_ONNX_TYPE:
        elem = ELEM_BY_ONNX_TYPE[pg.inputs[0].dtype.value]
    else:
        c8 = n.inputs[0].producer()
        if c8 is None or c8.op_type != "Cast" or c8.domain != "" or attr(c8, "to") not in ELEM_BY_ONNX_TYPE:
            return None
        elem = ELEM_BY_ONNX_TYPE[attr(c8, "to")]
        gat = c8.inputs[0].producer()
        if gat is None or gat.op_type != "Gather" or gat.domain != "" or attr(gat, "axis", 0) != 0:
            return None
        table = const(gat.inputs[0])
        if table is None or table.shape != (256,) or not np.array_equal(table, code_table(elem), equal_nan=True):
            return None
        ci = gat.inputs[1].producer()
        if ci is None or ci.op_type != "Cast" or attr(ci, "to") != ir.DataType.INT32:
            return None
        pg = ci.inputs[0].producer()
    sg = n.inputs[1].producer()
    if any(x is None or x.op_type != "PagedGather" or x.domain != DOMAIN for x in (pg, sg)) or \
            pg.inputs[1] is not sg.inputs[1]:
        return None
    kind = "mx" if n.op_type == "DequantizeMX" else "tile"
    block = int(attr(n, "block" if kind == "mx" else "tile", 32 if kind == "mx" else 128))
    return dict(kind=kind, pool=pg.inputs[0], scale_pool=sg.inputs[0], bt=pg.inputs[1], block=block, elem=elem)


def attach_overload(model: ir.Model, proto: onnx.FunctionProto) -> None:
    """Attach a function body variant (an ONNX function overload, picked by `node.overload`)."""
    key = (proto.domain, proto.name, proto.overload)
    if key not in model.functions:
        fn = ir.serde.deserialize_function(proto)
        model.functions[fn.identifier()] = fn


class Builder:
    """Inserts new nodes before an anchor, in order."""

    def __init__(self, graph: ir.Graph, anchor: ir.Node, rule: str):
        self.graph, self.anchor, self.rule = graph, anchor, rule
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], attributes: dict | None = None,
           domain: str = "", num_outputs: int = 1, name: str | None = None,
           overload: str = "") -> ir.Value | Sequence[ir.Value]:
        node = ir.node(op_type, list(inputs), attributes=attributes or {}, domain=domain, num_outputs=num_outputs,
                       name=name, overload=overload)
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


def _topologically_sorted(graph: ir.Graph) -> bool:
    seen: set[int] = set()
    for node in graph:
        for v in node.inputs:
            p = v.producer() if v is not None else None
            if p is not None and p.graph is graph and id(p) not in seen:
                return False
        seen.add(id(node))
    return True


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

    def debug(self) -> bool:
        """Near misses logged as warnings (option `debug` or KIMI_COMPILE_DEBUG_FUSION=1)."""
        return getattr(self.options, "debug", False) or os.environ.get("KIMI_COMPILE_DEBUG_FUSION") == "1"

    def refused(self, stats: PassStats, refused: dict[str, int], node: ir.Node, r: Refuse) -> None:
        """Count candidate `node`'s refusal by reason and keep it as a near miss."""
        refused[r.reason] = refused.get(r.reason, 0) + 1
        stats.near_misses.append({"anchor": node.name, "op": node.op_type, "reason": r.reason, "detail": r.detail})
        if self.debug():
            log.warning("[%s] refused %s (%s): %s %s", self.name, node.name, node.op_type, r.reason, r.detail)

    def finish(self, model: ir.Model, stats: PassStats, before: int, matches: int, refused: dict[str, int]) -> bool:
        """After the rewrites: dead nodes removed, topological order restored, function bodies attached, the counts
        (matches, nodes removed, refused.<reason>) recorded; whether anything matched."""
        import onnx_ir.passes.common as common

        common.RemoveUnusedNodesPass()(model)
        if matches and not _topologically_sorted(model.graph):  # a fused op may read a weight Cast placed later
            model.graph.sort()
        if matches:
            from kimi_compile.functions import attach_functions

            attach_functions(model)
        stats.counts.update({"matches": matches, "nodes_removed": before - len(model.graph),
                             **{f"refused.{k}": v for k, v in sorted(refused.items())}})
        log.info("[%s] matches=%d", self.name, matches)
        return matches > 0

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        matches, refused = 0, {}
        before = len(model.graph)
        found = []
        for node in list(self.anchors(model)):
            try:
                data = self.match(model, node)
            except Refuse as r:
                self.refused(stats, refused, node, r)
                continue
            if self.rewrite_each:
                self.rewrite(model, node, data)
            else:
                found.append((node, data))
            matches += 1
        if found:
            self.rewrite_all(model, found)
        return self.finish(model, stats, before, matches, refused)


__all__ = ["Builder", "FusionPass", "Refuse", "attach_overload", "attr", "const", "consumers", "is_graph_input",
           "producer", "quantized_read", "replace_uses", "sole_consumer", "stored_weight", "weight_like", "onnx"]
