"""Rendering an artifact's manifest for people: report.md (summary, versions, pass log, graphs, cache layouts,
precision plan, quantized accuracy, op coverage, compile cache, files).

`REPORTS` maps each report file to its renderer; the build hands it to `ArtifactWriter`, which writes the reports
after the manifest is final. Renderers take any manifest (missing or odd sections render as empty), import no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}" if math.isfinite(value) else str(value)
    elif isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, separators=(", ", ": "))
    elif value is None:
        text = ""
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return _cell(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _named(section: Any) -> list[tuple[str, Any]]:
    """{name: info} or [{name: ..., ...}] -> [(name, info)]."""
    if isinstance(section, Mapping):
        return [(str(k), v) for k, v in section.items()]
    if isinstance(section, (list, tuple)):
        return [(str(item.get("name", i)) if isinstance(item, Mapping) else str(i), item) for i, item in
                enumerate(section)]
    return []


def _io_rows(items: Any) -> list[list[Any]]:
    rows = []
    for name, info in _named(items):
        if isinstance(info, Mapping):
            shape = info.get("shape")
            rows.append([info.get("name", name), info.get("dtype", ""), "[" + ", ".join(map(str, shape)) + "]"
                         if isinstance(shape, (list, tuple)) else _cell(shape)])
        else:
            rows.append([name, _cell(info), ""])
    return rows


def render_report(manifest: Mapping[str, Any]) -> str:
    """report.md for `manifest`: summary, versions, pass log, graphs, cache layouts, precision plan, files."""
    recipe = manifest.get("recipe") if isinstance(manifest.get("recipe"), Mapping) else {}
    model = recipe.get("model") if isinstance(recipe.get("model"), Mapping) else {}
    backend = manifest.get("backend") if isinstance(manifest.get("backend"), Mapping) else recipe.get("backend", {})
    files = manifest.get("files") if isinstance(manifest.get("files"), Mapping) else {}
    title = recipe.get("name") or manifest.get("name") or "artifact"
    out = [f"# kimi-compile artifact: {title}", ""]

    summary = [
        ["model", model.get("preset") or model.get("checkpoint") or ""],
        ["dtype", model.get("dtype", "")],
        ["backend", backend.get("name", "") if isinstance(backend, Mapping) else backend],
        ["target", (backend.get("target") if isinstance(backend, Mapping) else None) or recipe.get("target", "")],
        ["schema version", manifest.get("schema_version", "")],
        ["files", f"{len(files)} ({_human_bytes(sum(f.get('bytes', 0) for f in files.values()))})"],
    ]
    tool = manifest.get("tool")
    if isinstance(tool, Mapping):
        summary.insert(0, ["built by", f"{tool.get('name', 'kimi-compile')} {tool.get('version', '')}".strip()])
    out += ["## Summary", ""] + _table(["", "value"], [r for r in summary if r[1] not in ("", None)])

    versions = manifest.get("versions")
    if isinstance(versions, Mapping) and versions:
        out += ["## Versions", ""] + _table(["library", "version"], [[k, v] for k, v in versions.items()])

    passes = manifest.get("pass_log")
    if isinstance(passes, (list, tuple)) and passes:
        rows, total_ms = [], 0.0
        for i, p in enumerate(passes):
            if not isinstance(p, Mapping):
                rows.append([i, _cell(p), "", "", "", "", ""])
                continue
            counts = p.get("counts", {})
            counts_text = ", ".join(f"{k}={v}" for k, v in counts.items()) if isinstance(counts, Mapping) else counts
            ms = p.get("ms")
            if isinstance(ms, (int, float)) and not isinstance(ms, bool):
                total_ms += ms
                ms = f"{ms:.1f}"
            cached = p.get("cached")
            nodes = f"{p['nodes_before']} -> {p['nodes_after']}" if "nodes_before" in p and "nodes_after" in p else ""
            rows.append([i, p.get("name", p.get("pass", "")), p.get("version", ""), p.get("phase", ""),
                         counts_text, nodes, ms,
                         {True: "hit", False: "miss"}.get(cached, "") if cached is not None else ""])
        out += [f"## Passes ({len(passes)}, {total_ms:.1f} ms)", ""]
        out += _table(["#", "pass", "version", "phase", "counts", "nodes", "ms", "cache"], rows)

    graphs = manifest.get("graphs")
    if isinstance(graphs, Mapping) and graphs:
        out += ["## Graphs", ""]
        for phase, g in graphs.items():
            if not isinstance(g, Mapping):
                continue
            head = f"### {phase}"
            if g.get("file"):
                head += f" (`{g['file']}`)"
            out += [head, ""]
            if "node_count" in g:
                out += [f"{g['node_count']} nodes", ""]
            for kind in ("inputs", "outputs"):
                if g.get(kind):
                    out += [f"{kind.capitalize()}:", ""] + _table(["name", "dtype", "shape"], _io_rows(g[kind]))
            hist = g.get("op_histogram")
            if isinstance(hist, Mapping) and hist:
                ranked = sorted(hist.items(), key=lambda kv: (-kv[1] if isinstance(kv[1], (int, float)) else 0,
                                                              str(kv[0])))
                out += ["Op histogram:", ""] + _table(["op", "count"], [[k, v] for k, v in ranked])

    layouts = manifest.get("cache_layouts")
    named = _named(layouts)
    if named:
        infos = [(name, info if isinstance(info, Mapping) else {"value": info}) for name, info in named]
        per_seq = any("bytes_per_sequence" in info for _, info in infos)
        rows, total, total_seq = [], 0, 0
        for name, info in infos:
            bpt, bps = info.get("bytes_per_token"), info.get("bytes_per_sequence")
            if isinstance(bpt, (int, float)) and not isinstance(bpt, bool):
                total += bpt
            if isinstance(bps, (int, float)) and not isinstance(bps, bool):
                total_seq += bps
            shape = info.get("shape")
            row = [name, info.get("kind", ""), info.get("dtype", ""), "[" + ", ".join(map(str, shape)) + "]"
                   if isinstance(shape, (list, tuple)) else _cell(shape), bpt]
            rows.append(row + [bps] if per_seq else row)
        headers = ["cache", "kind", "dtype", "shape", "bytes/token"] + (["bytes/sequence"] if per_seq else [])
        out += ["## Cache layouts", ""] + _table(headers, rows)
        total_text = f"Total: {total:g} bytes per token"
        out += [total_text + (f", {total_seq:g} bytes per sequence." if per_seq else "."), ""]

    plan = manifest.get("precision_plan")
    if isinstance(plan, (list, tuple)) and plan:
        rows = []
        for r in plan:
            if not isinstance(r, Mapping):
                rows.append([_cell(r), "", "", ""])
                continue
            opts = r.get("options", {})
            tensors = r.get("tensors", r.get("count", ""))
            if isinstance(tensors, (list, tuple)):
                tensors = len(tensors)
            rows.append([r.get("role", ""), r.get("format", ""),
                         ", ".join(f"{k}={v}" for k, v in opts.items()) if isinstance(opts, Mapping) else opts,
                         tensors])
        out += ["## Precision plan", ""] + _table(["role", "format", "options", "tensors"], rows)
    elif isinstance(plan, (list, tuple)):
        out += ["## Precision plan", "", "All tensors in the model dtype (no precision rules).", ""]

    accuracy = manifest.get("accuracy")  # issue 5: quantized vs unquantized (kimi_compile/accuracy.py)
    if isinstance(accuracy, Mapping) and accuracy:
        out += [_accuracy(accuracy)]

    coverage = manifest.get("op_coverage")
    if isinstance(coverage, Mapping) and coverage:
        rows = [[op, info if not isinstance(info, Mapping) else
                 ", ".join(f"{k}={_cell(v)}" for k, v in info.items())] for op, info in coverage.items()]
        out += ["## Op coverage", ""] + _table(["op", "coverage"], rows)

    cstats = manifest.get("compile_cache")
    if isinstance(cstats, Mapping) and cstats:
        rows = [[s, v.get("hits", 0), v.get("misses", 0)] for s, v in cstats.items() if isinstance(v, Mapping)]
        out += ["## Compile cache", ""] + _table(["stage", "hits", "misses"], rows)

    if files:
        rows = [[f"`{rel}`", _human_bytes(info.get("bytes")), str(info.get("sha256", ""))[:16]]
                for rel, info in files.items() if isinstance(info, Mapping)]
        out += ["## Files", ""] + _table(["file", "size", "sha256"], rows)
    return "\n".join(out).rstrip() + "\n"


def _accuracy(acc: Mapping[str, Any]) -> str:
    lines = ["## Accuracy (quantized vs unquantized)", "",
             f"{acc['prompts']} prompts (lengths {acc['prompt_lengths']}, seed {acc['seed']}), {acc['new_tokens']} "
             "greedy tokens each; decode teacher-forced with the unquantized model's tokens.", "",
             "| metric | value |", "|---|---|",
             f"| logits relative error | {acc['logits_rel_err']:.3e} |",
             f"| KL(ref ‖ quant), mean / max (nats) | {acc['kl']:.3e} / {acc['kl_max']:.3e} |",
             f"| greedy agreement (teacher forced) | {acc['greedy_agreement']:.4f} |",
             f"| free-running greedy tokens before first mismatch | {acc['greedy_prefix']} of {acc['new_tokens']} |"]
    for layer, r in acc["recall"].items():
        lines.append(f"| indexer top-{acc['topk'].get(layer)} recall, layer {layer} | {r} |")
    lines += ["", "| cache | bytes/token before | after | bf16 | after / bf16 | pools |", "|---|---|---|---|---|---|"]
    for c in acc["caches"]:
        lines.append(f"| {c['cache']} | {c['bytes_per_token_before']} | {c['bytes_per_token_after']} | "
                     f"{c['bytes_per_token_bf16']} | {c['ratio_vs_bf16']} | {'; '.join(c['pools'])} |")
    return "\n".join(lines) + "\n"


REPORTS = {"report.md": render_report}
