"""`kimi-compile cache stats|clear|export|import`: look at and move the compile cache (kimi_compile/cache.py).

The main CLI attaches the group with `cli.add_command(cache)`. The cache location comes from `--cache-dir`, else
`KIMI_COMPILE_CACHE`, else the user cache dir; `KIMI_COMPILE_CACHE_READONLY=1` makes it read-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from kimi_compile.cache import CacheError, CompileCache

__all__ = ["cache"]


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _open(ctx: click.Context) -> CompileCache:
    try:
        return CompileCache(root=ctx.obj.get("cache_dir") if ctx.obj else None)
    except CacheError as e:
        raise click.ClickException(str(e)) from None


@click.group("cache")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Compile cache directory (default: $KIMI_COMPILE_CACHE or ~/.cache/kimi-compile).",
)
@click.pass_context
def cache(ctx: click.Context, cache_dir: Path | None) -> None:
    """Inspect, clear, export and import the compile cache."""
    ctx.ensure_object(dict)
    if cache_dir is not None:
        ctx.obj["cache_dir"] = cache_dir


@cache.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@click.pass_context
def stats_cmd(ctx: click.Context, as_json: bool) -> None:
    """Entries, bytes, hits and misses per stage."""
    cc = _open(ctx)
    try:
        st = cc.stats()
    except (CacheError, OSError) as e:
        raise click.ClickException(f"cannot read compile cache {cc.root}: {e}") from None
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    console = Console(soft_wrap=True)
    mode = " (read-only)" if st["read_only"] else ""
    console.print(f"compile cache {st['root']}{mode}")
    table = Table(show_edge=False)
    table.add_column("stage")
    table.add_column("entries", justify="right")
    table.add_column("size", justify="right")
    table.add_column("hits", justify="right")
    table.add_column("misses", justify="right")
    for stage, s in st["stages"].items():
        table.add_row(stage, str(s["entries"]), _human(s["bytes"]), str(s["hits"]), str(s["misses"]))
    table.add_row("total", str(st["entries"]), _human(st["bytes"]), str(st["hits"]), str(st["misses"]),
                  style="bold")
    console.print(table)
    console.print(f"{_human(st['bytes'])} of {_human(st['max_bytes'])} used")


@cache.command("clear")
@click.option("--stage", default=None, help="Only clear this stage (e.g. trace, backend, a pass name).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def clear_cmd(ctx: click.Context, stage: str | None, yes: bool) -> None:
    """Remove cached entries (all, or one stage's)."""
    cc = _open(ctx)
    what = f"stage {stage!r} of " if stage else ""
    if not yes and not click.confirm(f"Remove {what}compile cache {cc.root}?", default=False):
        raise click.ClickException("not cleared (pass --yes to skip the question)")
    try:
        n = cc.clear(stage=stage)
    except CacheError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"removed {n} entr{'y' if n == 1 else 'ies'} from {cc.root}")


@cache.command("export")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.pass_context
def export_cmd(ctx: click.Context, path: Path) -> None:
    """Write every cache entry to a .tar.gz at PATH."""
    cc = _open(ctx)
    try:
        n = cc.export(path)
    except (CacheError, OSError) as e:
        raise click.ClickException(f"cannot export compile cache to {path}: {e}") from None
    click.echo(f"exported {n} entr{'y' if n == 1 else 'ies'} to {path}")


@cache.command("import")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.pass_context
def import_cmd(ctx: click.Context, path: Path) -> None:
    """Add the entries of a .tar.gz made by `cache export`."""
    cc = _open(ctx)
    try:
        n = cc.import_(path)
    except CacheError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot import {path}: {e}") from None
    click.echo(f"imported {n} new entr{'y' if n == 1 else 'ies'} into {cc.root}")
