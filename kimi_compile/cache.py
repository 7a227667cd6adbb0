"""The compile cache: content-addressed stage outputs (DESIGN.md §3, "Compile cache").

Each stage (trace, each pass, backend) stores its output as a directory keyed by `cache_key(**parts)`, the sha256
of the canonical JSON of what determines the output (e.g. input graph hash + pass name/version + options). Layout
under the root (`KIMI_COMPILE_CACHE`, else `$XDG_CACHE_HOME/kimi-compile`, else `~/.cache/kimi-compile`):

    entries/<stage>/<key>/   the producer's files + meta.json {stage, key, created, files: {rel: {bytes, sha256}}}
    locks/<stage>/<key>.lock fcntl lock held while one process builds that entry
    locks/pin/<stage>/<key>.lock  shared fcntl locks of the builds using that entry (`pinned()`): not evicted then
    tmp/                     entries being built (same filesystem, renamed into place when complete)
    stats.json               hits and misses per stage

Invariants: an entry directory is visible only when complete (producer done, meta.json written, atomic rename); two
processes building one key run the producer once and both get the entry; an entry whose files do not match its
meta.json is a miss and is rebuilt; after each put, least recently used entries are evicted until the cache fits
`max_bytes` (never the entry just written, nor one a build in any process has pinned). A read-only cache (`KIMI_COMPILE_CACHE_READONLY=1`, for CI consumers)
serves hits and writes nothing: misses are built in a temporary directory removed at interpreter exit.

This module imports no torch.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "CacheError",
    "CompileCache",
    "cache_key",
    "canonical_json",
    "sha256_file",
    "default_cache_root",
    "DEFAULT_MAX_BYTES",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 20 * 1024**3
ENV_ROOT = "KIMI_COMPILE_CACHE"
ENV_READONLY = "KIMI_COMPILE_CACHE_READONLY"
ENV_MAX_BYTES = "KIMI_COMPILE_CACHE_MAX_BYTES"
DEPENDS = "depends.json"  # an entry may list files of other entries it reads (kimi_compile/graph_io.py)
META = "meta.json"
_ARCHIVE_TOP = "kimi-compile-cache"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_TMP_MAX_AGE_S = 24 * 3600


class CacheError(Exception):
    """A compile-cache operation cannot proceed; the message says what and which path or setting to change."""


# ----------------------------------------------------------------------------------------------------------------
# Keys and hashes


def _check_jsonable(value: Any, path: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CacheError(f"cache_key: part {path!r} has a non-string key {k!r}; use string keys")
            _check_jsonable(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_jsonable(v, f"{path}[{i}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise CacheError(f"cache_key: part {path!r} is {value!r}; only finite floats are JSON-able")
    elif not isinstance(value, (str, int, bool, type(None))):
        raise CacheError(
            f"cache_key: part {path!r} is a {type(value).__name__} ({value!r:.80}), not JSON-able; "
            "pass str, int, float, bool, None, lists or dicts (e.g. str(path), a hash of bytes)"
        )


def canonical_json(value: Any) -> str:
    """Deterministic JSON (sorted keys, no whitespace, UTF-8); tuples are lists."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def cache_key(**parts: Any) -> str:
    """sha256 (hex) of the canonical JSON of `parts`; raises CacheError naming a part that is not JSON-able."""
    for name, value in parts.items():
        _check_jsonable(value, name)
    return hashlib.sha256(canonical_json(parts).encode("utf-8")).hexdigest()


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def default_cache_root() -> Path:
    env = os.environ.get(ENV_ROOT)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kimi-compile"


def _parse_bytes(value: str | int, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", str(value))
        if not m:
            raise CacheError(f"{what}: expected a byte count such as 20000000000 or 20G, got {value!r}")
        n = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0:
        raise CacheError(f"{what}: expected a positive byte count, got {value!r}")
    return n


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise CacheError(f"invalid cache {kind} {name!r}: use letters, digits, '_', '.', '-' (at most 128)")


def _scan_files(directory: Path) -> dict[str, dict[str, Any]]:
    """{posix rel path: {bytes, sha256}} for every regular file under `directory` except meta.json at the top."""
    out: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = Path(dirpath) / name
            rel = full.relative_to(directory).as_posix()
            if rel == META:
                continue
            if full.is_symlink() or not full.is_file():
                raise CacheError(f"cache entry file {rel!r} is a link or special file; write regular files only")
            out[rel] = {"bytes": full.stat().st_size, "sha256": sha256_file(full)}
    return dict(sorted(out.items()))


def _entry_problem(entry: Path, stage: str | None = None, key: str | None = None, strict: bool = False) -> str | None:
    """Why `entry` is not a valid entry (None when valid): meta.json missing/bad, file missing, size or hash off."""
    try:
        meta = json.loads((entry / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "meta.json is missing"
    except (OSError, ValueError) as e:
        return f"meta.json is unreadable ({e})"
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        return "meta.json has no files table"
    if (entry / DEPENDS).is_file():  # files of other entries this one reads (shared weights): all still there?
        try:
            depends = json.loads((entry / DEPENDS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"{DEPENDS} is unreadable ({e})"
        gone = [d for d in depends if not os.path.isfile(d)]
        if gone:
            return f"it reads {gone[0]}, which is gone (evicted or removed)"
    if stage is not None and (meta.get("stage") != stage or meta.get("key") != key):
        return f"meta.json names {meta.get('stage')}/{meta.get('key')}"
    for rel, info in files.items():
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or not isinstance(info, dict):
            return f"meta.json lists a bad path {rel!r}"
        path = entry / rel
        if path.is_symlink() or not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != info.get("bytes"):
            return f"{rel} has {size} bytes, meta.json says {info.get('bytes')}"
        if sha256_file(path) != info.get("sha256"):
            return f"{rel} does not match its sha256 in meta.json"
    if strict:
        try:
            listed = set(_scan_files(entry))
        except CacheError as e:
            return str(e)
        extra = sorted(listed - set(files))
        if extra:
            return f"{extra[0]} is not listed in meta.json"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------


class CompileCache:
    """Content-addressed, per-stage store of compile outputs. See the module docstring for layout and invariants."""

    cache_key = staticmethod(cache_key)

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        max_bytes: int | str | None = None,
        read_only: bool | None = None,
        verify_hashes: bool = True,
    ):
        self.root = Path(root).expanduser() if root is not None else default_cache_root()
        if max_bytes is None:
            env = os.environ.get(ENV_MAX_BYTES)
            max_bytes = _parse_bytes(env, ENV_MAX_BYTES) if env else DEFAULT_MAX_BYTES
        self.max_bytes = _parse_bytes(max_bytes, "max_bytes")
        self.read_only = _env_flag(ENV_READONLY) if read_only is None else bool(read_only)
        self.verify_hashes = verify_hashes
        # hits/misses seen by this instance, {stage: {"hits": n, "misses": n}} (the build's report uses it)
        self.session: dict[str, dict[str, int]] = {}
        self._in_use: set[Path] = set()  # entries used inside `pinned()`: not evicted until it exits
        self._pin_fds: list[int] = []  # shared locks on their pin files: no other process evicts them either
        self._pins = 0
        self._scratch: list[Path] = []

    # -- paths ---------------------------------------------------------------------------------------------------

    @property
    def entries_dir(self) -> Path:
        return self.root / "entries"

    def entry_path(self, stage: str, key: str) -> Path:
        _check_name("stage", stage)
        _check_name("key", key)
        return self.entries_dir / stage / key

    def _ensure_writable(self) -> None:
        if self.read_only:
            raise CacheError(f"compile cache {self.root} is read-only ({ENV_READONLY}=1); it cannot be changed")
        try:
            for sub in ("entries", "locks", "tmp"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.root / "tmp", prefix=".probe-")
            probe.close()
        except OSError as e:
            raise CacheError(
                f"compile cache dir {self.root} is not writable ({e.strerror or e}): set {ENV_ROOT} to a writable "
                f"directory, or {ENV_READONLY}=1 to only read it"
            ) from None

    @contextlib.contextmanager
    def _lock(self, name: str, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
        """An fcntl lock on locks/<name>.lock; yields False when non-blocking and held elsewhere."""
        path = self.root / "locks" / f"{name}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flags = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            if not blocking:
                flags |= fcntl.LOCK_NB
            try:
                fcntl.flock(fd, flags)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # -- lookup --------------------------------------------------------------------------------------------------

    def _valid_entry(self, stage: str, key: str) -> tuple[Path | None, str | None]:
        """(entry, None) when valid; (None, problem) when present but corrupt; (None, None) when absent."""
        entry = self.entry_path(stage, key)
        if not entry.is_dir():
            return None, None
        if self.verify_hashes:
            problem = _entry_problem(entry, stage, key)
        else:
            problem = None if (entry / META).is_file() else "meta.json is missing"
        if problem:
            return None, problem
        return entry, None

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Within the block, no entry it uses is evicted, by this process or another one sharing the cache (a build
        reads weights that later entries share with earlier ones until it has written its artifact): each entry
        looked up inside it holds a shared lock on locks/pin/<stage>/<key>.lock, which `evict` must take exclusively
        to remove the entry."""
        self._pins += 1
        try:
            yield
        finally:
            self._pins -= 1
            if not self._pins:
                self._in_use.clear()
                for fd in self._pin_fds:
                    os.close(fd)  # releases the shared lock
                self._pin_fds.clear()

    def _pin_path(self, stage: str, key: str) -> Path:
        return self.root / "locks" / "pin" / stage / f"{key}.lock"

    def _hold(self, stage: str, key: str) -> None:
        """Inside `pinned()`: the shared pin lock of (stage, key), taken before the entry is validated (an eviction
        under way finishes first, and the lookup then sees the entry gone) and kept until `pinned()` exits."""
        entry = self.entry_path(stage, key)
        if not self._pins or entry in self._in_use:
            return
        self._in_use.add(entry)  # this process's own evictions skip it
        path = self._pin_path(stage, key)
        try:
            if self.read_only:  # writes nothing: pins through a pin file only if one exists
                fd = os.open(path, os.O_RDONLY)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # none there (read-only), or a cache dir this process cannot write
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._pin_fds.append(fd)

    def _touch(self, entry: Path) -> None:
        if self.read_only:
            return
        with contextlib.suppress(OSError):
            os.utime(entry)

    def get(self, stage: str, key: str) -> Path | None:
        """The entry directory for (stage, key), or None on a miss (absent or corrupt). Marks the entry as used."""
        self._hold(stage, key)
        entry, problem = self._valid_entry(stage, key)
        if problem:
            log.warning("compile cache: %s/%s is corrupt (%s); treating it as a miss", stage, key[:12], problem)
        if entry is not None:
            self._touch(entry)
        self._record(stage, hit=entry is not None)
        return entry

    def get_or_create(self, stage: str, key: str, producer: Callable[[Path], None]) -> tuple[Path, bool]:
        """The entry for (stage, key) and whether it was a hit; on a miss `producer(dir)` writes the files into a
        fresh directory that becomes the entry. Concurrent callers of one key run the producer once."""
        self._hold(stage, key)
        entry, problem = self._valid_entry(stage, key)
        if entry is not None:
            self._touch(entry)
            self._record(stage, hit=True)
            return entry, True
        if self.read_only:
            if problem:
                log.warning("compile cache: %s/%s is corrupt (%s); building it outside the read-only cache",
                            stage, key[:12], problem)
            return self._produce_scratch(stage, key, producer), False

        self._ensure_writable()
        with self._lock(f"{stage}/{key}"):
            entry, problem = self._valid_entry(stage, key)  # another process may have built it meanwhile
            if entry is not None:
                self._touch(entry)
                self._record(stage, hit=True)
                return entry, True
            final = self.entry_path(stage, key)
            if problem:
                log.warning("compile cache: %s/%s is corrupt (%s); rebuilding it", stage, key[:12], problem)
                self._remove_entry(final)
            tmp = self._new_tmp(stage, key)
            try:
                self._run_producer(producer, tmp, stage, key)
                final.parent.mkdir(parents=True, exist_ok=True)
                os.rename(tmp, final)
            except BaseException:
                _rmtree(tmp)
                raise
        self._record(stage, hit=False)
        self.evict(protect=final)
        return final, False

    def _new_tmp(self, stage: str, key: str) -> Path:
        prefix = f"{stage}.{key[:16]}.{socket.gethostname()}.{os.getpid()}."
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.root / "tmp"))

    def _run_producer(self, producer: Callable[[Path], None], directory: Path, stage: str, key: str) -> None:
        producer(directory)
        if (directory / META).exists():
            raise CacheError(f"compile cache: the {stage} producer wrote {META}, a name the cache reserves")
        files = _scan_files(directory)
        meta = {
            "stage": stage,
            "key": key,
            "created": time.time(),
            "bytes": sum(f["bytes"] for f in files.values()),
            "files": files,
        }
        data = json.dumps(meta, indent=1, sort_keys=True).encode()
        fd = os.open(directory / META, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _produce_scratch(self, stage: str, key: str, producer: Callable[[Path], None]) -> Path:
        tmp = Path(tempfile.mkdtemp(prefix=f"kimi-compile-{stage}-"))
        if not self._scratch:
            atexit.register(self._drop_scratch)
        self._scratch.append(tmp)
        try:
            self._run_producer(producer, tmp, stage, key)
        except BaseException:
            _rmtree(tmp)
            raise
        self._record(stage, hit=False)
        return tmp

    def _drop_scratch(self) -> None:
        for p in self._scratch:
            _rmtree(p)
        self._scratch.clear()

    def _remove_entry(self, entry: Path) -> None:
        """Makes `entry` disappear atomically (rename into tmp), then deletes it."""
        if not entry.exists():
            return
        grave = Path(tempfile.mkdtemp(prefix="evict.", dir=self.root / "tmp"))
        try:
            os.rename(entry, grave / "entry")
        except FileNotFoundError:
            pass
        _rmtree(grave)

    # -- stats ---------------------------------------------------------------------------------------------------

    def _record(self, stage: str, hit: bool) -> None:
        field = "hits" if hit else "misses"
        s = self.session.setdefault(stage, {"hits": 0, "misses": 0})
        s[field] += 1
        if self.read_only:
            return
        try:
            with self._lock("stats"):
                data = self._read_stats()
                per = data.setdefault(stage, {"hits": 0, "misses": 0})
                per[field] = per.get(field, 0) + 1
                self._write_json(self.root / "stats.json", data)
        except OSError as e:  # statistics never fail a build
            log.warning("compile cache: cannot update stats.json (%s)", e)

    def _read_stats(self) -> dict[str, dict[str, int]]:
        try:
            data = json.loads((self.root / "stats.json").read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_json(self, path: Path, data: Any) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)

    def _iter_entries(self) -> Iterator[tuple[str, str, Path]]:
        if not self.entries_dir.is_dir():
            return
        for stage_dir in sorted(self.entries_dir.iterdir()):
            if not stage_dir.is_dir():
                continue
            for entry in sorted(stage_dir.iterdir()):
                if entry.is_dir():
                    yield stage_dir.name, entry.name, entry

    @staticmethod
    def _entry_bytes(entry: Path) -> int:
        try:
            meta = json.loads((entry / META).read_text(encoding="utf-8"))
            return int(meta["bytes"]) + (entry / META).stat().st_size
        except (OSError, ValueError, KeyError, TypeError):
            total = 0
            for dirpath, _, filenames in os.walk(entry):
                for name in filenames:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(dirpath, name)).st_size
            return total

    def stats(self) -> dict[str, Any]:
        """{root, read_only, max_bytes, entries, bytes, stages: {stage: {entries, bytes, hits, misses}}, session}."""
        stages: dict[str, dict[str, int]] = {}
        for stage, _key, entry in self._iter_entries():
            s = stages.setdefault(stage, {"entries": 0, "bytes": 0, "hits": 0, "misses": 0})
            s["entries"] += 1
            s["bytes"] += self._entry_bytes(entry)
        for stage, counts in self._read_stats().items():
            s = stages.setdefault(stage, {"entries": 0, "bytes": 0, "hits": 0, "misses": 0})
            if isinstance(counts, dict):
                s["hits"] = int(counts.get("hits", 0))
                s["misses"] = int(counts.get("misses", 0))
        stages = dict(sorted(stages.items()))
        return {
            "root": str(self.root),
            "read_only": self.read_only,
            "max_bytes": self.max_bytes,
            "entries": sum(s["entries"] for s in stages.values()),
            "bytes": sum(s["bytes"] for s in stages.values()),
            "hits": sum(s["hits"] for s in stages.values()),
            "misses": sum(s["misses"] for s in stages.values()),
            "stages": stages,
            "session": {k: dict(v) for k, v in sorted(self.session.items())},
        }

    # -- eviction and clearing -----------------------------------------------------------------------------------

    def evict(self, protect: Path | None = None) -> list[tuple[str, str]]:
        """Removes least recently used entries until the cache fits max_bytes; returns the (stage, key) removed."""
        if self.read_only or not self.entries_dir.is_dir():
            return []
        removed: list[tuple[str, str]] = []
        with self._lock("evict"):
            entries = []
            for stage, key, entry in self._iter_entries():
                try:
                    used = entry.stat().st_mtime
                except OSError:
                    continue
                entries.append((used, stage, key, entry, self._entry_bytes(entry)))
            total = sum(e[4] for e in entries)
            for _used, stage, key, entry, size in sorted(entries, key=lambda e: (e[0], e[1], e[2])):
                if total <= self.max_bytes:
                    break
                if (protect is not None and entry == protect) or entry in self._in_use:
                    continue
                with self._lock(f"{stage}/{key}", blocking=False) as got, \
                        self._lock(f"pin/{stage}/{key}", blocking=False) as free:
                    if not (got and free):  # being rebuilt right now, or pinned by a build in another process
                        continue
                    self._remove_entry(entry)
                total -= size
                removed.append((stage, key))
            self._sweep_tmp()
        for stage, key in removed:
            log.info("compile cache: evicted %s/%s", stage, key[:12])
        return removed

    def _sweep_tmp(self) -> None:
        """Removes build dirs left by dead processes on this host (or older than a day)."""
        tmp_dir = self.root / "tmp"
        if not tmp_dir.is_dir():
            return
        host = socket.gethostname()
        now = time.time()
        for p in tmp_dir.iterdir():
            parts = p.name.split(".")
            try:
                age = now - p.lstat().st_mtime
            except OSError:
                continue
            dead = False
            if p.name.startswith("evict."):
                dead = age > 60
            elif len(parts) >= 5 and parts[-2].isdigit():
                dead = (host in p.name and not _pid_alive(int(parts[-2]))) or age > _TMP_MAX_AGE_S
            elif age > _TMP_MAX_AGE_S:
                dead = True
            if dead:
                if p.is_dir():
                    _rmtree(p)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()

    def clear(self, stage: str | None = None) -> int:
        """Removes every entry (of `stage`, if given) and its hit/miss counts; returns the number removed."""
        self._ensure_writable()
        if stage is not None:
            _check_name("stage", stage)
        n = 0
        with self._lock("evict"):
            for s, key, entry in list(self._iter_entries()):
                if stage is not None and s != stage:
                    continue
                with self._lock(f"{s}/{key}"):
                    self._remove_entry(entry)
                n += 1
            for stage_dir in list(self.entries_dir.iterdir()):
                if stage is None or stage_dir.name == stage:
                    with contextlib.suppress(OSError):
                        stage_dir.rmdir()
            with self._lock("stats"):
                data = self._read_stats()
                if stage is None:
                    data = {}
                else:
                    data.pop(stage, None)
                self._write_json(self.root / "stats.json", data)
            self._sweep_tmp()
        return n

    # -- export / import -----------------------------------------------------------------------------------------

    def export(self, tar_path: str | os.PathLike[str]) -> int:
        """Writes every valid entry to a tar.gz (kimi-compile-cache/<stage>/<key>/...); returns the entry count."""
        tar_path = Path(tar_path)
        count = 0
        tar_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{tar_path.name}.", dir=tar_path.parent)
        os.close(fd)
        try:
            with tarfile.open(tmp_name, "w:gz") as tar:
                for stage, key, entry in self._iter_entries():
                    problem = _entry_problem(entry, stage, key)
                    if problem:
                        log.warning("compile cache: not exporting corrupt entry %s/%s (%s)", stage, key[:12], problem)
                        continue
                    tar.add(entry, arcname=f"{_ARCHIVE_TOP}/{stage}/{key}", recursive=True)
                    count += 1
            os.replace(tmp_name, tar_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        return count

    def import_(self, tar_path: str | os.PathLike[str]) -> int:
        """Adds the entries of an exported tar.gz; returns how many were new. The archive is checked completely
        (member paths and types, every meta.json hash) before anything enters the cache: a bad archive raises
        CacheError and leaves the cache unchanged."""
        tar_path = Path(tar_path)
        self._ensure_writable()
        try:
            tar = tarfile.open(tar_path, "r:gz")
        except FileNotFoundError:
            raise CacheError(f"{tar_path}: no such cache archive") from None
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise CacheError(
                f"{tar_path}: not a readable cache archive ({_first_line(e)}); expected a .tar.gz made by "
                "`kimi-compile cache export`"
            ) from None
        staging = Path(tempfile.mkdtemp(prefix="import.", dir=self.root / "tmp"))
        try:
            with tar:
                keys = self._check_members(tar, tar_path)
                try:
                    extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                    for member in tar.getmembers():  # already checked: regular files and dirs inside the top
                        tar.extract(member, staging, set_attrs=False, **extra)
                except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
                    raise CacheError(f"{tar_path}: cannot extract the cache archive ({_first_line(e)})") from None
            for stage, key in keys:
                problem = _entry_problem(staging / _ARCHIVE_TOP / stage / key, stage, key, strict=True)
                if problem:
                    raise CacheError(f"{tar_path}: entry {stage}/{key} is corrupt ({problem}); nothing was imported")
            added = 0
            for stage, key in sorted(keys):
                final = self.entry_path(stage, key)
                with self._lock(f"{stage}/{key}"):
                    existing, problem = self._valid_entry(stage, key)
                    if existing is not None:
                        continue
                    if problem:
                        self._remove_entry(final)
                    final.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(staging / _ARCHIVE_TOP / stage / key, final)
                    os.utime(final)
                added += 1
        finally:
            _rmtree(staging)
        if added:
            self.evict()
        return added

    @staticmethod
    def _check_members(tar: tarfile.TarFile, tar_path: Path) -> set[tuple[str, str]]:
        keys: set[tuple[str, str]] = set()
        try:
            members = tar.getmembers()
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise CacheError(f"{tar_path}: not a readable cache archive ({_first_line(e)})") from None
        for m in members:
            name = m.name
            pure = PurePosixPath(name)
            bad = None
            if name.startswith("/") or pure.is_absolute() or re.match(r"^[A-Za-z]:", name):
                bad = "an absolute path"
            elif ".." in pure.parts or "\\" in name:
                bad = "a '..' or backslash component"
            elif not (m.isfile() or m.isdir()):
                bad = "a link or special file"
            elif pure.parts[0] != _ARCHIVE_TOP:
                bad = f"outside {_ARCHIVE_TOP}/"
            if bad:
                raise CacheError(f"{tar_path}: refusing cache archive: member {name!r} is {bad}; nothing was imported")
            parts = pure.parts
            if len(parts) >= 2:
                try:
                    _check_name("stage", parts[1])
                    if len(parts) >= 3:
                        _check_name("key", parts[2])
                except CacheError as e:
                    raise CacheError(f"{tar_path}: refusing cache archive: member {name!r}: {e}") from None
            if len(parts) >= 4:
                keys.add((parts[1], parts[2]))
            elif m.isfile():
                raise CacheError(f"{tar_path}: refusing cache archive: file {name!r} is not inside an entry")
        if not keys:
            raise CacheError(f"{tar_path}: the archive holds no cache entries")
        return keys
