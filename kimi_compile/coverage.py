"""Op coverage: per layer kind and component, which computations run as fused `kimi.*` ops and which remain as
fallback decompositions in standard ops, and the share of the traced nodes now inside fused ops.

Fused ops are the registry's ops of kind "fused" (kimi_compile/ops.py). The trace's primitives (kind "primitive":
paged cache reads and writes, the KDA recurrence) and the quantize pass's ops (kind "quant") are neither fused nor
fallback: like the shape plumbing, they are left out of both counts.

Nodes are attributed through the exporter's `namespace` metadata (module path and class of every node); fused nodes
inherit it from the node they replaced. Layer kinds: kda, mla, mla+indexer; `model` for embedding, final mix, norm,
head. Components: attention, indexer, attn_res, moe, mlp, norm, other.
"""

from __future__ import annotations

import re

import onnx_ir as ir

from kimi_compile import ops

_LAYER = re.compile(r"model\.model\.layers\.(\d+)")
_COMPONENT = [("Indexer", "indexer"), ("KimiDeltaAttention", "attention"), ("KimiMLAAttention", "attention"),
              ("AttnResMix", "attn_res"), ("LatentMoE", "moe"), ("GatedMLP", "mlp"), ("RMSNorm", "norm")]
_STRUCTURAL = {"Constant", "Shape", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Cast"}


def attribute(node: ir.Node, cfg) -> tuple[str, str]:
    ns = node.metadata_props.get("namespace", "")
    m = _LAYER.search(ns)
    if m is None:
        kind = "model"
    else:
        i = int(m.group(1))
        kind = "kda" if cfg.is_kda(i) else ("mla+indexer" if cfg.has_indexer(i) else "mla")
    comp = "other"
    for cls, name in _COMPONENT:
        if cls in ns:
            comp = name
            break
    return kind, comp


def layer_of(node: ir.Node, cfg) -> tuple[int | None, str]:
    """(decoder layer index or None, its kind: kda / mla+indexer / mla / model) from the node's namespace."""
    m = _LAYER.search(node.metadata_props.get("namespace", ""))
    if m is None:
        return None, "model"
    i = int(m.group(1))
    return i, "kda" if cfg.is_kda(i) else ("mla+indexer" if cfg.has_indexer(i) else "mla")


def stream_layers(model: ir.Model, plan: dict, cfg) -> list[dict]:
    """The stream plan per decoder layer (first layer of each kind first, then the rest by index): nodes, nodes off
    the main stream, streams used, the layer's cost on one stream (sum of its nodes' modelled costs) and its span
    on N (first start to last end in the list schedule); the first layer of each kind keeps its schedule rows
    [node, stream, start_us, end_us, op] for a Gantt chart."""
    rows = {r[0]: r for r in plan.get("schedule", [])}
    by_layer: dict[int, dict] = {}
    for n in model.graph:
        r = rows.get(n.name)
        i, kind = layer_of(n, cfg)
        if r is None or i is None:
            continue
        d = by_layer.setdefault(i, {"layer": i, "kind": kind, "rows": []})
        d["rows"].append(r)
    out, seen = [], set()
    for i in sorted(by_layer):
        d = by_layer[i]
        rs = d["rows"]
        row = {"layer": i, "kind": d["kind"], "nodes": len(rs), "side_nodes": sum(1 for r in rs if r[1]),
               "streams": len({r[1] for r in rs}), "one_stream_us": round(sum(r[3] - r[2] for r in rs), 3),
               "n_streams_us": round(max(r[3] for r in rs) - min(r[2] for r in rs), 3)}
        if d["kind"] not in seen:
            seen.add(d["kind"])
            row["schedule"] = rs
        out.append(row)
    return sorted(out, key=lambda r: ("schedule" not in r, r["layer"]))


def fused_ops() -> set[str]:
    """Names of the registered `kimi.*` ops that a pass puts in place of standard ops (kind "fused")."""
    return {o.name for o in ops.registered() if o.domain == ops.DOMAIN and o.kind == "fused"}


def _count(model: ir.Model, cfg, fused: bool) -> dict[tuple[str, str], dict[str, int]]:
    out: dict[tuple[str, str], dict[str, int]] = {}
    fused_names = fused_ops()
    for n in model.graph:
        if n.op_type in _STRUCTURAL and n.domain == "":
            continue
        if n.domain == ops.DOMAIN and n.op_type not in fused_names:
            continue  # a primitive of the trace or a quantize op: neither fused nor a fallback
        is_fused = n.domain == ops.DOMAIN
        if is_fused != fused:
            continue
        key = attribute(n, cfg)
        name = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
        out.setdefault(key, {})
        out[key][name] = out[key].get(name, 0) + 1
    return out


def coverage(traced: ir.Model, final: ir.Model, cfg) -> dict:
    """{"by_component": [{layer_kind, component, fused_ops, fallback_ops, traced_nodes, coverage_pct}], "total_pct"}"""
    before = _count(traced, cfg, fused=False)
    fused = _count(final, cfg, fused=True)
    fallback = _count(final, cfg, fused=False)
    rows = []
    tot_before = tot_left = 0
    for key in sorted(set(before) | set(fused) | set(fallback)):
        n_before = sum(before.get(key, {}).values())
        n_left = sum(fallback.get(key, {}).values())
        tot_before += n_before
        tot_left += min(n_left, n_before)
        rows.append({"layer_kind": key[0], "component": key[1], "fused_ops": fused.get(key, {}),
                     "fallback_ops": fallback.get(key, {}), "traced_nodes": n_before,
                     "coverage_pct": round(100.0 * (1 - n_left / n_before), 1) if n_before else 0.0})
    return {"by_component": rows,
            "total_pct": round(100.0 * (1 - tot_left / tot_before), 1) if tot_before else 0.0,
            "metric": "share of the traced compute nodes (shape plumbing and kimi primitives excluded) now inside "
                      "fused kimi.* ops"}
