"""Rendering an artifact's manifest for people: report.md and report.html (summary, build stages, passes, graphs,
cache layouts, precision plan, quantized accuracy, op coverage, compile cache, files).

`sections(manifest)` turns a manifest into titled sections of text and tables; `render_report` writes them as
Markdown, `render_html` as one self-contained page (no external files: CSS inline, plots as inline PNG) with
matplotlib plots beside the sections a picture explains better (`PLOTS` maps a section title to its plot makers:
time per stage and per pass with cache hits marked, op coverage per layer kind, cache bytes per token per
precision, the quantized accuracy numbers; later issues add theirs there). `summary(manifest)` is the short
label -> text overview the build prints, `inspect` opens with, and the build stores as manifest["summary"].

`REPORTS` maps each report file to its renderer; the build hands it to `ArtifactWriter`, which writes the reports
after the manifest is final. Renderers take any manifest (missing or odd sections render as empty), import no
torch; matplotlib is imported only by render_html.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["REPORTS", "PLOTS", "Table", "render_html", "render_report", "sections", "summary"]


@dataclasses.dataclass
class Table:
    headers: list[str]
    rows: list[list[Any]]
    right: tuple[int, ...] = ()  # columns of numbers (right-aligned in HTML)


Block = str | Table
Section = tuple[str, int, list[Block]]  # (title, heading level, blocks)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(", ", ": "))
    return "" if value is None else str(value)


def _human_bytes(n: Any) -> str:
    if not _is_num(n):
        return _text(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _map(m: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = m.get(key)
    return v if isinstance(v, Mapping) else {}


def _named(section: Any) -> list[tuple[str, Any]]:
    """{name: info} or [{name: ..., ...}] -> [(name, info)]."""
    if isinstance(section, Mapping):
        return [(str(k), v) for k, v in section.items()]
    if isinstance(section, (list, tuple)):
        return [(str(item.get("name", i)) if isinstance(item, Mapping) else str(i), item) for i, item in
                enumerate(section)]
    return []


def _shape(shape: Any) -> str:
    return "[" + ", ".join(map(str, shape)) + "]" if isinstance(shape, (list, tuple)) else _text(shape)


# ---- summary ---------------------------------------------------------------------------------------------------


def _cache_word(hits: Any, misses: Any, what: str) -> str:
    if not (_is_num(hits) and _is_num(misses)):
        return ""
    total = hits + misses
    if total == 1:
        return f"{what} {'hit' if hits else 'miss'}"
    return f"{what} {hits} of {total} hit"


def summary(manifest: Mapping[str, Any]) -> dict[str, str]:
    """label -> text: what was built, for what, how big, how long, how well (only what the manifest holds)."""
    recipe = _map(manifest, "recipe")
    model = _map(recipe, "model")
    backend = manifest.get("backend") if isinstance(manifest.get("backend"), Mapping) else _map(recipe, "backend")
    out: dict[str, str] = {}
    tool = _map(manifest, "tool")
    if tool:
        out["built by"] = f"{tool.get('name', 'kimi-compile')} {tool.get('version', '')}".strip()
    out["model"] = _text(model.get("preset") or model.get("checkpoint") or "")
    if manifest.get("model_source"):
        out["model source"] = _text(manifest["model_source"])
    out["dtype"] = _text(model.get("dtype", ""))
    out["backend"] = " ".join(_text(backend.get(k, "")) for k in ("name", "version")).strip()
    out["target"] = _text(backend.get("target") or recipe.get("target", ""))
    graphs = _map(manifest, "graphs")
    counts = [f"{p} {g['node_count']} nodes" for p, g in graphs.items() if isinstance(g, Mapping) and
              "node_count" in g]
    if counts:
        out["graphs"] = ", ".join(counts)
    cov = [f"{p} {c['total_pct']}%" for p, c in _map(manifest, "op_coverage").items()
           if isinstance(c, Mapping) and "total_pct" in c]
    if cov:
        out["op coverage"] = ", ".join(cov) + " of the traced compute in fused kimi.* ops"
    if _is_num(manifest.get("bytes_per_token")):
        per_seq = sum(c.get("bytes_per_sequence", 0) for _, c in _named(manifest.get("cache_layouts"))
                      if isinstance(c, Mapping) and _is_num(c.get("bytes_per_sequence", 0)))
        out["cache"] = f"{manifest['bytes_per_token']} bytes per token (paged)" + (
            f" + {per_seq} bytes per sequence (states)" if per_seq else "")
    rt = _map(manifest, "runtime")
    if "max_seq_len" in rt and "max_batch" in rt:
        out["capacity"] = f"max_seq_len {rt['max_seq_len']} tokens per sequence, max_batch {rt['max_batch']} " \
                          "sequences (hard limits)"
    tok = _map(manifest, "tokenizer")
    if tok:
        out["tokenizer"] = f"{tok.get('kind', '')}" + (", chat template" if tok.get("chat_template") else "")
    acc = _map(manifest, "accuracy")
    if acc and all(_is_num(acc.get(k)) for k in ("logits_rel_err", "kl", "greedy_agreement")):
        out["accuracy"] = (f"logits rel err {acc['logits_rel_err']:.4g}, KL {acc['kl']:.4g}, greedy agreement "
                           f"{acc['greedy_agreement']:.4g} (quantized vs unquantized)")
    if _is_num(manifest.get("build_seconds")):
        out["build time"] = f"{manifest['build_seconds']} s"
    cc = _map(manifest, "compile_cache")
    words = [_cache_word(_map(cc, k).get("hits"), _map(cc, k).get("misses"), w)
             for k, w in (("trace", "trace"), ("pass", "passes"), ("backend", "backend"))]
    if any(words):
        out["compile cache"] = ", ".join(w for w in words if w)
    files = _map(manifest, "files")
    if files:
        size = sum(f.get("bytes", 0) for f in files.values() if isinstance(f, Mapping) and _is_num(f.get("bytes", 0)))
        out["files"] = f"{len(files)} ({_human_bytes(size)})"
    if "schema_version" in manifest:
        out["schema version"] = _text(manifest["schema_version"])
    return {k: v for k, v in out.items() if v}


# ---- sections --------------------------------------------------------------------------------------------------


def _passes(passes: list) -> Section:
    rows, total_ms = [], 0.0
    for i, p in enumerate(passes):
        if not isinstance(p, Mapping):
            rows.append([i, _text(p), "", "", "", "", "", ""])
            continue
        counts = p.get("counts", {})
        counts_text = ", ".join(f"{k}={v}" for k, v in counts.items()) if isinstance(counts, Mapping) else counts
        ms = p.get("ms")
        if _is_num(ms):
            total_ms += ms
            ms = f"{ms:.1f}"
        cached = p.get("cached")
        nodes = f"{p['nodes_before']} -> {p['nodes_after']}" if "nodes_before" in p and "nodes_after" in p else ""
        rows.append([i, p.get("name", p.get("pass", "")), p.get("version", ""), p.get("phase", ""), counts_text, nodes,
                     ms, {True: "hit", False: "miss"}.get(cached, "") if cached is not None else ""])
    return (f"Passes ({len(passes)}, {total_ms:.1f} ms)", 2,
            [Table(["#", "pass", "version", "phase", "counts", "nodes", "ms", "cache"], rows, right=(0, 5, 6))])


def _graphs(graphs: Mapping[str, Any]) -> list[Section]:
    out: list[Section] = [("Graphs", 2, [])]
    for phase, g in graphs.items():
        if not isinstance(g, Mapping):
            continue
        blocks: list[Block] = []
        if "node_count" in g:
            blocks.append(f"{g['node_count']} nodes")
        for kind in ("inputs", "outputs"):
            if g.get(kind):
                rows = []
                for name, info in _named(g[kind]):
                    rows.append([info.get("name", name), info.get("dtype", ""), _shape(info.get("shape"))]
                                if isinstance(info, Mapping) else [name, _text(info), ""])
                blocks += [f"{kind.capitalize()}:", Table(["name", "dtype", "shape"], rows)]
        hist = g.get("op_histogram")
        if isinstance(hist, Mapping) and hist:
            ranked = sorted(hist.items(), key=lambda kv: (-kv[1] if _is_num(kv[1]) else 0, str(kv[0])))
            blocks += ["Op histogram:", Table(["op", "count"], [[k, v] for k, v in ranked], right=(1,))]
        title = f"{phase} (`{g['file']}`)" if g.get("file") else str(phase)
        out.append((title, 3, blocks))
    return out


def _caches(layouts: Any) -> Section | None:
    named = _named(layouts)
    if not named:
        return None
    infos = [(name, info if isinstance(info, Mapping) else {"value": info}) for name, info in named]
    per_seq = any("bytes_per_sequence" in info for _, info in infos)
    rows, total, total_seq = [], 0, 0
    for name, info in infos:
        bpt, bps = info.get("bytes_per_token"), info.get("bytes_per_sequence")
        total += bpt if _is_num(bpt) else 0
        total_seq += bps if _is_num(bps) else 0
        row = [name, info.get("kind", ""), info.get("dtype", ""), _shape(info.get("shape")), bpt]
        rows.append(row + [bps] if per_seq else row)
    headers = ["cache", "kind", "dtype", "shape", "bytes/token"] + (["bytes/sequence"] if per_seq else [])
    text = f"Total: {total:g} bytes per token" + (f", {total_seq:g} bytes per sequence." if per_seq else ".")
    return ("Cache layouts", 2, [Table(headers, rows, right=(4, 5)), text])


def _precision(plan: Any) -> Section | None:
    if not isinstance(plan, (list, tuple)):
        return None
    if not plan:
        return ("Precision plan", 2, ["All tensors in the model dtype (no precision rules)."])
    rows = []
    for r in plan:
        if not isinstance(r, Mapping):
            rows.append([_text(r), "", "", ""])
            continue
        opts = r.get("options", {})
        tensors = r.get("tensors", r.get("count", ""))
        rows.append([r.get("role", ""), r.get("format", ""),
                     ", ".join(f"{k}={v}" for k, v in opts.items()) if isinstance(opts, Mapping) else opts,
                     len(tensors) if isinstance(tensors, (list, tuple)) else tensors])
    return ("Precision plan", 2, [Table(["role", "format", "options", "tensors"], rows)])


def _accuracy(acc: Mapping[str, Any]) -> Section:
    blocks: list[Block] = [
        f"{acc.get('prompts')} prompts (lengths {acc.get('prompt_lengths')}, seed {acc.get('seed')}), "
        f"{acc.get('new_tokens')} greedy tokens each; decode teacher-forced with the unquantized model's tokens."]
    rows = [["logits relative error", f"{acc['logits_rel_err']:.3e}"],
            ["KL(ref ‖ quant), mean / max (nats)", f"{acc['kl']:.3e} / {acc['kl_max']:.3e}"],
            ["greedy agreement (teacher forced)", f"{acc['greedy_agreement']:.4f}"],
            ["free-running greedy tokens before first mismatch", f"{acc['greedy_prefix']} of {acc['new_tokens']}"]]
    for layer, r in _map(acc, "recall").items():
        rows.append([f"indexer top-{_map(acc, 'topk').get(layer)} recall, layer {layer}", r])
    blocks.append(Table(["metric", "value"], rows))
    crow = [[c["cache"], c["bytes_per_token_before"], c["bytes_per_token_after"], c["bytes_per_token_bf16"],
             c["ratio_vs_bf16"], "; ".join(c["pools"])] for c in acc.get("caches", [])]
    if crow:
        blocks.append(Table(["cache", "bytes/token before", "after", "bf16", "after / bf16", "pools"], crow,
                            right=(1, 2, 3, 4)))
    return ("Accuracy (quantized vs unquantized)", 2, blocks)


def _cp_balance(balance: Mapping[str, Any]) -> Section:
    rows = [[_tokens(r["tokens"]), r["cp"], r["layout"], f"{r['max_over_mean']:.4f}", f"{r['max_tflop']:.4g}",
             f"{r['mean_tflop']:.4g}"] for r in balance["rows"]]
    return ("Context-parallel balance", 2, [
        f"max/mean over ranks of the {balance.get('model', '')}; zigzag keeps it near 1.0, contiguous approaches "
        "(2P-1)/P.",
        Table(["prompt tokens", "cp", "layout", "max / mean", "max TFLOP", "mean TFLOP"], rows, right=(1, 3, 4, 5))])


def _stream_plans(graphs: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    return [(p, g["stream_plan"]) for p, g in graphs.items()
            if isinstance(g, Mapping) and isinstance(g.get("stream_plan"), Mapping)]


def _streams(plans: list[tuple[str, Mapping[str, Any]]]) -> Section:
    """The assign_streams plan: per phase the modelled critical path on 1 and N streams, per layer kind the same for
    its first layer (cost model at the shape the recipe gives the pass; not a measurement)."""
    rows = [[p, sp.get("streams", ""), sp.get("events", ""), sp.get("makespan_1_us", ""), sp.get("makespan_n_us", "")]
            for p, sp in plans]
    blocks: list[Block] = [
        "Modelled by the assign_streams pass (bytes and FLOPs at the recipe's shape, launch and event costs), not "
        "measured: the critical path of each graph on one stream and on the planned streams.",
        Table(["phase", "streams", "events", "1 stream (us)", "N streams (us)"], rows, right=(1, 2, 3, 4))]
    lrows = [[p, r["layer"], r["kind"], r["nodes"], r["side_nodes"], r["streams"], r["one_stream_us"],
              r["n_streams_us"]] for p, sp in plans for r in sp.get("layers", []) if "schedule" in r]
    if lrows:
        blocks += ["The first layer of each kind (its N-stream span is first start to last end in the whole graph's "
                   "schedule, waits on other layers' nodes included, so it can exceed the one-stream sum):",
                   Table(["phase", "layer", "kind", "nodes", "off the main stream", "streams", "1 stream (us)",
                          "N streams (us)"], lrows, right=(1, 3, 4, 5, 6, 7))]
    return ("Stream plan", 2, blocks)


def _tokens(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _coverage(coverage: Mapping[str, Any]) -> list[Section]:
    out: list[Section] = []
    for phase, cov in coverage.items():
        if isinstance(cov, Mapping) and isinstance(cov.get("by_component"), list):
            rows = [[r.get("layer_kind", ""), r.get("component", ""),
                     ", ".join(f"{k} x{v}" for k, v in _map(r, "fused_ops").items()),
                     ", ".join(f"{k} x{v}" for k, v in sorted(_map(r, "fallback_ops").items(),
                                                                key=lambda kv: -kv[1] if _is_num(kv[1]) else 0)),
                     r.get("traced_nodes", ""), r.get("coverage_pct", "")]
                    for r in cov["by_component"] if isinstance(r, Mapping)]
            blocks: list[Block] = [f"{cov.get('total_pct')}% ({cov.get('metric', '')})",
                                   Table(["layer kind", "component", "fused ops", "fallback ops", "traced nodes",
                                          "coverage %"], rows, right=(4, 5))]
            out.append((f"Op coverage: {phase}", 2, blocks))
        else:  # an older or hand-written shape: {op: info}
            info = cov if not isinstance(cov, Mapping) else ", ".join(f"{k}={_text(v)}" for k, v in cov.items())
            out.append(("Op coverage", 2, [Table(["op", "coverage"], [[phase, info]])]))
    return out


def sections(manifest: Mapping[str, Any]) -> list[Section]:
    """Most asked first: summary, where the time went, how accurate, how big, how fused; then the detail."""
    out: list[Section] = [("Summary", 2, [Table(["", "value"], [[k, v] for k, v in summary(manifest).items()])])]
    stages = manifest.get("stages")
    if isinstance(stages, list) and stages:
        rows = [[s.get("stage", ""), s.get("label", ""), s.get("seconds", ""),
                 {True: "hit", False: "miss"}.get(s.get("cached"), "")] for s in stages if isinstance(s, Mapping)]
        out.append(("Build stages", 2, [Table(["stage", "what", "seconds", "cache"], rows, right=(2,))]))
    passes = manifest.get("pass_log")
    if isinstance(passes, (list, tuple)) and passes:
        out.append(_passes(list(passes)))
    acc = _map(manifest, "accuracy")
    if acc and all(k in acc for k in ("logits_rel_err", "kl", "kl_max", "greedy_agreement", "greedy_prefix")):
        out.append(_accuracy(acc))
    balance = _map(_map(manifest, "parallel"), "cp_balance")
    if isinstance(balance.get("rows"), list) and balance["rows"]:
        out.append(_cp_balance(balance))
    for sec in (_caches(manifest.get("cache_layouts")), _precision(manifest.get("precision_plan"))):
        if sec:
            out.append(sec)
    out += _coverage(_map(manifest, "op_coverage"))
    plans = _stream_plans(_map(manifest, "graphs"))
    if plans:
        out.append(_streams(plans))
    if _map(manifest, "graphs"):
        out += _graphs(_map(manifest, "graphs"))
    versions = _map(manifest, "versions")
    if versions:
        out.append(("Versions", 2, [Table(["library", "version"], [[k, v] for k, v in versions.items()])]))
    cstats = _map(manifest, "compile_cache")
    if cstats:
        rows = [[s, v.get("hits", 0), v.get("misses", 0)] for s, v in cstats.items() if isinstance(v, Mapping)]
        out.append(("Compile cache", 2, [Table(["stage", "hits", "misses"], rows, right=(1, 2))]))
    files = _map(manifest, "files")
    if files:
        rows = [[f"`{rel}`", _human_bytes(info.get("bytes")), str(info.get("sha256", ""))[:16]]
                for rel, info in files.items() if isinstance(info, Mapping)]
        out.append(("Files", 2, [Table(["file", "size", "sha256"], rows, right=(1,))]))
    return out


def _title(manifest: Mapping[str, Any]) -> str:
    return str(_map(manifest, "recipe").get("name") or manifest.get("name") or "artifact")


# ---- Markdown --------------------------------------------------------------------------------------------------


def _md_cell(value: Any) -> str:
    return _text(value).replace("|", "\\|").replace("\n", " ")


def render_report(manifest: Mapping[str, Any]) -> str:
    """report.md for `manifest`."""
    out = [f"# kimi-compile artifact: {_title(manifest)}", ""]
    for title, level, blocks in sections(manifest):
        out += ["#" * level + " " + title, ""]
        for b in blocks:
            if isinstance(b, Table):
                out += ["| " + " | ".join(b.headers) + " |", "|" + "|".join("---" for _ in b.headers) + "|"]
                out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows] + [""]
            else:
                out += [b, ""]
    return "\n".join(out).rstrip() + "\n"


# ---- HTML with plots -------------------------------------------------------------------------------------------

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; color: #1f2328; margin: 0;
       background: #f6f8fa; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 26px; margin: 8px 0 16px; } h2 { font-size: 20px; margin: 32px 0 8px;
     border-bottom: 1px solid #d0d7de; padding-bottom: 4px; } h3 { font-size: 16px; margin: 20px 0 6px; }
table { border-collapse: collapse; margin: 8px 0 12px; font-size: 13.5px; }
th, td { border: 1px solid #d0d7de; padding: 4px 10px; text-align: left; vertical-align: top; }
td.num { white-space: nowrap; }
th { background: #f0f3f6; } tr:nth-child(even) td { background: #fafbfc; } td.num { text-align: right;
     font-variant-numeric: tabular-nums; }
table.summary td:first-child { font-weight: 600; white-space: nowrap; }
code { font: 12.5px ui-monospace, SFMono-Regular, Menlo, monospace; }
figure { margin: 12px 0 20px; } figure img { max-width: 100%; height: auto; border: 1px solid #eaeef2; }
figcaption { color: #57606a; font-size: 13px; }
details summary { cursor: pointer; color: #0969da; margin: 6px 0; }
nav a { margin-right: 14px; }
"""
_LEGEND = {"loc": "lower right", "bbox_to_anchor": (1.0, 1.0), "ncol": 3, "frameon": False, "fontsize": 8}
_COLORS = {"fused": "#2da44e", "fallback": "#cf222e", "miss": "#0969da", "hit": "#8c959f"}


def _fig_png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height))
    ax.spines[["top", "right"]].set_visible(False)
    return fig, ax


def _hbar(labels: list[str], values: list[float], colors: list[str], xlabel: str, title: str,
          legend: dict[str, str] | None = None):
    fig, ax = _figure(8.5, max(1.6, 0.28 * len(labels) + 0.9))
    y = list(range(len(labels)))[::-1]
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, labels, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11, loc="left")
    top = max(values) if values else 0
    for yi, v in zip(y, values):
        ax.text(v + top * 0.01, yi, f"{v:g}", va="center", fontsize=8)
    if legend:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=c, label=lbl) for lbl, c in legend.items()], **_LEGEND)
    return fig


def plot_stages(manifest: Mapping[str, Any]) -> list[tuple[str, Any]]:
    stages = [s for s in manifest.get("stages") or [] if isinstance(s, Mapping) and _is_num(s.get("seconds"))]
    if not stages:
        return []
    fig = _hbar([s.get("stage", "") for s in stages], [round(float(s["seconds"]), 2) for s in stages],
                [_COLORS["hit"] if s.get("cached") else _COLORS["miss"] for s in stages], "seconds",
                "Time per build stage", {"computed": _COLORS["miss"], "compile-cache hit": _COLORS["hit"]})
    return [("Time per build stage (grey: served by the compile cache).", fig)]


def plot_passes(manifest: Mapping[str, Any]) -> list[tuple[str, Any]]:
    passes = [p for p in manifest.get("pass_log") or [] if isinstance(p, Mapping) and _is_num(p.get("ms"))]
    if not passes:
        return []
    fig = _hbar([f"{p.get('phase', '')}: {p.get('name', '')}" for p in passes], [round(float(p["ms"]), 1)
                for p in passes], [_COLORS["hit"] if p.get("cached") else _COLORS["miss"] for p in passes],
                "milliseconds (when it last ran)", "Time per pass",
                {"ran in this build": _COLORS["miss"], "compile-cache hit": _COLORS["hit"]})
    return [("Time per pass and phase; a cache hit shows the time of the run that filled the cache.", fig)]


def plot_coverage(manifest: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for phase, cov in _map(manifest, "op_coverage").items():
        rows = cov.get("by_component") if isinstance(cov, Mapping) else None
        if not isinstance(rows, list) or not rows:
            continue
        kinds: dict[str, list[float]] = {}
        for r in rows:
            if not isinstance(r, Mapping) or not _is_num(r.get("traced_nodes")) or not r.get("traced_nodes"):
                continue
            n = float(r["traced_nodes"])
            left = min(n, float(sum(v for v in _map(r, "fallback_ops").values() if _is_num(v))))
            k = kinds.setdefault(str(r.get("layer_kind", "")), [0.0, 0.0])
            k[0] += n - left
            k[1] += left
        if not kinds:
            continue
        fig, ax = _figure(8.5, 0.45 * len(kinds) + 1.2)
        names = list(kinds)[::-1]
        fused = [kinds[k][0] for k in names]
        left = [kinds[k][1] for k in names]
        ax.barh(names, fused, color=_COLORS["fused"], label="in fused kimi.* ops")
        ax.barh(names, left, left=fused, color=_COLORS["fallback"], label="fallback (standard ops)")
        for i, (f, lft) in enumerate(zip(fused, left)):
            pct = 100.0 * f / (f + lft) if f + lft else 0.0
            ax.text(f + lft, i, f"  {pct:.1f}%", va="center", fontsize=8)
        ax.set_xlabel("traced compute nodes")
        ax.set_title(f"Op coverage per layer kind: {phase} graph", fontsize=11, loc="left")
        ax.legend(**_LEGEND)
        out.append((f"{phase}: traced compute nodes now inside fused ops (green) and left as standard ops (red).",
                    fig))
    return out


def plot_caches(manifest: Mapping[str, Any]) -> list[tuple[str, Any]]:
    acc = _map(manifest, "accuracy")
    caches = acc.get("caches") if isinstance(acc.get("caches"), list) else None
    if caches:  # per paged cache: fp32 before, bf16, this artifact's formats
        fig, ax = _figure(8.5, 0.6 * len(caches) + 1.4)
        names = [str(c.get("cache", "")) for c in caches][::-1]
        series = (("fp32 (before)", "bytes_per_token_before", "#8c959f"), ("bf16", "bytes_per_token_bf16", "#bf8700"),
                  ("this artifact", "bytes_per_token_after", "#0969da"))
        h = 0.26
        for j, (label, key, color) in enumerate(series):
            vals = [float(c.get(key, 0) or 0) for c in caches][::-1]
            ys = [i + (1 - j) * h for i in range(len(names))]
            ax.barh(ys, vals, height=h, color=color, label=label)
            for yv, v in zip(ys, vals):
                ax.text(v, yv, f" {v:g}", va="center", fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=9)
        ax.set_xlabel("bytes per token")
        ax.set_title("Cache bytes per token per precision", fontsize=11, loc="left")
        ax.legend(**_LEGEND)
        return [("Bytes per token of each paged cache: unquantized fp32, bf16, and this artifact's formats.", fig)]
    per: dict[str, float] = {}
    for name, c in _named(manifest.get("cache_layouts")):
        if isinstance(c, Mapping) and _is_num(c.get("bytes_per_token")) and c["bytes_per_token"]:
            key = f"{c.get('kind', name)} ({c.get('format') or c.get('dtype', '')})"
            per[key] = per.get(key, 0) + float(c["bytes_per_token"])
    if not per:
        return []
    fig = _hbar(list(per), list(per.values()), ["#0969da"] * len(per), "bytes per token (all layers)",
                "Cache bytes per token per kind and precision")
    return [("Paged cache bytes per token, summed over layers, per cache kind and storage precision.", fig)]


def plot_accuracy(manifest: Mapping[str, Any]) -> list[tuple[str, Any]]:
    acc = _map(manifest, "accuracy")
    if not all(_is_num(acc.get(k)) for k in ("greedy_agreement", "logits_rel_err", "kl")):
        return []
    labels = ["greedy agreement"] + [f"top-{_map(acc, 'topk').get(k)} recall, layer {k}"
                                     for k, v in _map(acc, "recall").items() if _is_num(v)]
    values = [float(acc["greedy_agreement"])] + [float(v) for v in _map(acc, "recall").values() if _is_num(v)]
    fig = _hbar(labels, [round(v, 4) for v in values], ["#2da44e"] * len(values), "fraction (1 = identical)",
                f"Quantized vs unquantized: logits rel err {acc['logits_rel_err']:.3g}, KL {acc['kl']:.3g} nats")
    return [("Agreement of the quantized artifact with the unquantized graphs (1.0 = identical).", fig)]


def plot_cp_balance(manifest: Mapping[str, Any]) -> list[tuple[str, Any]]:
    rows = [r for r in _map(_map(manifest, "parallel"), "cp_balance").get("rows") or [] if isinstance(r, Mapping)]
    if not rows:
        return []
    fig, ax = _figure(8.5, 3.6)
    styles = {"zigzag": "-", "contiguous": "--"}
    for layout in sorted({r["layout"] for r in rows}):
        for cp in sorted({r["cp"] for r in rows}):
            pts = sorted((r["tokens"], r["max_over_mean"]) for r in rows if r["layout"] == layout and r["cp"] == cp)
            ax.plot([_tokens(t) for t, _ in pts], [v for _, v in pts], styles.get(layout, ":"), marker="o",
                    label=f"{layout}, cp={cp}")
    ax.axhline(1.0, color="#888", lw=0.8)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("max / mean per rank")
    ax.set_title("Context-parallel prefill balance (indexer + attention FLOPs)", fontsize=11, loc="left")
    ax.legend(fontsize=8, ncol=2, frameon=False)
    return [("Busiest rank over the mean rank, per layout and cp size (1.0 = balanced).", fig)]


def plot_streams(manifest: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Gantt chart of the planned schedule of the first layer of each kind, decode phase (else the first phase)."""
    plans = dict(_stream_plans(_map(manifest, "graphs")))
    phase = "decode" if "decode" in plans else next(iter(plans), None)
    out = []
    for r in (plans[phase].get("layers", []) if phase else []):
        rows = r.get("schedule")
        if not rows:
            continue
        t0 = min(x[2] for x in rows)
        streams = sorted({x[1] for x in rows})
        fig, ax = _figure(9.5, 1.0 + 0.55 * len(streams))
        for x in rows:
            kimi = str(x[4]).startswith("kimi.")
            ax.broken_barh([(x[2] - t0, max(x[3] - x[2], 1e-3))], (x[1] - 0.35, 0.7),
                           color=_COLORS["fused"] if kimi else _COLORS["hit"], edgecolor="white", linewidth=0.3)
            if kimi and x[3] - x[2] > 0:
                ax.text(x[2] - t0, x[1] + 0.42, str(x[4])[len("kimi."):], fontsize=7)
        ax.set_yticks(streams, [f"stream {s}" for s in streams], fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("modelled us from the layer's first node")
        ax.set_title(f"{phase}, layer {r['layer']} ({r['kind']}): {r['one_stream_us']:g} us on one stream, "
                     f"{r['n_streams_us']:g} us on {r['streams']}", fontsize=10, loc="left")
        out.append((f"Planned schedule of layer {r['layer']} ({r['kind']}); kimi.* ops in green, standard ops in grey.", fig))
    return out


# section title (or its prefix before ':') -> plot makers, each returning [(caption, matplotlib figure)]
PLOTS: dict[str, list[Callable[[Mapping[str, Any]], list[tuple[str, Any]]]]] = {
    "Build stages": [plot_stages],
    "Passes": [plot_passes],
    "Cache layouts": [plot_caches],
    "Accuracy": [plot_accuracy],
    "Op coverage": [plot_coverage],
    "Context-parallel balance": [plot_cp_balance],
    "Stream plan": [plot_streams],
}


def _html_table(t: Table, cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.headers)
    body = []
    for row in t.rows:
        cells = []
        for i, c in enumerate(row):
            text = _text(c)
            inner = f"<code>{html.escape(text[1:-1])}</code>" if text.startswith("`") and text.endswith("`") \
                else html.escape(text)
            cells.append(f"<td class=\"num\">{inner}</td>" if i in t.right else f"<td>{inner}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table class=\"{cls}\"><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(manifest: Mapping[str, Any]) -> str:
    """report.html for `manifest`: the sections of report.md with their plots, in one file."""
    title = html.escape(_title(manifest))
    secs = sections(manifest)
    done: set[str] = set()
    parts = [f"<h1>kimi-compile artifact: {title}</h1>",
             "<nav>" + "".join(f"<a href=\"#s{i}\">{html.escape(t.split(' (')[0])}</a>"
                               for i, (t, lvl, _) in enumerate(secs) if lvl == 2) + "</nav>"]
    for i, (sec_title, level, blocks) in enumerate(secs):
        parts.append(f"<h{level} id=\"s{i}\">{html.escape(sec_title).replace('`', '')}</h{level}>")
        key = next((k for k in PLOTS if sec_title.startswith(k)), None)
        if key and key not in done:
            done.add(key)
            for make in PLOTS[key]:
                for caption, fig in make(manifest):
                    parts.append(f"<figure><img alt=\"{html.escape(caption)}\" src=\"data:image/png;base64,"
                                 f"{_fig_png(fig)}\"><figcaption>{html.escape(caption)}</figcaption></figure>")
        for b in blocks:
            if isinstance(b, Table):
                table = _html_table(b, "summary" if sec_title == "Summary" else "")
                if len(b.rows) > 12:  # long tables fold; the summary and plots stay in view
                    table = f"<details><summary>{len(b.rows)} rows</summary>{table}</details>"
                parts.append(table)
            else:
                parts.append(f"<p>{html.escape(b)}</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{title}</title>"
            f"<style>{_CSS}</style></head><body><main>\n" + "\n".join(parts) + "\n</main></body></html>\n")


REPORTS = {"report.md": render_report, "report.html": render_html}
