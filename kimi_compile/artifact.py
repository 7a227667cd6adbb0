"""The artifact: a directory with manifest.json, the files it names, and its reports (DESIGN.md §3, "Artifact").

Writing: `ArtifactWriter(out_dir, reports=REPORTS)` stages everything in a temp dir beside `out_dir` (same
filesystem). The build adds files (`add_file`, or writes to `writer.path(rel)` directly), fills `writer.manifest`,
and `commit()` records every file's sha256 and size, writes manifest.json and the reports (renderers of the final
manifest, kimi_compile.report), and renames the staged dir onto `out_dir`. Until then
`out_dir` is untouched; an exception inside the `with` block removes the staged dir; a failed swap restores the
previous artifact. No temp names ever appear at `out_dir` itself. The artifact's folders get the mode of any new
folder (0777 less the umask), like the files in them.

What may be replaced: nothing, an empty folder, or a kimi-compile artifact (a folder whose manifest.json has a
schema_version and a files table). Any other folder is refused, never emptied (`check_out_dir`). The writer notes
what `out_dir` held when it was created (or takes the note the build made when it started, `expect=`); at commit,
under a lock on the parent folder, it refuses to replace an `out_dir` that changed since: of two builds into one
`out_dir` at once, the first to commit wins whole and the other fails saying so, its staging removed.

Reading: `load_manifest(artifact_dir)` refuses a missing, unparsable, newer-schema, tampered, truncated or
incomplete artifact with an `ArtifactError` naming the artifact dir and the file.

Manifest keys (commit adds `schema_version` and `files`; the build fills the rest, all optional here):

    tool            {name, version}
    versions        {library: version}                        python, onnx, onnxruntime, torch at build time, ...
    recipe          the resolved recipe (Recipe.to_dict())
    model_config    the typed model config as a dict
    backend         {name, version, target, ...}
    graphs          {phase: {file, inputs: [{name, dtype, shape}], outputs: [...], node_count, op_histogram}}
    cache_layouts   {name: {dtype, shape, bytes_per_token, ...}}  (or a list of dicts with a name)
    pass_log        [{name, version, phase, counts: {what: n}, ms, cached}]
    precision_plan  [{role, format, options, tensors}]
    op_coverage     {op: {...}} or {op: n}
    compile_cache   {stage: {hits, misses}}
    files           {rel_path: {sha256, bytes}}                (commit)

This module imports no torch: the runtime loads artifacts with it.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from kimi_compile.cache import sha256_file

__all__ = ["SCHEMA_VERSION", "ArtifactError", "ArtifactWriter", "check_out_dir", "current_umask", "load_manifest"]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


class ArtifactError(Exception):
    """An artifact cannot be written or loaded. The message names the artifact dir and, where one is at fault, the
    file."""

    def __init__(self, artifact_dir: str | os.PathLike[str], message: str, file: str | None = None):
        self.artifact_dir = str(artifact_dir)
        self.file = file
        where = f"{self.artifact_dir}/{file}" if file else self.artifact_dir
        super().__init__(f"artifact {where}: {message}")


def current_umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_out_dir(out_dir: str | os.PathLike[str]) -> str | None:
    """What `out_dir` holds, as a note a later commit compares against: None (nothing there), "empty", or
    "artifact:<sha256 of its manifest.json>". Refuses (ArtifactError) a file, or a folder that is not an artifact."""
    out = Path(out_dir)
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink() or not out.is_dir():
        raise ArtifactError(out, "exists and is not a directory; remove it or choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return "empty"
    try:
        data = (out / MANIFEST).read_bytes()
        manifest = json.loads(data)
    except (OSError, ValueError):
        manifest = None
    if not (isinstance(manifest, dict) and "schema_version" in manifest and isinstance(manifest.get("files"), dict)):
        shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
        raise ArtifactError(out, f"is not a kimi-compile artifact (it holds {shown} and no artifact manifest.json); "
                            "refusing to replace it: choose another --out, or remove the folder yourself")
    return "artifact:" + hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def _parent_lock(out_dir: Path):
    """An exclusive flock on out_dir's parent folder (no lock file left behind), held while out_dir is swapped."""
    fd = os.open(out_dir.resolve().parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_rel(rel_path: str | os.PathLike[str], where: str) -> str:
    rel = PurePosixPath(os.fspath(rel_path).replace(os.sep, "/"))
    if not rel.parts or rel.is_absolute() or ".." in rel.parts or str(rel) in (".", ""):
        raise ArtifactError(where, f"file path {os.fspath(rel_path)!r} must be relative, without '..'")
    return rel.as_posix()


class ArtifactWriter:
    """Builds an artifact in a staging dir and commits it atomically to `out_dir`. Use as a context manager:

        with ArtifactWriter("artifacts/kimi-k3-tiny") as w:
            w.add_file("weights/model.safetensors", src_path=cached)   # hardlinked from the cache when possible
            w.manifest["recipe"] = recipe.to_dict()
            w.commit()                                                  # implicit at a clean exit of the block
    """

    _NOW = object()

    def __init__(self, out_dir: str | os.PathLike[str],
                 reports: Mapping[str, Callable[[Mapping[str, Any]], str]] | None = None, expect: Any = _NOW):
        """`reports` maps file names (report.md, ...) to renderers of the final manifest (kimi_compile.report).
        `expect`: what `check_out_dir(out_dir)` said when the work began (default: now); commit refuses if it
        changed."""
        self.out_dir = Path(out_dir)
        self.expect = check_out_dir(self.out_dir) if expect is ArtifactWriter._NOW else expect
        self.reports = dict(reports or {})
        self._reserved = {MANIFEST, *self.reports}
        self.manifest: dict[str, Any] = {}
        self._staging: Path | None = None
        self.committed = False

    # -- staging ---------------------------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        """The staging dir (created on first use); files written under it become part of the artifact."""
        if self.committed:
            raise ArtifactError(self.out_dir, "already committed; start a new ArtifactWriter")
        if self._staging is None:
            parent = self.out_dir.resolve().parent
            try:
                parent.mkdir(parents=True, exist_ok=True)
                self._staging = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.staging-", dir=parent))
                os.chmod(self._staging, 0o777 & ~current_umask())  # mkdtemp makes it 0700
            except OSError as e:
                raise ArtifactError(self.out_dir, f"cannot create the artifact's parent dir: {e}") from None
        return self._staging

    def __enter__(self) -> ArtifactWriter:
        _ = self.root
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self.committed:
            self.commit()

    def abort(self) -> None:
        """Removes the staging dir; `out_dir` is left as it was."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def path(self, rel_path: str | os.PathLike[str]) -> Path:
        """Staging path for `rel_path` (parent dirs created), for writers that save files themselves."""
        rel = _check_rel(rel_path, str(self.out_dir))
        if rel in self._reserved:
            raise ArtifactError(self.out_dir, "is written by commit(); choose another name", file=rel)
        dest = self.root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        return dest

    def _swap(self, staging: Path) -> None:
        with _parent_lock(self.out_dir):
            now = check_out_dir(self.out_dir)
            if now != self.expect:
                raise ArtifactError(self.out_dir, "another build replaced it while this one ran; that artifact is "
                                    "kept and this build's output was discarded (build again to replace it)")
            _swap_into_place(staging, self.out_dir)

    def add_file(
        self,
        rel_path: str | os.PathLike[str],
        src_path: str | os.PathLike[str] | None = None,
        data: bytes | None = None,
        link_ok: bool = True,
    ) -> Path:
        """Adds a file from `src_path` (hardlinked when `link_ok` and possible, else copied) or from `data`."""
        if (src_path is None) == (data is None):
            raise TypeError("add_file: give exactly one of src_path and data")
        dest = self.path(rel_path)
        if dest.exists():
            raise ArtifactError(self.out_dir, "added twice", file=_check_rel(rel_path, str(self.out_dir)))
        if data is not None:
            dest.write_bytes(data)
            return dest
        src = Path(src_path)  # type: ignore[arg-type]
        if not src.is_file():
            raise ArtifactError(self.out_dir, f"source {src} is not a file", file=_check_rel(rel_path, ""))
        if link_ok:
            try:
                os.link(src, dest)
                return dest
            except OSError:
                pass  # another filesystem, or links not allowed: copy
        shutil.copyfile(src, dest)
        return dest

    # -- commit ----------------------------------------------------------------------------------------------

    def commit(self) -> Path:
        """Writes manifest.json and report.md, then replaces `out_dir` with the staged artifact. Returns out_dir.
        On any failure the staging dir is removed and `out_dir` keeps its previous content."""
        staging = self.root
        try:
            manifest = self._finish(staging)
            self._swap(staging)
        except BaseException:
            self.abort()
            raise
        self._staging = None
        self.committed = True
        self.manifest = manifest
        return self.out_dir

    def _finish(self, staging: Path) -> dict[str, Any]:
        files = _scan(staging, self.out_dir, self._reserved)
        manifest = copy.deepcopy(self.manifest)
        manifest["schema_version"] = SCHEMA_VERSION
        manifest["files"] = files
        try:
            json.dumps(manifest, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ArtifactError(self.out_dir, f"the manifest is not JSON-able: {e}", file=MANIFEST) from None
        for name, render in self.reports.items():
            text = render(manifest).encode("utf-8")
            (staging / name).write_bytes(text)
            manifest["files"][name] = {"sha256": sha256_file(staging / name), "bytes": len(text)}
        manifest["files"] = dict(sorted(manifest["files"].items()))
        text = json.dumps(manifest, indent=2, allow_nan=False)
        with open(staging / MANIFEST, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        return manifest


def _scan(root: Path, where: Path, reserved: set[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel in reserved:
                continue
            if full.is_symlink() or not full.is_file():
                raise ArtifactError(where, "is a link or special file; artifacts hold regular files", file=rel)
            out[rel] = {"sha256": sha256_file(full), "bytes": full.stat().st_size}
    return out


def _swap_into_place(staging: Path, out_dir: Path) -> None:
    """rename(staging, out_dir), moving an existing out_dir aside first and restoring it if the rename fails."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ArtifactError(out_dir, "exists and is not a directory; remove it or choose another --out")
    for _attempt in range(5):  # a concurrent build of the same out_dir may swap in between; retry
        aside = None
        if out_dir.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=staging.parent)) / "artifact"
            try:
                os.rename(out_dir, aside)
            except FileNotFoundError:  # a concurrent build moved it first
                shutil.rmtree(aside.parent, ignore_errors=True)
                aside = None
            except OSError as e:
                shutil.rmtree(aside.parent, ignore_errors=True)
                raise ArtifactError(out_dir, f"cannot move the previous artifact aside: {e}") from None
        try:
            os.rename(staging, out_dir)
        except OSError as e:
            if aside is not None:
                with contextlib.suppress(OSError):
                    os.rename(aside, out_dir)
                shutil.rmtree(aside.parent, ignore_errors=True)
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and _attempt < 4:
                continue  # another build put its artifact there between our two renames
            raise ArtifactError(out_dir, f"cannot move the new artifact into place: {e}") from None
        if aside is not None:
            shutil.rmtree(aside.parent, ignore_errors=True)
        return
    raise ArtifactError(out_dir, "cannot move the new artifact into place")  # pragma: no cover


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_manifest(artifact_dir: str | os.PathLike[str], verify_hashes: bool = True) -> dict[str, Any]:
    """The artifact's manifest, after checking the schema version and every listed file's size and sha256."""
    root = Path(artifact_dir)
    if not root.exists():
        raise ArtifactError(root, "does not exist; build it with `kimi-compile build RECIPE --out DIR`")
    if not root.is_dir():
        raise ArtifactError(root, "is not a directory")
    mpath = root / MANIFEST
    try:
        text = mpath.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(root, "is missing; this is not a complete kimi-compile artifact", file=MANIFEST) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(root, f"cannot be read: {e}", file=MANIFEST) from None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise ArtifactError(root, f"is not valid JSON ({e}); rebuild the artifact", file=MANIFEST) from None
    if not isinstance(manifest, dict):
        raise ArtifactError(root, "is not a JSON object", file=MANIFEST)
    version = manifest.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ArtifactError(root, f"schema_version must be an int, got {version!r}", file=MANIFEST)
    if version > SCHEMA_VERSION:
        raise ArtifactError(
            root,
            f"artifact schema {version} is newer than this kimi-compile (supports {SCHEMA_VERSION}): "
            "upgrade kimi-compile",
            file=MANIFEST,
        )
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            root, f"artifact schema {version} is not supported (this kimi-compile reads {SCHEMA_VERSION}): "
            "rebuild the artifact", file=MANIFEST,
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(root, "has no files table", file=MANIFEST)
    for rel, info in files.items():
        try:
            rel_ok = _check_rel(rel, str(root))
        except ArtifactError:
            raise ArtifactError(root, f"lists a file outside the artifact: {rel!r}", file=MANIFEST) from None
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str) or not isinstance(
            info.get("bytes"), int
        ):
            raise ArtifactError(root, f"has a bad entry for {rel!r}: expected {{sha256, bytes}}", file=MANIFEST)
        path = root / rel_ok
        if path.is_symlink() or not path.is_file():
            raise ArtifactError(root, "is missing; the artifact is incomplete, rebuild it", file=rel_ok)
        size = path.stat().st_size
        if size != info["bytes"]:
            raise ArtifactError(
                root, f"has {size} bytes, the manifest says {info['bytes']} (truncated or modified); rebuild it",
                file=rel_ok,
            )
        if verify_hashes:
            digest = sha256_file(path)
            if digest != info["sha256"]:
                raise ArtifactError(
                    root,
                    f"sha256 {digest[:16]}... does not match the manifest's {info['sha256'][:16]}... "
                    "(modified after the build); rebuild the artifact",
                    file=rel_ok,
                )
    return manifest
