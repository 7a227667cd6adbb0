"""`kimi-compile`: build, run, inspect, cache. A user error prints one clear line and exits 1; --debug shows the
traceback."""

from __future__ import annotations

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
@click.option("-v", "--verbose", is_flag=True, help="Log progress.")
@click.pass_context
def main(ctx, debug, verbose):
    """kimi-compile: ahead-of-time compiler for Kimi K3 / K3.1."""
    ctx.obj = {"debug": debug}
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--model", "model_dir", type=click.Path(file_okay=False), help="HF checkpoint directory.")
@click.option("--backend", type=click.Choice(list(BACKENDS)), help="Override the backend.")
@click.option("--target", help="Override the target (cpu for onnxruntime; a GPU arch such as sm89 for tensorrt).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Artifact directory (default artifacts/NAME).")
@click.option("--verify", is_flag=True, help="Check ONNX Runtime against the reference after every pass.")
def build(recipe, model_dir, backend, target, out_dir, verify):
    """Build an artifact from RECIPE."""
    import warnings

    from rich.console import Console

    from kimi_compile.build import build as do_build
    from kimi_compile.recipe import load_recipe, with_overrides

    warnings.filterwarnings("ignore")
    for name in ("torch", "torch.onnx", "torch.onnx._internal.exporter._registration", "torch.export"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("onnx_ir").setLevel(logging.ERROR)
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
    with console.status("building") as status:
        res = do_build(r, out, verify=verify, progress=lambda m: status.update(m))
    m = res.manifest
    nodes = ", ".join(f"{p} {g['node_count']} nodes" for p, g in m["graphs"].items())
    console.print(f"[green]built[/] {out} ({nodes}; {m['build_seconds']} s; cache {res.cache_hits})")
    if verify:
        worst = max(v["rel_err"] for v in m["verify"])
        console.print(f"verified against the reference after every pass: worst rel err {worst:.2e}")
    click.echo(str(out))


@main.command()
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--prompt-ids", required=True, help="Comma-separated token ids; several prompts separated by ';'.")
@click.option("--max-new-tokens", default=16, show_default=True, type=click.IntRange(min=0))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--seed", type=int, default=None)
@click.option("--speculative", help="Speculative decoding, METHOD:K: ngram:4 (prompt lookup, up to 4 draft tokens a "
              "step) or draft:4:DRAFT_ARTIFACT; --json adds per-request acceptance statistics.")
@click.option("--json", "as_json", is_flag=True)
def run(artifact, prompt_ids, max_new_tokens, temperature, seed, speculative, as_json):
    """Generate tokens from ARTIFACT."""
    from kimi_compile.runtime import load

    prompts = []
    for part in prompt_ids.split(";"):
        try:
            ids = [int(x) for x in part.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated integers, got {part!r}", param_hint="--prompt-ids")
        if not ids:
            raise click.BadParameter("a prompt is empty", param_hint="--prompt-ids")
        prompts.append(ids)
    sess = load(artifact)
    out = sess.generate(prompts, max_new_tokens, temperature=temperature, seed=seed, speculative=speculative)
    if as_json:
        doc = {"tokens": out[0] if len(out) == 1 else out, "prompts": prompts}
        if speculative:
            doc["speculative"] = {**out.batch, "requests": out.stats}
        click.echo(json.dumps(doc))
    else:
        for p, o in zip(prompts, out):
            click.echo(f"{','.join(map(str, p))} -> {','.join(map(str, o))}")


def _op_diff(a: dict, b: dict) -> dict:
    """Per phase: ops whose count differs between two artifacts (b minus a)."""
    out = {}
    for phase in sorted(set(a["graphs"]) | set(b["graphs"])):
        ha = a["graphs"].get(phase, {}).get("op_histogram", {})
        hb = b["graphs"].get(phase, {}).get("op_histogram", {})
        out[phase] = {k: hb.get(k, 0) - ha.get(k, 0) for k in sorted(set(ha) | set(hb)) if hb.get(k, 0) != ha.get(k, 0)}
    return out


@main.command()
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True)
@click.option("--diff", "diff_against", type=click.Path(file_okay=False),
              help="Another artifact: show which ops ARTIFACT adds or removes relative to it.")
def inspect(artifact, as_json, diff_against):
    """Show graphs, op histograms (kimi.* ops), op coverage, the pass log, the precision plan and cache layouts."""
    from kimi_compile.artifact import load_manifest

    m = load_manifest(artifact)
    info = {
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
    }
    if diff_against:
        info["diff"] = {"against": str(diff_against), "ops": _op_diff(load_manifest(diff_against), m)}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    c = Console()
    for phase, g in info["graphs"].items():
        t = Table(title=f"{phase}: {g['node_count']} nodes")
        t.add_column("op")
        t.add_column("count", justify="right")
        for k, v in g["op_histogram"].items():
            t.add_row(k, str(v))
        c.print(t)
    t = Table(title="pass log")
    for col in ("phase", "pass", "version", "counts", "ms", "cached"):
        t.add_column(col)
    for r in info["pass_log"]:
        t.add_row(r["phase"], r["name"], str(r["version"]), json.dumps(r["counts"]), str(r["ms"]), str(r["cached"]))
    c.print(t)
    t = Table(title=f"caches ({info['bytes_per_token']} bytes per token, paged)")
    for col in ("name", "kind", "shape", "dtype", "format / scale layout", "bytes/token", "bytes/sequence"):
        t.add_column(col)
    for r in info["cache_layouts"]:
        t.add_row(r["name"], r["kind"], str(r["shape"]), r["dtype"], r.get("scale_layout") or r.get("format", ""),
                  str(r["bytes_per_token"]), str(r["bytes_per_sequence"]))
    c.print(t)
    for phase, cov in info["op_coverage"].items():
        t = Table(title=f"{phase}: op coverage {cov['total_pct']}% ({cov['metric']})")
        for col in ("layer kind", "component", "fused ops", "fallback ops", "coverage %"):
            t.add_column(col)
        for r in cov["by_component"]:
            t.add_row(r["layer_kind"], r["component"], json.dumps(r["fused_ops"]),
                      ", ".join(f"{k}x{v}" for k, v in sorted(r["fallback_ops"].items(), key=lambda kv: -kv[1])[:6]),
                      str(r["coverage_pct"]))
        c.print(t)
    if "diff" in info:
        c.print(f"ops added (+) / removed (-) relative to {info['diff']['against']}:")
        for phase, d in info["diff"]["ops"].items():
            c.print(f"  {phase}: " + ", ".join(f"{k} {v:+d}" for k, v in d.items()))
    c.print(f"precision plan: {info['precision_plan'] or 'fp32 everywhere (no rules)'}")


def _attach_cache():
    from kimi_compile.cli_cache import cache
    from kimi_compile.cli_verify import verify

    main.add_command(cache)
    main.add_command(verify)


_attach_cache()

if __name__ == "__main__":
    sys.exit(main())
