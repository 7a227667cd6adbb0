"""`kimi-compile`: build, run, inspect, verify, debug, cache. A user error prints one clear line and exits 1;
--debug shows the traceback."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

import click

from kimi_compile.recipe import BACKENDS

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, KeyError, RuntimeError)


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.exceptions.Exit:
            raise
        except (click.ClickException, click.Abort):
            raise
        except Exception as e:  # user-facing: one line, unless --debug
            if ctx.obj and ctx.obj.get("debug"):
                raise
            from kimi_compile.artifact import ArtifactError

            if isinstance(e, (*USER_ERRORS, ArtifactError)):
                msg = str(e).strip()
                raise click.ClickException(msg) from None
            raise


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.option("-v", "--verbose", is_flag=True, help="Log kimi-compile's own steps (third-party loggers stay quiet).")
@click.pass_context
def main(ctx, debug, verbose):
    """kimi-compile: ahead-of-time compiler for Kimi K3 / K3.1."""
    from kimi_compile.events import quiet_known_noise

    ctx.obj = {"debug": debug}
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("kimi_compile").setLevel(logging.INFO if verbose else logging.WARNING)
    quiet_known_noise()


def _summary_table(summary: dict, title: str | None = None):
    from rich.table import Table

    t = Table(title=title, show_header=False, box=None, title_justify="left", padding=(0, 2, 0, 0))
    t.add_column(style="bold")
    t.add_column()
    for k, v in summary.items():
        t.add_row(k, v)
    return t


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--model", "model_dir", type=click.Path(file_okay=False), help="HF checkpoint directory.")
@click.option("--backend", type=click.Choice(list(BACKENDS)), help="Override the backend.")
@click.option("--target", help="Override the target (cpu for onnxruntime; a GPU arch such as sm89 for tensorrt).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Artifact directory (default artifacts/NAME); an existing one must be an artifact (replaced whole).")
@click.option("--verify", is_flag=True, help="Check ONNX Runtime against the reference after every pass.")
@click.option("-q", "--quiet", is_flag=True, help="No progress and no summary; print only the artifact path.")
@click.option("--log-json", "log_json", type=click.Path(dir_okay=False),
              help="Write the build's events (stage start/end with times, then a summary) as JSON lines to FILE.")
def build(recipe, model_dir, backend, target, out_dir, verify, quiet, log_json):
    """Build an artifact from RECIPE."""
    from rich.console import Console

    from kimi_compile.build import build as do_build
    from kimi_compile.events import BuildEvents, JsonLinesSink, ProgressSink
    from kimi_compile.recipe import load_recipe, with_overrides

    r = load_recipe(recipe)
    changes = {}
    if model_dir:
        changes["checkpoint"] = model_dir
    if backend:
        changes["backend"] = backend
        if backend == "tensorrt" and not target and r.target == "cpu":
            target = "sm89"  # engines are built ahead of time for a GPU, even on a CPU-only machine
        if backend == "onnxruntime" and not target:
            target = "cpu"
    if target:
        changes["target"] = target
    if changes:
        r = with_overrides(r, **changes)
    out = Path(out_dir or Path("artifacts") / r.name)
    console = Console(stderr=True)
    events = BuildEvents()
    jsonl = JsonLinesSink(log_json) if log_json else None
    if jsonl:
        events.sinks.append(jsonl)
    progress = None if quiet else ProgressSink(console)
    if progress:
        events.sinks.append(progress)
    try:
        with progress or contextlib.nullcontext():
            res = do_build(r, out, verify=verify, events=events)
        if jsonl:
            jsonl({"t": events.elapsed(), "event": "done", "artifact": str(out), "summary": res.manifest["summary"]})
    finally:
        if jsonl:
            jsonl.close()
    if not quiet:
        m = res.manifest
        console.print(f"[green]built[/] {out}")
        console.print(_summary_table(m["summary"]))
        if verify:
            worst = max(v["rel_err"] for v in m["verify"])
            console.print(f"verified against the reference after every pass: worst rel err {worst:.2e}")
    click.echo(str(out))


def _parse_ids(text: str) -> list[list[int]]:
    prompts = []
    for part in text.split(";"):
        try:
            ids = [int(x) for x in part.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated integers, got {part!r}", param_hint="--prompt-ids")
        if not ids:
            raise click.BadParameter("a prompt is empty", param_hint="--prompt-ids")
        prompts.append(ids)
    return prompts


@main.command()
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--prompt", "texts", multiple=True,
              help="A text prompt (repeat for a batch); needs an artifact built from a checkpoint with a tokenizer.")
@click.option("--chat", is_flag=True, help="Wrap each --prompt as a user message in the checkpoint's chat template.")
@click.option("--prompt-ids", help="Comma-separated token ids; several prompts separated by ';'.")
@click.option("--max-new-tokens", default=16, show_default=True, type=click.IntRange(min=0))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--seed", type=int, default=None)
@click.option("--providers", help="ONNX Runtime execution providers in order, e.g. cuda,cpu (onnxruntime artifacts; "
              "default: the recipe's backend.options.providers).")
@click.option("--speculative", help="Speculative decoding, METHOD:K: ngram:4 (prompt lookup, up to 4 draft tokens a "
              "step) or draft:4:DRAFT_ARTIFACT; --json adds per-request acceptance statistics.")
@click.option("--json", "as_json", is_flag=True, help="Print prompts, token ids and (with a tokenizer) text as JSON.")
def run(artifact, texts, chat, prompt_ids, max_new_tokens, temperature, seed, providers, speculative, as_json):
    """Generate from ARTIFACT: text with --prompt, token ids with --prompt-ids.

    Limits: prompt + new tokens at most the artifact's export.max_seq_len per sequence, at most export.max_batch
    prompts (both shown by `inspect`); a larger request is refused with the numbers."""
    from kimi_compile.runtime import load

    if bool(texts) == bool(prompt_ids):
        raise click.UsageError("give the prompts either as text (--prompt, repeatable) or as --prompt-ids")
    if chat and not texts:
        raise click.UsageError("--chat applies the chat template to --prompt text")
    kwargs = {"providers": [p.strip() for p in providers.split(",") if p.strip()]} if providers else {}
    sess = load(artifact, **kwargs)
    if texts:
        prompts = [sess.encode_text(t, chat=chat) for t in texts]
    else:
        prompts = _parse_ids(prompt_ids)
    gen_kwargs = {"temperature": temperature, "seed": seed}
    if speculative:
        gen_kwargs["speculative"] = speculative
    out = sess.generate(prompts, max_new_tokens, **gen_kwargs)
    text_out = [sess.decode_text(o) for o in out] if sess.tokenizer is not None else None
    if as_json:
        doc = {"tokens": out[0] if len(out) == 1 else out, "prompts": list(texts) if texts else prompts}
        if texts:
            doc["prompt_ids"] = prompts
        if text_out is not None:
            doc["text"] = text_out
        if speculative:
            doc["speculative"] = {**out.batch, "requests": out.stats}
        click.echo(json.dumps(doc))
    elif texts:
        for t, o in zip(texts, text_out):
            click.echo(o if len(texts) == 1 else f"[{t}] {o}")
    else:
        for p, o in zip(prompts, out):
            click.echo(f"{','.join(map(str, p))} -> {','.join(map(str, o))}")


@main.command()
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--prompt-tokens", type=click.IntRange(min=2), default=None,
              help="Prefill prompt length [default: export.max_seq_len - 2: every context length a chunk can see].")
@click.option("--batch", "batches", default="", metavar="B,...",
              help="Decode batch sizes to run [default: every batch bucket up to export.max_batch].")
@click.option("--json", "as_json", is_flag=True, help="Print the kernel index's summary as JSON.")
def warm(artifact, prompt_tokens, batches, as_json):
    """Compile ARTIFACT's GPU kernels ahead of time (cuda artifacts, on a GPU): run it once here (prefill chunks,
    a decode step per batch bucket) and store Triton's compiled kernels and autotuning results in ARTIFACT/kernels/,
    which the runtime installs on load, so that a fresh machine's first prompt does not compile them. Warm on each
    GPU type you serve on; a later warm adds to the earlier ones."""
    from kimi_compile.backends.cuda.kernel_cache import KernelCacheError
    from kimi_compile.warm import warm as warm_artifact

    try:
        bs = [int(x) for x in batches.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated batch sizes, got {batches!r}", param_hint="--batch") \
            from None
    try:
        index = warm_artifact(artifact, prompt_tokens=prompt_tokens, batches=bs or None,
                              progress=lambda m: None if as_json else click.echo(m, err=True))
    except KernelCacheError as e:
        raise click.ClickException(str(e)) from None
    summary = {"artifact": artifact, **_kernel_cache_summary(artifact), "files": len(index["files"])}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"{artifact}: {summary['entries']} kernel cache entries, {summary['bytes'] / 2**20:.1f} MiB "
                   f"(Triton {summary['triton']}; warmed on {', '.join(summary['devices'])})")


def _op_diff(a: dict, b: dict) -> dict:
    """Per phase: ops whose count differs between two artifacts (b minus a); phases without a difference left out."""
    out = {}
    for phase in sorted(set(a["graphs"]) | set(b["graphs"])):
        ha = a["graphs"].get(phase, {}).get("op_histogram", {})
        hb = b["graphs"].get(phase, {}).get("op_histogram", {})
        d = {k: hb.get(k, 0) - ha.get(k, 0) for k in sorted(set(ha) | set(hb)) if hb.get(k, 0) != ha.get(k, 0)}
        if d:
            out[phase] = d
    return out


@main.command()
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
@click.option("--diff", "diff_against", type=click.Path(file_okay=False),
              help="Another artifact: show which ops ARTIFACT adds or removes relative to it.")
def inspect(artifact, as_json, diff_against):
    """Summary, graphs and their kimi.* ops, op coverage, the pass log, the precision plan and cache layouts."""
    from kimi_compile.artifact import load_manifest
    from kimi_compile.report import summary

    m = load_manifest(artifact)
    info = {
        "summary": summary(m),
        "graphs": {p: {"node_count": g["node_count"], "op_histogram": g["op_histogram"],
                       "kimi_ops": {k: v for k, v in g["op_histogram"].items() if k.startswith("kimi.")},
                       "inputs": g["inputs"], "outputs": g["outputs"], "file": g["file"],
                       **{k: g[k] for k in ("engine", "lowering", "layers", "kimi_op_layers", "io",
                                            "compute_capabilities", "engine_bytes", "flavour", "version") if k in g}}
                   for p, g in m["graphs"].items()},
        "pass_log": m.get("pass_log", []),
        "precision_plan": m.get("precision_plan", []),
        "cache_layouts": m.get("cache_layouts", []),
        "bytes_per_token": m.get("bytes_per_token"),
        "backend": m.get("backend"),
        "versions": m.get("versions"),
        "op_coverage": m.get("op_coverage", {}),
        "accuracy": m.get("accuracy"),
        "runtime": m.get("runtime"),
        "tokenizer": m.get("tokenizer"),
        "stages": m.get("stages"),
        "stream_plans": {p: {**{k: v for k, v in g["stream_plan"].items() if k not in ("schedule", "layers")},
                             "layers": [{k: v for k, v in r.items() if k != "schedule"}
                                        for r in g["stream_plan"].get("layers", [])]}
                         for p, g in m["graphs"].items() if isinstance(g.get("stream_plan"), dict)},
    }
    info["kernel_cache"] = _kernel_cache_summary(artifact)
    if diff_against:
        info["diff"] = {"against": str(diff_against), "ops": _op_diff(load_manifest(diff_against), m)}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    c = Console()
    c.print(_summary_table(info["summary"], title=f"{artifact}"))
    if "diff" in info:
        c.print()
        if not info["diff"]["ops"]:
            c.print(f"no differences in ops relative to {info['diff']['against']}", soft_wrap=True)
        else:
            c.print(f"ops added (+) / removed (-) relative to {info['diff']['against']}:", soft_wrap=True)
            for phase, d in info["diff"]["ops"].items():
                c.print(f"  {phase}: " + ", ".join(f"{k} {v:+d}" for k, v in d.items()))
    for phase, g in info["graphs"].items():
        ranked = sorted(g["op_histogram"].items(), key=lambda kv: (not kv[0].startswith("kimi."), -kv[1]))
        c.print(f"\n[bold]{phase}[/]: {g['node_count']} nodes ({g['file']}): "
                + ", ".join(f"{k} x{v}" for k, v in ranked), highlight=False)
    for phase, cov in info["op_coverage"].items():
        t = Table(title=f"{phase}: op coverage {cov['total_pct']}% ({cov['metric']})", title_justify="left")
        for col in ("layer kind", "component", "fused ops", "fallback ops", "coverage %"):
            t.add_column(col)
        for r in cov["by_component"]:
            t.add_row(r["layer_kind"], r["component"], ", ".join(f"{k} x{v}" for k, v in r["fused_ops"].items()),
                      ", ".join(f"{k} x{v}" for k, v in sorted(r["fallback_ops"].items(), key=lambda kv: -kv[1])[:6]),
                      str(r["coverage_pct"]))
        c.print(t)
    for phase, sp in info["stream_plans"].items():
        t = Table(title=f"{phase}: stream plan, {sp.get('streams')} streams, {sp.get('events')} events, modelled "
                  f"critical path {sp.get('makespan_1_us')} us on one stream, {sp.get('makespan_n_us')} us planned",
                  title_justify="left")
        for col in ("layer", "kind", "nodes", "off main", "streams", "1 stream us", "N streams us"):
            t.add_column(col)
        for r in sp["layers"]:
            t.add_row(*(str(r[k]) for k in ("layer", "kind", "nodes", "side_nodes", "streams", "one_stream_us",
                                             "n_streams_us")))
        c.print(t)
    t = Table(title="pass log", title_justify="left")
    for col in ("phase", "pass", "version", "counts", "ms", "cached"):
        t.add_column(col)
    for r in info["pass_log"]:
        t.add_row(r["phase"], r["name"], str(r["version"]), ", ".join(f"{k}={v}" for k, v in r["counts"].items()),
                  str(r["ms"]), "hit" if r["cached"] else "miss")
    c.print(t)
    t = Table(title=f"caches ({info['bytes_per_token']} bytes per token, paged)", title_justify="left")
    for col in ("name", "kind", "shape", "dtype", "format / scale layout", "bytes/token", "bytes/sequence"):
        t.add_column(col)
    for r in info["cache_layouts"]:
        t.add_row(r["name"], r["kind"], str(r["shape"]), r["dtype"], r.get("scale_layout") or r.get("format", ""),
                  str(r["bytes_per_token"]), str(r["bytes_per_sequence"]))
    c.print(t)
    c.print(f"precision plan: {info['precision_plan'] or 'fp32 everywhere (no rules)'}")
    kc = info["kernel_cache"]
    if kc is not None and "error" in kc:
        c.print(f"kernel cache: unreadable ({kc['error']})", highlight=False)
    elif kc is not None:
        c.print(f"kernel cache: {kc['entries']} entries, {kc['bytes'] / 2**20:.1f} MiB, Triton {kc['triton']}, "
                f"warmed on {', '.join(kc['devices'])} (kimi-compile warm)", highlight=False)


def _kernel_cache_summary(artifact) -> dict | None:
    """The kernels `kimi-compile warm` stored in the artifact (None: none), or the reason its index is unreadable."""
    from kimi_compile.backends.cuda.kernel_cache import KernelCacheError, read_index

    try:
        index = read_index(artifact)
    except (KernelCacheError, OSError) as e:
        return {"entries": 0, "bytes": 0, "triton": None, "devices": [], "error": str(e)}
    if index is None:
        return None
    warms = index.get("warms") if isinstance(index.get("warms"), list) else []
    return {"entries": len({rel.split("/")[0] for rel in index["files"]}),
            "bytes": sum(i["bytes"] for i in index["files"].values()), "triton": index.get("triton"),
            "devices": sorted({str((w.get("device") or {}).get("name")) for w in warms if isinstance(w, dict)})}


@main.command("plan")
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--layout", "layouts", multiple=True,
              help="A layout to plan: tp8, tp8+ep16 (ep > tp: attention data-parallel groups), tp8xcp4, tp2+nosp; "
                   "repeat for more columns. Default: the recipe's parallel layout.")
@click.option("--dtype", "act_dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Element type of activations in the collectives.")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
@click.option("--ttft", "ttft", default="", metavar="TOKENS,...",
              help="Also model the time to first token of one prompt of these lengths (e.g. 131072,1048576) per "
                   "layout: FLOPs of the busiest rank at a throughput calibrated on an H200 measurement, plus "
                   "collectives over NVLink (docs/parallel.md).")
def plan_cmd(recipe, layouts, act_dtype, as_json, ttft):
    """Per-rank weight bytes, cache bytes per token, collective bytes per decode step and per prefill token of the
    recipe's model, read from partitioned graphs of a small probe of it (no weights needed; docs/parallel.md)."""
    from kimi_compile.plan import plan_text

    try:
        lengths = tuple(int(x) for x in ttft.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated token counts, got {ttft!r}", param_hint="--ttft") from None
    if any(n < 1 for n in lengths):
        raise click.BadParameter(f"token counts must be positive, got {ttft!r}", param_hint="--ttft")
    click.echo(plan_text(recipe, layouts, as_json=as_json, act_dtype=act_dtype, ttft=lengths,
                         say=lambda msg: click.echo(msg, err=True)))


def _attach_cache():
    from kimi_compile.cli_cache import cache
    from kimi_compile.cli_verify import verify
    from kimi_compile.debug import debug

    main.add_command(cache)
    main.add_command(verify)
    main.add_command(debug)


_attach_cache()

if __name__ == "__main__":
    sys.exit(main())
