"""Kernels compiled ahead of time and shipped inside the artifact (docs/cuda_backend.md, "Kernel cache").

A fresh machine's first prompt would otherwise compile every Triton / Gluon kernel the program launches and run fla's
autotuning (68-97 s for a 32K prompt on an H100; 0.42 s once warm). `kimi-compile warm` (kimi_compile/warm.py) runs
the artifact once on a GPU (prefill chunks of every kind, a decode step at every batch bucket) with Triton's cache
pointed at an empty folder; `pack` stores that folder in the artifact as `kernels/triton/` with `kernels/index.json`:
every file's sha256 and size, the Triton and torch versions and the devices that warmed it. A later `warm` on another GPU
adds its entries (its own win on a conflict, such as another card's autotuning of the same architecture).

On load (cuda executor on a GPU), `install` writes the artifact's entries that Triton's cache lacks into it, entry by
entry after checking every file of the entry against the index, each file whole (temp name, then rename) and the
group file last (Triton's `__grp__<kernel>.json`, whose child paths make a kernel a cache hit: stored with bare file
names, written with paths into that cache). Entries are keyed by Triton itself (its version, the GPU target, the
kernel source and specialization), so a kernel cache from another GPU architecture or Triton version is never used
by mistake; a Triton version other than the index's is skipped whole, an entry with a file whose hash differs is
skipped whole with a warning naming the file, and either way the kernel compiles as before. The cache holds compiled
code (cubins and the launchers' shared objects that Triton loads): ship it as you ship the artifact.

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

from kimi_compile.artifact import current_umask

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


GROUP = "__grp__"  # Triton's group files: {"child_paths": {file name: absolute path}} of one compiled kernel


def _is_group(name: str) -> bool:
    return name.startswith(GROUP)


def _group_children(data: bytes, where: str) -> dict[str, str]:
    """A group file's child_paths (file name -> path), checked; KernelCacheError naming `where` otherwise."""
    try:
        grp = json.loads(data.decode("utf-8"))
        children = grp["child_paths"]
        ok = isinstance(children, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in children.items())
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise KernelCacheError(f"{where}: not a Triton group file (expected JSON with child_paths)")
    return children


def _scan(cache_dir: Path) -> dict[str, bytes]:
    """{ENTRY/FILE: bytes} of a Triton cache folder (one folder per key, files in it); Triton's temp folders and
    lock files left out. A group file's child paths (absolute, into `cache_dir`) become bare file names of its own
    entry (install makes them absolute again where it installs); an entry whose group file names a file elsewhere is
    left out whole."""
    out: dict[str, bytes] = {}
    for entry in sorted(p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith("tmp.")):
        files: dict[str, bytes] = {}
        for f in sorted(entry.iterdir()):
            if f.is_file() and not f.is_symlink() and not f.name.startswith("tmp.") and f.name != "lock":
                files[f.name] = f.read_bytes()
        try:
            for name, data in list(files.items()):
                if _is_group(name):
                    children = _group_children(data, str(entry / name))
                    if any(Path(c).parent != entry or Path(c).name not in files for c in children.values()):
                        raise KernelCacheError(f"{entry / name}: names files outside its entry or not there")
                    files[name] = json.dumps({"child_paths": {k: Path(v).name for k, v in children.items()}},
                                             sort_keys=True).encode()
        except KernelCacheError as e:
            log.warning("kernel cache: %s; entry %s left out", e, entry.name)
            continue
        out.update({f"{entry.name}/{name}": data for name, data in files.items()})
    return out


def _write_atomic(data: bytes, dst: Path, mode: int) -> None:
    """dst written whole or not at all (temp name in its folder, then rename), with permissions `mode`."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _info(data: bytes) -> dict[str, Any]:
    import hashlib

    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def pack(cache_dir: str | os.PathLike[str], artifact_dir: str | os.PathLike[str], record: dict[str, Any]) -> dict:
    """Merge the Triton cache folder `cache_dir` into the artifact's kernel cache: its entries replace the artifact's
    entries of the same key, the others stay (unless warmed with another Triton version: those could never be hit
    and are dropped). `record` (versions, device, what was run) is added to the index's `warms`. Staged beside the old
    cache and swapped in by rename (the old one restored if the swap fails). Returns the new index."""
    root = Path(artifact_dir)
    old = read_index(root)
    new_files = _scan(Path(cache_dir))
    new_entries = {rel.split("/")[0] for rel in new_files}
    version = record.get("versions", {}).get("triton")
    keep_old = old is not None and old.get("triton") == version
    fmode, dmode = 0o666 & ~current_umask(), 0o777 & ~current_umask()
    staging = Path(tempfile.mkdtemp(prefix=".kernels-", dir=root))
    try:
        os.chmod(staging, dmode)
        files: dict[str, dict[str, Any]] = {}
        if keep_old:  # the previous warms' entries this one did not produce
            for rel, info in old["files"].items():
                src = root / DIR / TRITON / rel
                if rel.split("/")[0] not in new_entries and src.is_file():
                    _write_atomic(src.read_bytes(), staging / TRITON / rel, fmode)
                    files[rel] = info
        for rel, data in new_files.items():
            _write_atomic(data, staging / TRITON / rel, fmode)
            files[rel] = _info(data)
        for d in (staging / TRITON, *(staging / TRITON).glob("*")):
            if d.is_dir():
                os.chmod(d, dmode)
        index = {"schema": SCHEMA, "triton": version,
                 "warms": [*(old["warms"] if keep_old else []), record], "files": dict(sorted(files.items())),
                 "entries": len({rel.split("/")[0] for rel in files}),
                 "bytes": sum(i["bytes"] for i in files.values())}
        _write_atomic((json.dumps(index, indent=1) + "\n").encode(), staging / INDEX, fmode)
        target = root / DIR
        retired = None
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=".kernels-old-", dir=root))
            os.rename(target, retired / DIR)
        try:
            os.rename(staging, target)
        except BaseException:
            if retired is not None:
                os.rename(retired / DIR, target)
            raise
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
        return index
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def install(artifact_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str],
            triton_version: str) -> dict[str, Any]:
    """Install the artifact's kernel cache into Triton's cache folder `cache_dir`, entry by entry: every file of an
    entry is checked against the index first (one that does not match skips the whole entry, with a warning naming
    it: that kernel compiles on first use); the files Triton lacks are written whole (temp name, then rename), the
    group file last with its child paths pointing into `cache_dir`, as Triton writes its own entries. Returns
    {"status", "files", "copied", "present", "skipped": [files]}; status "none" (the artifact ships no kernels),
    "version" (warmed with another Triton: nothing copied) or "installed"."""
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
    fmode = 0o666 & ~current_umask()
    entries: dict[str, list[str]] = {}
    for rel in index["files"]:
        entries.setdefault(rel.split("/")[0], []).append(rel)
    for entry, rels in entries.items():
        if all((dst_root / rel).exists() for rel in rels):  # installed already (a restart): nothing to read
            report["present"] += len(rels)
            continue
        data: dict[str, bytes] = {}
        try:
            for rel in rels:
                src = root / DIR / TRITON / rel
                info = index["files"][rel]
                blob = src.read_bytes() if src.is_file() and not src.is_symlink() else None
                if blob is None or _info(blob) != {"sha256": info["sha256"], "bytes": info["bytes"]}:
                    raise KernelCacheError(f"{src} is missing or does not match {index_path(root)} (modified after "
                                           "`kimi-compile warm`)")
                if _is_group(Path(rel).name):
                    children = _group_children(blob, str(src))
                    if any(Path(c).name != c or f"{entry}/{c}" not in index["files"] for c in children.values()):
                        raise KernelCacheError(f"{src}: names files outside its entry")
                    blob = json.dumps({"child_paths": {k: str(dst_root / entry / c) for k, c in children.items()}}
                                      ).encode()
                data[rel] = blob
            for rel in sorted(rels, key=lambda r: _is_group(Path(r).name)):  # group files last
                dst = dst_root / rel
                if dst.exists():
                    report["present"] += 1
                    continue
                _write_atomic(data[rel], dst, fmode)
                report["copied"] += 1
        except (KernelCacheError, OSError) as e:
            log.warning("kernel cache of %s: entry %s skipped (%s); its kernel compiles on first use", root, entry, e)
            report["skipped"] += [r for r in rels if not (dst_root / r).exists()]
    return report


def install_for_triton(artifact_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`install` into the running Triton's cache folder (knobs.cache.dir). A custom Triton cache manager
    (TRITON_CACHE_MANAGER / remote cache) is left alone: status "custom"."""
    import triton
    from triton import knobs

    if knobs.cache.manager_class is not None and knobs.cache.manager_class.__name__ != "FileCacheManager":
        return {"status": "custom", "files": 0, "copied": 0, "present": 0, "skipped": []}
    if not knobs.cache.dir:
        return {"status": "no cache dir", "files": 0, "copied": 0, "present": 0, "skipped": []}
    return install(artifact_dir, knobs.cache.dir, triton.__version__)
