"""The artifact: a directory with manifest.json, the files it names, and report.md (DESIGN.md §3, "Artifact").

Writing: `ArtifactWriter(out_dir)` stages everything in a temp dir beside `out_dir` (same filesystem). The build adds
files (`add_file`, or writes to `writer.path(rel)` directly), fills `writer.manifest`, and `commit()` records every
file's sha256 and size, writes manifest.json and report.md, and renames the staged dir onto `out_dir`. Until then
`out_dir` is untouched; an exception inside the `with` block removes the staged dir; a failed swap restores the
previous artifact. No temp names ever appear at `out_dir` itself.

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
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from kimi_compile.cache import sha256_file

__all__ = ["SCHEMA_VERSION", "ArtifactError", "ArtifactWriter", "load_manifest", "render_report"]

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REPORT = "report.md"
_RESERVED = {MANIFEST, REPORT}


class ArtifactError(Exception):
    """An artifact cannot be written or loaded. The message names the artifact dir and, where one is at fault, the
    file."""

    def __init__(self, artifact_dir: str | os.PathLike[str], message: str, file: str | None = None):
        self.artifact_dir = str(artifact_dir)
        self.file = file
        where = f"{self.artifact_dir}/{file}" if file else self.artifact_dir
        super().__init__(f"artifact {where}: {message}")


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

    def __init__(self, out_dir: str | os.PathLike[str]):
        self.out_dir = Path(out_dir)
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
        if rel in _RESERVED:
            raise ArtifactError(self.out_dir, "is written by commit(); choose another name", file=rel)
        dest = self.root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        return dest

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
            _swap_into_place(staging, self.out_dir)
        except BaseException:
            self.abort()
            raise
        self._staging = None
        self.committed = True
        self.manifest = manifest
        return self.out_dir

    def _finish(self, staging: Path) -> dict[str, Any]:
        files = _scan(staging, self.out_dir)
        manifest = copy.deepcopy(self.manifest)
        manifest["schema_version"] = SCHEMA_VERSION
        manifest["files"] = files
        try:
            json.dumps(manifest, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ArtifactError(self.out_dir, f"the manifest is not JSON-able: {e}", file=MANIFEST) from None
        report = render_report(manifest).encode("utf-8")
        (staging / REPORT).write_bytes(report)
        manifest["files"][REPORT] = {"sha256": sha256_file(staging / REPORT), "bytes": len(report)}
        manifest["files"] = dict(sorted(manifest["files"].items()))
        text = json.dumps(manifest, indent=2, allow_nan=False)
        with open(staging / MANIFEST, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        return manifest


def _scan(root: Path, where: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel in _RESERVED:
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


# ----------------------------------------------------------------------------------------------------------------
# report.md


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
        from kimi_compile.accuracy import render_markdown

        out += [render_markdown(dict(accuracy))]

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
