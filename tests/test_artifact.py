"""kimi_compile/artifact.py: atomic writes, manifest checks on load, report rendering."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from kimi_compile import artifact as artifact_mod
from kimi_compile.artifact import SCHEMA_VERSION, ArtifactError, ArtifactWriter, load_manifest
from kimi_compile.report import REPORTS, render_report

MANIFEST_EXTRA = {
    "tool": {"name": "kimi-compile", "version": "0.1.0"},
    "versions": {"python": "3.11.7", "onnx": "1.23.2", "onnxruntime": "1.32.0"},
    "recipe": {"name": "kimi-k3-tiny", "model": {"preset": "kimi-k3-tiny", "dtype": "float32"},
               "backend": {"name": "onnxruntime", "options": {}}, "target": "cpu"},
    "graphs": {
        "prefill": {"file": "graphs/prefill.onnx",
                    "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["B", "T"]}],
                    "outputs": [{"name": "logits", "dtype": "float32", "shape": ["B", "T", 128]}],
                    "node_count": 42, "op_histogram": {"MatMul": 12, "kimi.KDA": 3, "Add": 27}},
    },
    "cache_layouts": [{"name": "latent_kv", "kind": "mla", "dtype": "float8e4m3fn",
                       "shape": ["num_blocks", 16, 1, 576], "bytes_per_token": 576, "bytes_per_sequence": 0},
                      {"name": "index_k", "kind": "index", "dtype": "float8e4m3fn", "shape": ["num_blocks", 16, 128],
                       "bytes_per_token": 132, "bytes_per_sequence": 0},
                      {"name": "kda_state", "kind": "kda", "dtype": "float32", "shape": ["B", 2, 16, 16],
                       "bytes_per_token": 0, "bytes_per_sequence": 2048}],
    "pass_log": [{"name": "cleanup", "version": 1, "phase": "prefill", "counts": {"nodes_removed": 5}, "ms": 1.25,
                  "cached": False, "nodes_before": 47, "nodes_after": 42},
                 {"name": "infer_shapes", "version": 1, "phase": "prefill", "counts": {}, "ms": 0.5, "cached": True}],
    "precision_plan": [{"role": "indexer_qk", "format": "mxfp8", "options": {"rounding": "floor"},
                        "tensors": ["a", "b"]}],
}


def _build(out: Path, payload: bytes = b"weights-v1", extra: dict | None = None) -> Path:
    with ArtifactWriter(out, reports=REPORTS) as w:
        w.add_file("graphs/prefill.onnx", data=b"onnx-bytes")
        w.add_file("weights/model.bin", data=payload)
        w.manifest.update(MANIFEST_EXTRA if extra is None else extra)
        w.commit()
    return out


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_write_and_load(tmp_path):
    out = _build(tmp_path / "art")
    m = load_manifest(out)
    assert m["schema_version"] == SCHEMA_VERSION == 1
    assert set(m["files"]) == {"graphs/prefill.onnx", "weights/model.bin", "report.md", "report.html"}
    assert m["files"]["weights/model.bin"] == {"sha256": hashlib.sha256(b"weights-v1").hexdigest(), "bytes": 10}
    assert m["graphs"]["prefill"]["node_count"] == 42
    assert (out / "report.md").read_text().startswith("# kimi-compile artifact: kimi-k3-tiny")
    assert _siblings(out) == ["art"]  # no staging or aside dirs left


def test_add_file_links_copies_and_direct_writes(tmp_path):
    src = tmp_path / "cache_entry.bin"
    src.write_bytes(b"from-cache")
    out = tmp_path / "art"
    with ArtifactWriter(out, reports=REPORTS) as w:
        linked = w.add_file("weights/a.bin", src_path=src)
        copied = w.add_file("weights/b.bin", src_path=src, link_ok=False)
        assert linked.stat().st_ino == src.stat().st_ino
        assert copied.stat().st_ino != src.stat().st_ino
        w.path("graphs/decode.onnx").write_bytes(b"direct")  # e.g. onnx.save with external data
        with pytest.raises(TypeError):
            w.add_file("x", src_path=src, data=b"y")
        with pytest.raises(ArtifactError, match="must be relative, without '..'"):
            w.add_file("../escape", data=b"x")
        with pytest.raises(ArtifactError, match="must be relative"):
            w.add_file("/abs", data=b"x")
        with pytest.raises(ArtifactError, match="manifest.json: is written by commit"):
            w.add_file("manifest.json", data=b"{}")
        with pytest.raises(ArtifactError, match="added twice"):
            w.add_file("weights/a.bin", data=b"x")
        with pytest.raises(ArtifactError, match="is not a file"):
            w.add_file("c", src_path=tmp_path / "nope")
    m = load_manifest(out)
    assert set(m["files"]) == {"weights/a.bin", "weights/b.bin", "graphs/decode.onnx", "report.md", "report.html"}


def test_replaces_a_previous_artifact(tmp_path):
    out = _build(tmp_path / "art", b"v1")
    (out / "stale.txt").write_text("from an old build")
    _build(out, b"version-2")
    assert (out / "weights" / "model.bin").read_bytes() == b"version-2"
    assert not (out / "stale.txt").exists()
    assert load_manifest(out)["files"]["weights/model.bin"]["bytes"] == 9
    assert _siblings(out) == ["art"]


def test_exception_in_context_leaves_previous_artifact(tmp_path):
    out = _build(tmp_path / "art", b"v1")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(RuntimeError, match="trace failed"):
        with ArtifactWriter(out, reports=REPORTS) as w:
            w.add_file("weights/model.bin", data=b"half-written")
            raise RuntimeError("trace failed")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert _siblings(out) == ["art"]
    load_manifest(out)


def test_interrupted_first_build_leaves_nothing(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        with ArtifactWriter(out, reports=REPORTS) as w:
            w.add_file("a", data=b"x")
            raise KeyboardInterrupt
    assert not out.exists() and _siblings(out) == []


def test_failed_swap_restores_previous_artifact(tmp_path, monkeypatch):
    out = _build(tmp_path / "art", b"v1")
    real_rename = os.rename

    def rename(src, dst):
        if Path(dst) == out and ".staging-" in Path(src).name:
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(artifact_mod.os, "rename", rename)
    with pytest.raises(ArtifactError, match="cannot move the new artifact into place"):
        _build(out, b"v2")
    monkeypatch.undo()
    assert (out / "weights" / "model.bin").read_bytes() == b"v1"
    load_manifest(out)
    assert _siblings(out) == ["art"]


def test_manifest_must_be_json(tmp_path):
    class NotJson:
        pass

    out = tmp_path / "art"
    with pytest.raises(ArtifactError, match="manifest.json: the manifest is not JSON-able"):
        with ArtifactWriter(out, reports=REPORTS) as w:
            w.manifest["x"] = NotJson()
    assert not out.exists() and _siblings(out) == []


# -- load_manifest refusals ---------------------------------------------------------------------------------------


def _rewrite_manifest(out: Path, change) -> None:
    m = json.loads((out / "manifest.json").read_text())
    change(m)
    (out / "manifest.json").write_text(json.dumps(m))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, file, message",
    [
        (lambda o: _flip_byte(o / "weights" / "model.bin"), "weights/model.bin", "does not match the manifest's"),
        (lambda o: (o / "weights" / "model.bin").write_bytes(b"weig"), "weights/model.bin",
         "has 4 bytes, the manifest says 10 (truncated or modified)"),
        (lambda o: (o / "graphs" / "prefill.onnx").unlink(), "graphs/prefill.onnx", "is missing"),
        (lambda o: (o / "manifest.json").unlink(), "manifest.json", "is missing"),
        (lambda o: (o / "manifest.json").write_text("{\"schema_version\": 1,"), "manifest.json",
         "is not valid JSON"),
        (lambda o: (o / "manifest.json").write_text("[1]"), "manifest.json", "is not a JSON object"),
        (lambda o: _rewrite_manifest(o, lambda m: m.update(schema_version=2)), "manifest.json",
         "artifact schema 2 is newer than this kimi-compile (supports 1): upgrade kimi-compile"),
        (lambda o: _rewrite_manifest(o, lambda m: m.update(schema_version="1")), "manifest.json",
         "schema_version must be an int, got '1'"),
        (lambda o: _rewrite_manifest(o, lambda m: m.pop("schema_version")), "manifest.json",
         "schema_version must be an int, got None"),
        (lambda o: _rewrite_manifest(o, lambda m: m.update(schema_version=0)), "manifest.json",
         "artifact schema 0 is not supported"),
        (lambda o: _rewrite_manifest(o, lambda m: m.pop("files")), "manifest.json", "has no files table"),
        (lambda o: _rewrite_manifest(o, lambda m: m["files"].update({"../x": {"sha256": "0", "bytes": 1}})),
         "manifest.json", "lists a file outside the artifact: '../x'"),
        (lambda o: _rewrite_manifest(o, lambda m: m["files"].update({"x": {"bytes": 1}})), "manifest.json",
         "has a bad entry for 'x'"),
        (lambda o: _flip_byte(o / "report.md"), "report.md", "does not match the manifest's"),
    ],
)
def test_load_refuses_damaged_artifacts(tmp_path, damage, file, message):
    out = _build(tmp_path / "art")
    damage(out)
    with pytest.raises(ArtifactError) as info:
        load_manifest(out)
    assert str(info.value).startswith(f"artifact {out}/{file}: ")
    assert message in str(info.value)
    assert info.value.file == file and info.value.artifact_dir == str(out)


def test_load_missing_dir_and_unlisted_files(tmp_path):
    with pytest.raises(ArtifactError, match=r"artifact .*/nope: does not exist; build it with"):
        load_manifest(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="is not a directory"):
        load_manifest(tmp_path / "file")
    out = _build(tmp_path / "art")
    (out / "weights" / "notes.txt").write_text("unlisted files are not checked")
    load_manifest(out)
    _flip_byte(out / "weights" / "model.bin")
    load_manifest(out, verify_hashes=False)  # size-only check


# -- report ------------------------------------------------------------------------------------------------------


def test_report_sections(tmp_path):
    out = _build(tmp_path / "art")
    report = (out / "report.md").read_text()
    for needle in [
        "## Summary", "| model | kimi-k3-tiny |", "| built by | kimi-compile 0.1.0 |",
        "## Versions", "| onnxruntime | 1.32.0 |",
        "## Passes (2, 1.8 ms)", "| 0 | cleanup | 1 | prefill | nodes_removed=5 | 47 -> 42 | 1.2 | miss |",
        "| 1 | infer_shapes | 1 | prefill |  |  | 0.5 | hit |",
        "### prefill (`graphs/prefill.onnx`)", "42 nodes", "| input_ids | int64 | [B, T] |",
        "| Add | 27 |", "| kimi.KDA | 3 |",
        "## Cache layouts", "| latent_kv | mla | float8e4m3fn | [num_blocks, 16, 1, 576] | 576 | 0 |",
        "| kda_state | kda | float32 | [B, 2, 16, 16] | 0 | 2048 |",
        "Total: 708 bytes per token, 2048 bytes per sequence.",
        "## Precision plan", "| indexer_qk | mxfp8 | rounding=floor | 2 |",
        "## Files", "`weights/model.bin`",
    ]:
        assert needle in report, needle
    hist = report.index("| Add | 27 |"), report.index("| MatMul | 12 |"), report.index("| kimi.KDA | 3 |")
    assert list(hist) == sorted(hist)  # most frequent first


def test_report_tolerates_sparse_or_odd_manifests():
    text = render_report({})
    assert text.startswith("# kimi-compile artifact: artifact\n")
    text = render_report({"precision_plan": [], "graphs": {"decode": "odd"}, "pass_log": ["weird"],
                          "cache_layouts": [{"name": "kda_state", "dtype": "float32", "bytes_per_token": 0}],
                          "op_coverage": {"kimi.KDA": {"onnxruntime": "function", "cuda": "triton"}},
                          "compile_cache": {"trace": {"hits": 1, "misses": 0}},
                          "recipe": {"name": "a|b"}})
    assert "All tensors in the model dtype" in text
    assert "| kda_state |  | float32 |  | 0 |" in text and "Total: 0 bytes per token." in text
    assert "| kimi.KDA | onnxruntime=function, cuda=triton |" in text
    assert "| trace | 1 | 0 |" in text
    assert "# kimi-compile artifact: a|b" in text


def _commit_in_process(out: str, payload: bytes, barrier, queue) -> None:
    try:
        with ArtifactWriter(out, reports=REPORTS) as w:
            w.add_file("weights/model.bin", data=payload)
            w.manifest.update(MANIFEST_EXTRA)
            barrier.wait(timeout=10)
        queue.put("ok")
    except ArtifactError as e:
        queue.put(str(e))
    except BaseException as e:  # report, never hang the parent
        queue.put(repr(e))


def test_two_processes_commit_one_out_dir(tmp_path):
    """Two builds into one out_dir at once: the first to commit wins whole, the other says so and leaves nothing."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    out = _build(tmp_path / "art", b"old")
    for _round in range(3):
        barrier, queue = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_commit_in_process, args=(str(out), payload + bytes([_round]), barrier, queue))
                 for payload in (b"first", b"second")]  # per round new content: an identical artifact is no change
        for p in procs:
            p.start()
        answers = sorted(queue.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        assert answers[1] == "ok" and "another build replaced it while this one ran" in answers[0], answers
        assert (out / "weights" / "model.bin").read_bytes() in (b"first" + bytes([_round]), b"second" + bytes([_round]))
        load_manifest(out)
        assert _siblings(out) == ["art"]


def test_out_dir_that_is_not_an_artifact_is_refused(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(ArtifactError, match=r"is not a kimi-compile artifact \(it holds notes.txt"):
        _build(other)
    assert (other / "notes.txt").read_text() == "keep" and _siblings(other) == ["mine"]
    (tmp_path / "empty").mkdir()
    _build(tmp_path / "empty")  # an empty folder is fine
    assert artifact_mod.check_out_dir(tmp_path / "empty").startswith("artifact:")
    assert artifact_mod.check_out_dir(tmp_path / "none") is None


def test_folders_get_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        out = _build(tmp_path / "art")
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    assert oct((out / "weights").stat().st_mode & 0o777) == oct(0o750)


def test_symlinks_are_refused(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(ArtifactError, match="weights/link: is a link or special file"):
        with ArtifactWriter(out, reports=REPORTS) as w:
            w.path("weights/link").symlink_to("/etc/hostname")
    assert _siblings(out) == []
