"""Per-op TensorRT lowering of `kimi.*` nodes, chosen per op and per TensorRT flavour.

Every op folder may hold a `tensorrt.py` with a table ``TENSORRT = {op_name: {flavour: Lowering}}`` (flavour is
``tensorrt`` or ``tensorrt_rtx``). Two kinds of lowering exist:

    Native(reason)                  the op's ONNX function body is inlined into the graph, so the TensorRT ONNX
                                    parser builds native layers for it (Scan -> ILoop, ScatterND -> IScatterLayer,
                                    TopK -> ITopKLayer, MatMul, Gather, ...). Node names are `<kimi node>/<body node>`,
                                    so a parser or builder error inside the body still names the kimi node.
    Plugin(name, reason, otherwise) the node stays one node, rewritten for the parser's fallback plugin importer
                                    (op_type = plugin name, attrs plugin_namespace="kimi", plugin_version, aot=1 for
                                    the quickly-deployable AOT form). Chosen only when a creator `kimi::<name>` is
                                    registered in this TensorRT's plugin registry; otherwise `otherwise` (a Native
                                    lowering) is used and the record says why. `status` says whether this project
                                    ships the plugin: "planned" (not implemented: only a creator registered from
                                    elsewhere can be picked) or "available"; records and the build's
                                    `plugins_planned` show a planned plugin as "planned (not implemented)".

An op without a `tensorrt.py` entry gets Native with source "default" (new op = new folder; this module never grows
a branch per op). Recipe option `lowering: {Op: native|plugin}` overrides the table; forcing `plugin` for an op
whose plugin is not registered is an error naming the op.

`lower_model(model_proto, flavour, registry_has)` returns the lowered proto, one record per kimi node and an origin
map {onnx node name -> kimi node} used to name the kimi node behind a parser or builder error.

Imports no tensorrt: the backend passes `registry_has(name, version, namespace) -> bool`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import onnx
from onnx import AttributeProto

from kimi_compile import ops

from kimi_compile.lowering import (  # noqa: F401  (the table vocabulary, re-exported for the backend)
    DEFAULT,
    FLAVOURS,
    NAMESPACE,
    PLANNED,
    PLUGIN_STATUSES,
    Lowering,
    LoweringError,
    Native,
    Plugin,
)


def lowering_tables() -> dict[str, dict[str, Lowering]]:
    """{op name: {flavour: Lowering}} from every plugins/<op>/tensorrt.py (imported once)."""
    ops.ensure_loaded()
    out: dict[str, dict[str, Lowering]] = {}
    for mod in ops.plugin_modules("tensorrt"):
        name = mod.__name__
        for op, per in getattr(mod, "TENSORRT", {}).items():
            for flavour, low in per.items():
                if flavour not in FLAVOURS:
                    raise LoweringError(f"{name}: op {op}: unknown TensorRT flavour {flavour!r}; expected {FLAVOURS}")
                if not isinstance(low, (Native, Plugin)):
                    raise LoweringError(f"{name}: op {op} ({flavour}): expected Native(...) or Plugin(...), "
                                        f"got {low!r}")
            out.setdefault(op, {}).update(per)
    return out


def table_fingerprint(flavour: str) -> dict[str, Any]:
    """What of the lowering tables determines an engine (part of the backend cache key)."""
    def desc(low: Lowering) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(low).items() if k not in ("rewrite", "otherwise", "status")}
        if isinstance(low, Plugin):
            d["otherwise"] = desc(low.otherwise)
        elif low.rewrite is not None:
            d["rewrite"] = f"{low.rewrite.__module__}.{low.rewrite.__qualname__}"
        return d

    return {op: desc(per[flavour]) for op, per in sorted(lowering_tables().items()) if flavour in per}


def planned_plugins(flavour: str) -> list[str]:
    """The plugins the tables declare for `flavour` that this project does not implement yet, as shown in records."""
    return sorted(f"{NAMESPACE}::{low.name} ({low.shown_status})" for per in lowering_tables().values()
                  if isinstance(low := per.get(flavour), Plugin) and low.status == "planned")


def choose(op: str, flavour: str, registry_has: Callable[[str, str, str], bool],
           overrides: Mapping[str, str] | None = None, *, node: str = "") -> tuple[Lowering, dict[str, Any]]:
    """The lowering of one op for `flavour` and a record {kind, reason, source, ...} saying why."""
    per = lowering_tables().get(op, {})
    low, source = (per[flavour], f"plugins/{_folder(op)}/tensorrt.py") if flavour in per else (DEFAULT, "default")
    forced = (overrides or {}).get(op)
    if forced not in (None, "native", "plugin"):
        raise LoweringError(f"backend.options.lowering.{op}: expected 'native' or 'plugin', got {forced!r}")
    if forced == "native" and isinstance(low, Plugin):
        low, source = low.otherwise, "recipe backend.options.lowering"
    elif forced == "plugin":
        if not isinstance(low, Plugin):
            raise LoweringError(f"kimi.{op} (node {node!r}): backend.options.lowering forces a plugin, but no "
                                f"TensorRT plugin is declared for it ({flavour}); remove the override")
        if not registry_has(low.name, low.plugin_version, NAMESPACE):
            raise LoweringError(f"kimi.{op} (node {node!r}): backend.options.lowering forces plugin "
                                f"{NAMESPACE}::{low.name} v{low.plugin_version} ({low.shown_status}), which is not "
                                f"registered in {flavour}'s plugin registry; register it or remove the override")
        source = "recipe backend.options.lowering"
    rec: dict[str, Any] = {"source": source}
    if isinstance(low, Plugin):
        rec["plugin_status"] = low.shown_status
        if registry_has(low.name, low.plugin_version, NAMESPACE):
            rec.update(kind="plugin", plugin=f"{NAMESPACE}::{low.name}", plugin_version=low.plugin_version,
                       aot=low.aot, reason=low.reason)
            return low, rec
        rec["fallback_from"] = (f"plugin {NAMESPACE}::{low.name} v{low.plugin_version} ({low.shown_status}) is not "
                                f"registered in {flavour}'s plugin registry")
        low = low.otherwise
    rec.update(kind="native", reason=low.reason)
    return low, rec


def _folder(op: str) -> str:
    for o in ops.registered():
        if o.name == op:
            mod = getattr(o.function, "__module__", "") or getattr(o.infer, "__module__", "")
            parts = mod.split(".")
            if len(parts) >= 3 and parts[1] == "plugins":
                return parts[2]
    return op


# ---- inlining ------------------------------------------------------------------------------------------------------


def _defined_in(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for n in graph.node:
        names.update(o for o in n.output if o)
    return names


def _rename_subgraph(graph: onnx.GraphProto, outer: Mapping[str, str], prefix: str,
                     attrs: Mapping[str, AttributeProto], defaults: Mapping[str, AttributeProto]) -> None:
    """In a body subgraph: rename references to outer function values and prefix node names."""
    local = _defined_in(graph)
    for k, n in enumerate(graph.node):
        n.name = f"{prefix}/{n.name or f'{n.op_type}_{k}'}"
        for i, x in enumerate(n.input):
            if x and x not in local and x in outer:
                n.input[i] = outer[x]
        _resolve_attrs(n, attrs, defaults)
        for a in n.attribute:
            inner = {k: v for k, v in outer.items() if k not in local}
            if a.type == AttributeProto.GRAPH:
                _rename_subgraph(a.g, inner, prefix, attrs, defaults)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    _rename_subgraph(g, inner, prefix, attrs, defaults)
    for o in graph.output:
        if o.name not in local and o.name in outer:
            o.name = outer[o.name]


def _resolve_attrs(n: onnx.NodeProto, attrs: Mapping[str, AttributeProto],
                   defaults: Mapping[str, AttributeProto]) -> None:
    keep = []
    for a in n.attribute:
        if a.ref_attr_name:
            src = attrs.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
            if src is None:
                continue  # unset optional attribute: the op's own default applies
            b = copy.deepcopy(src)
            b.name = a.name
            keep.append(b)
        else:
            keep.append(a)
    del n.attribute[:]
    n.attribute.extend(keep)


def inline_call(node: onnx.NodeProto, fn: onnx.FunctionProto) -> list[onnx.NodeProto]:
    """The body of `fn` instantiated for `node`: formals bound to the node's inputs/outputs, every other value and
    node renamed `<node.name>/<name>`, attribute references resolved (call site, then the function's defaults)."""
    prefix = node.name or f"{node.op_type}_{id(node)}"
    bind: dict[str, str] = {}
    for i, formal in enumerate(fn.input):
        bind[formal] = node.input[i] if i < len(node.input) else ""
    for i, formal in enumerate(fn.output):
        bind[formal] = node.output[i] if i < len(node.output) else f"{prefix}/{formal}"
    for n in fn.node:
        for x in n.output:
            if x and x not in bind:
                bind[x] = f"{prefix}/{x}"
    attrs = {a.name: a for a in node.attribute}
    defaults = {a.name: a for a in fn.attribute_proto}
    out = []
    for k, src in enumerate(fn.node):
        n = copy.deepcopy(src)
        n.name = f"{prefix}/{src.name or f'{src.op_type}_{k}'}"
        n.input[:] = [bind.get(x, x) if x else "" for x in n.input]
        n.output[:] = [bind.get(x, x) if x else "" for x in n.output]
        _resolve_attrs(n, attrs, defaults)
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                _rename_subgraph(a.g, bind, n.name, attrs, defaults)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    _rename_subgraph(g, bind, n.name, attrs, defaults)
        out.append(n)
    return out


def _node_names(n: onnx.NodeProto) -> list[str]:
    """The node's name and the names of every node in its subgraphs (Scan/Loop/If bodies)."""
    out = [n.name]
    for a in n.attribute:
        for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
            for k in g.node:
                out.extend(_node_names(k))
    return out


def _plugin_node(node: onnx.NodeProto, low: Plugin) -> onnx.NodeProto:
    n = copy.deepcopy(node)
    n.op_type, n.domain = low.name, NAMESPACE
    n.attribute.extend([onnx.helper.make_attribute("plugin_namespace", NAMESPACE),
                        onnx.helper.make_attribute("plugin_version", low.plugin_version)])
    if low.aot:
        n.attribute.append(onnx.helper.make_attribute("aot", 1))
    return n


def _function_body(model: onnx.ModelProto, op: str, node: str, overload: str = "") -> onnx.FunctionProto:
    """The body the node calls: (domain, name, overload) must all match (quantized formats are overloads)."""
    for f in model.functions:
        if f.domain == ops.DOMAIN and f.name == op and f.overload == overload:
            return f
    if overload:
        raise LoweringError(f"kimi.{op} (node {node!r}): the model has no body for overload {overload!r}")
    o = ops.lookup(op, node=node)
    if o.function is None:
        raise LoweringError(f"kimi.{op} (node {node!r}): lowered natively, but the op has no ONNX function body; "
                            f"give plugins/{_folder(op)}/ a function body or a TensorRT plugin")
    p = o.function()
    return p if isinstance(p, onnx.FunctionProto) else p.to_function_proto()


def lower_model(model: onnx.ModelProto, flavour: str, registry_has: Callable[[str, str, str], bool],
                overrides: Mapping[str, str] | None = None
                ) -> tuple[onnx.ModelProto, list[dict[str, Any]], dict[str, dict[str, str]]]:
    """Lower every kimi node of the main graph (nested calls inside bodies too).

    Returns (lowered model, [{node, op, kind, reason, source, body_nodes, ...}], origin {onnx node name ->
    {"node", "op"}} for every node that came out of a kimi node's lowering)."""
    if flavour not in FLAVOURS:
        raise LoweringError(f"unknown TensorRT flavour {flavour!r}; expected one of {FLAVOURS}")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    records: list[dict[str, Any]] = []
    origin: dict[str, dict[str, str]] = {}
    nodes = list(m.graph.node)
    for _round in range(16):  # nested kimi calls inside function bodies
        out, again = [], False
        for n in nodes:
            if n.domain != ops.DOMAIN:
                out.append(n)
                continue
            root = origin.get(n.name, {"node": n.name, "op": n.op_type})
            ops.lookup(n.op_type, node=n.name)
            low, rec = choose(n.op_type, flavour, registry_has, overrides, node=n.name)
            if isinstance(low, Plugin):
                out.append(_plugin_node(n, low))
                origin[n.name] = root
                body = 1
            else:
                fn = _function_body(m, n.op_type, n.name, getattr(n, "overload", ""))
                for opset in fn.opset_import:
                    have = {o.domain: o.version for o in m.opset_import}
                    if opset.domain in have and have[opset.domain] != opset.version and opset.domain != ops.DOMAIN:
                        raise LoweringError(f"kimi.{n.op_type} (node {n.name!r}): its ONNX body uses opset "
                                            f"{opset.domain or 'ai.onnx'} {opset.version}, the graph "
                                            f"{have[opset.domain]}; rebuild the body at the graph's opset")
                    if opset.domain not in have:
                        m.opset_import.append(copy.deepcopy(opset))
                new = inline_call(n, fn)
                if low.rewrite is not None:
                    new = low.rewrite(n, new)
                for b in new:
                    for name in _node_names(b):
                        origin[name] = root
                    again |= b.domain == ops.DOMAIN
                out.extend(new)
                body = len(new)
            if n.name == root["node"]:
                records.append({"node": n.name, "op": f"{ops.DOMAIN}.{n.op_type}", **rec, "body_nodes": body})
        nodes = out
        if not again:
            break
    else:
        raise LoweringError("kimi function bodies nest more than 16 levels deep (a cycle?)")
    del m.graph.node[:]
    m.graph.node.extend(fold_string_constants(nodes))
    still = {(n.domain, n.op_type) for n in nodes if n.domain == ops.DOMAIN}
    keep = [f for f in m.functions if f.domain != ops.DOMAIN]  # the parser must not expand a plugin node's body
    del m.functions[:]
    m.functions.extend(keep)
    if not still:
        kept = [o for o in m.opset_import if o.domain != ops.DOMAIN]
        del m.opset_import[:]
        m.opset_import.extend(kept)
    return m, records, origin


def _string_value(n: onnx.NodeProto) -> str | None:
    if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
        for a in n.attribute:
            if a.name == "value_string":
                return a.s.decode()
    return None


def fold_string_constants(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`Equal(Constant(value_string=a), Constant(value_string=b))` -> `Constant(a == b)`, then drop unused string
    Constants: bodies select a variant by comparing a string attribute, and TensorRT has no string tensors."""
    strings = {n.output[0]: v for n in nodes if (v := _string_value(n)) is not None}
    if not strings:
        return nodes
    out = []
    for n in nodes:
        if n.op_type == "Equal" and n.domain in ("", "ai.onnx") and all(x in strings for x in n.input):
            val = onnx.helper.make_tensor(n.output[0], onnx.TensorProto.BOOL, [],
                                          [strings[n.input[0]] == strings[n.input[1]]])
            n = onnx.helper.make_node("Constant", [], [n.output[0]], name=n.name, value=val)
        out.append(n)
    used = {x for n in out for x in n.input}

    def sub_uses(g: onnx.GraphProto) -> None:
        for k in g.node:
            used.update(k.input)
            for a in k.attribute:
                for sg in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                    sub_uses(sg)

    for n in out:
        for a in n.attribute:
            for sg in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                sub_uses(sg)
    return [n for n in out if not (n.output and n.output[0] in strings and n.output[0] not in used)]


def blame(text: str, origin: Mapping[str, Mapping[str, str]], graph_nodes: Mapping[str, str]) -> list[str]:
    """Which ONNX nodes (and the kimi node each came from) a TensorRT message mentions, longest names first."""
    found, seen = [], set()
    for name in sorted(set(origin) | set(graph_nodes), key=len, reverse=True):
        if name and name in text and not any(name in s for s in seen):
            seen.add(name)
            found.append(describe_node(name, origin, graph_nodes))
    return found


def describe_node(name: str, origin: Mapping[str, Mapping[str, str]], graph_nodes: Mapping[str, str]) -> str:
    op = graph_nodes.get(name, "?")
    if name in origin:
        root = origin[name]
        if root["node"] == name:
            return f"node {name!r} (kimi.{root['op']})"
        return f"node {name!r} ({op}), lowered from node {root['node']!r} (kimi.{root['op']})"
    return f"node {name!r} ({op})"
