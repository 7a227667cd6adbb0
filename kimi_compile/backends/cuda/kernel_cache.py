"""Kernels compiled ahead of time and shipped inside the artifact (docs/cuda_backend.md, "Kernel cache").

A fresh machine's first prompt would otherwise compile every Triton / Gluon kernel the program launches and run fla's
autotuning (68-97 s for a 32K prompt on an H100; 0.42 s once warm). `kimi-compile warm` (kimi_compile/warm.py) runs
the artifact once on a GPU (prefill chunks of every kind, a decode step at every batch bucket) with Triton's cache
pointed at an empty folder; `pack` stores that folder in the artifact as `kernels/triton/` with `kernels/index.json`:
every file's sha256 and size, the Triton and torch versions and the devices that warmed it. A later `warm` on another GPU
adds its entries (its own win on a conflict, such as another card's autotuning of the same architecture).

On load (cuda executor on a GPU), `install` copies the artifact's entries that Triton's cache lacks into it (file by
file: temp name, then rename), after checking each file against the index; the program then finds its kernels and
autotuning results compiled. Entries are keyed by Triton itself (its version, the GPU target, the kernel source and
specialization), so a kernel cache from another GPU architecture or Triton version is never used by mistake; a
Triton version other than the index's is skipped whole, a file whose hash differs is skipped with a warning naming
it, and either way the kernel is compiled as before. The cache holds compiled code (cubins and the launchers' shared
objects that Triton loads): ship it as you ship the artifact.

No torch or triton import at module level (the runtime imports this only on a GPU).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kimi_compile.cache import sha256_file

log = logging.getLogger(__name__)

DIR = "kernels"
TRITON = "triton"
INDEX = "index.json"
SCHEMA = 1


class KernelCacheError(ValueError):
    pass


def index_path(artifact_dir: str | os.PathLike[str]) -> Path:
    return Path(artifact_dir) / DIR / INDEX


def read_index(artifact_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The artifact's kernel index, or None when it ships no kernels. A bad index raises naming the file."""
    path = index_path(artifact_dir)
    if not path.exists():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise KernelCacheError(f"{path}: cannot be read as JSON ({e}); run `kimi-compile warm` again") from None
    if not isinstance(index, dict) or index.get("schema") != SCHEMA or not isinstance(index.get("files"), dict):
        raise KernelCacheError(f"{path}: expected a kernel index of schema {SCHEMA} with a files table; run "
                               "`kimi-compile warm` again")
    for rel, info in index["files"].items():
        parts = Path(rel).parts
        if (len(parts) != 2 or any(p in ("", ".", "..") for p in parts) or Path(rel).is_absolute()
                or not isinstance(info, dict) or not isinstance(info.get("sha256"), str)
                or not isinstance(info.get("bytes"), int)):
            raise KernelCacheError(f"{path}: bad entry {rel!r}: expected 'ENTRY/FILE' with {{sha256, bytes}}")
    return index


def _scan(cache_dir: Path) -> dict[str, dict[str, Any]]:
    """{ENTRY/FILE: {sha256, bytes}} of a Triton cache folder (one folder per key, files in it); Triton's own temp
    files (`tmp.pid_*`) and lock files left out."""
    out: dict[str, dict[str, Any]] = {}
    for entry in sorted(p for p in cache_dir.iterdir() if p.is_dir()):
        for f in sorted(entry.iterdir()):
            if f.is_file() and not f.is_symlink() and not f.name.startswith("tmp.") and f.name != "lock":
                out[f"{entry.name}/{f.name}"] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    return out


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pack(cache_dir: str | os.PathLike[str], artifact_dir: str | os.PathLike[str], record: dict[str, Any]) -> dict:
    """Merge the Triton cache folder `cache_dir` into the artifact's kernel cache: its entries replace the artifact's
    entries of the same key, the others stay. `record` (versions, device, what was run) is added to the index's
    `warms` list. Written beside the old cache and swapped in by rename. Returns the new index."""
    root = Path(artifact_dir)
    src = Path(cache_dir)
    old = read_index(root)
    new_files = _scan(src)
    new_entries = {rel.split("/")[0] for rel in new_files}
    staging = Path(tempfile.mkdtemp(prefix=".kernels-", dir=root))
    try:
        files: dict[str, dict[str, Any]] = {}
        if old is not None:  # the previous warms' entries this one did not produce
            for rel, info in old["files"].items():
                if rel.split("/")[0] not in new_entries and (root / DIR / TRITON / rel).is_file():
                    _copy_atomic(root / DIR / TRITON / rel, staging / TRITON / rel)
                    files[rel] = info
        for rel, info in new_files.items():
            _copy_atomic(src / rel, staging / TRITON / rel)
            files[rel] = info
        index = {"schema": SCHEMA, "triton": record.get("versions", {}).get("triton"),
                 "warms": [*(old or {}).get("warms", []), record], "files": dict(sorted(files.items())),
                 "entries": len({rel.split("/")[0] for rel in files}),
                 "bytes": sum(i["bytes"] for i in files.values())}
        (staging / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        target = root / DIR
        retired = None
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=".kernels-old-", dir=root))
            os.rename(target, retired / DIR)
        os.rename(staging, target)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
        return index
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def install(artifact_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str],
            triton_version: str) -> dict[str, Any]:
    """Copy the artifact's kernel cache into Triton's cache folder `cache_dir` (files it lacks; each checked against
    the index first). Returns {"status", "files", "copied", "present", "skipped": [files]}; status "none" (the
    artifact ships no kernels), "version" (warmed with another Triton: nothing copied) or "installed"."""
    root = Path(artifact_dir)
    index = read_index(root)
    if index is None:
        return {"status": "none", "files": 0, "copied": 0, "present": 0, "skipped": []}
    report = {"status": "installed", "files": len(index["files"]), "copied": 0, "present": 0, "skipped": [],
              "triton": index.get("triton")}
    if index.get("triton") != triton_version:
        log.info("kernel cache of %s: warmed with Triton %s, this is %s; kernels compile on first use",
                 root, index.get("triton"), triton_version)
        return {**report, "status": "version"}
    dst_root = Path(cache_dir)
    for rel, info in index["files"].items():
        dst = dst_root / rel
        if dst.exists():
            report["present"] += 1
            continue
        src = root / DIR / TRITON / rel
        if (not src.is_file() or src.is_symlink() or src.stat().st_size != info["bytes"]
                or sha256_file(src) != info["sha256"]):
            log.warning("kernel cache of %s: %s is missing or does not match %s (modified after `kimi-compile "
                        "warm`); skipped, that kernel compiles on first use", root, src, index_path(root))
            report["skipped"].append(rel)
            continue
        _copy_atomic(src, dst)
        report["copied"] += 1
    return report


def install_for_triton(artifact_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`install` into the running Triton's cache folder (knobs.cache.dir). A custom Triton cache manager
    (TRITON_CACHE_MANAGER / remote cache) is left alone: status "custom"."""
    import triton
    from triton import knobs

    if knobs.cache.manager_class is not None and knobs.cache.manager_class.__name__ != "FileCacheManager":
        return {"status": "custom", "files": 0, "copied": 0, "present": 0, "skipped": []}
    return install(artifact_dir, knobs.cache.dir, triton.__version__)
