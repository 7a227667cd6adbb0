"""What every benchmark result records about its run: the command, the date, the git commit measured (and whether
the tree had uncommitted changes), the device and the library versions.

On a lent GPU machine the tree is copied without its history, and a `.git` found there may be a stale first
checkout: pass the commit in the environment, `KIMI_COMMIT=<sha> python bench/...`, with the sha expanded on the machine
that has the history (a `$(git rev-parse HEAD)` inside the command sent to the lent machine runs there and names the
stale checkout). KIMI_COMMIT wins over `git rev-parse HEAD` when both exist; the result says where its commit came
from, and `source_sha256` (a digest of the source files that ran) ties it to a tree whatever the commit says.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


SOURCE_DIRS = ("kimi_compile", "plugins", "passes", "bench", "recipes")


def source_sha256() -> str:
    """sha256 over the source files that ran (*.py and *.yaml under SOURCE_DIRS, by relative path and content): the
    same value for the same tree with or without a .git, so a result can be matched to a commit afterwards (check
    out candidates, compare) even when the commit recorded is wrong."""
    h = hashlib.sha256()
    files = sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*")
                   if p.suffix in (".py", ".yaml") and p.is_file() and "__pycache__" not in p.parts
                   and "results" not in p.relative_to(ROOT).parts)
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def commit() -> dict:
    """{"commit": sha, "dirty": bool | None (tracked files modified), "commit_from": "KIMI_COMMIT" | "git" |
    "unknown", "source_sha256": source_sha256()}; with KIMI_COMMIT and a checkout at another commit, "git_head" names
    that checkout's HEAD (a stale .git on a lent machine); at the same commit, "dirty" compares the files with it (a
    KIMI_COMMIT taken from a stale .git shows up as dirty)."""
    env = os.environ.get("KIMI_COMMIT")
    sha = _git("rev-parse", "HEAD")
    out = {"commit": "unknown", "dirty": None, "commit_from": "unknown"}
    if env:
        out = {"commit": env, "dirty": None, "commit_from": "KIMI_COMMIT"}
        if sha and sha != env:
            out["git_head"] = sha
    elif sha:
        out = {"commit": sha, "dirty": None, "commit_from": "git"}
    if sha and out["commit"] == sha:
        out["dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    out["source_sha256"] = source_sha256()
    return out


def versions(*names: str) -> dict:
    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def device() -> dict:
    """The GPU (name, SM count, CUDA) when torch sees one, else the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return {"name": p.name, "sms": p.multi_processor_count, "cuda": torch.version.cuda}
    except ImportError:
        pass
    return {"name": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def run_info(*packages: str) -> dict:
    """The record every result starts with; `packages` are the distributions whose versions matter."""
    return {"command": " ".join([sys.executable, *sys.argv]), "date": datetime.datetime.now().isoformat(),
            **commit(), "device": device(), "versions": versions(*packages)}


def write_result(path: str, res: dict) -> None:
    """The result as indented JSON at `path`, through a temporary file (a reader never sees half of it)."""
    import json

    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(res, indent=1))
    os.replace(tmp, path)


def per_artifact(check, packages: tuple[str, ...], description: str, extra=None) -> None:
    """The main of a benchmark over artifacts: `SCRIPT ART [ART ...] --out FILE`; each artifact's `check(art)` row
    (or its error: the next artifact still runs) printed and collected under "rows" beside run_info(*packages) and
    `extra()`; the JSON written through a temporary file."""
    import argparse
    import json
    import traceback

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {**run_info(*packages), **(extra() if extra else {}), "rows": []}
    for art in a.artifacts:
        try:
            row = {"artifact": Path(art.rstrip("/")).name, **check(art)}
        except Exception as e:  # noqa: BLE001  (recorded; the next artifact still runs)
            traceback.print_exc()
            row = {"artifact": Path(art.rstrip("/")).name, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    write_result(a.out, res)
