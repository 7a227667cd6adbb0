"""kimi_compile/cli_cache.py: `cache stats|clear|export|import` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kimi_compile.cache import CompileCache
from kimi_compile.cli_cache import cache


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KIMI_COMPILE_CACHE_READONLY", raising=False)
    monkeypatch.delenv("KIMI_COMPILE_CACHE_MAX_BYTES", raising=False)
    cc = CompileCache()
    cc.get_or_create("trace", "t1", lambda d: (d / "g.onnx").write_bytes(b"x" * 100))
    cc.get_or_create("pass", "p1", lambda d: (d / "g.onnx").write_bytes(b"y" * 10))
    cc.get_or_create("pass", "p1", lambda d: None)  # a hit
    return tmp_path / "cache"


def _run(*args: str):
    return CliRunner().invoke(cache, list(args), catch_exceptions=False)


def test_stats_json(root):
    r = _run("stats", "--json")
    assert r.exit_code == 0, r.output
    st = json.loads(r.output)
    assert st["root"] == str(root) and st["entries"] == 2
    assert st["stages"]["pass"]["hits"] == 1 and st["stages"]["pass"]["misses"] == 1
    assert st["stages"]["trace"]["entries"] == 1


def test_stats_table(root):
    r = _run("stats")
    assert r.exit_code == 0, r.output
    assert str(root) in r.output.replace("\n", "")
    for word in ("stage", "entries", "trace", "pass", "total", "used"):
        assert word in r.output


def test_cache_dir_option(tmp_path, root):
    r = _run("--cache-dir", str(tmp_path / "other"), "stats", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["entries"] == 0


def test_clear(root):
    r = CliRunner().invoke(cache, ["clear"], input="n\n")
    assert r.exit_code != 0 and "not cleared" in r.output
    assert CompileCache().stats()["entries"] == 2
    r = _run("clear", "--stage", "pass", "--yes")
    assert r.exit_code == 0 and "removed 1 entry" in r.output
    assert list(CompileCache().stats()["stages"]) == ["trace"]
    r = CliRunner().invoke(cache, ["clear"], input="y\n")
    assert r.exit_code == 0 and "removed 1 entry" in r.output
    assert CompileCache().stats()["entries"] == 0


def test_export_import(root, tmp_path, monkeypatch):
    archive = tmp_path / "c.tar.gz"
    r = _run("export", str(archive))
    assert r.exit_code == 0 and "exported 2 entries" in r.output and archive.is_file()
    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(tmp_path / "fresh"))
    r = _run("import", str(archive))
    assert r.exit_code == 0 and "imported 2 new entries" in r.output
    assert CompileCache().get("trace", "t1") is not None


def test_errors_are_one_line_and_nonzero(root, tmp_path, monkeypatch):
    r = _run("import", str(tmp_path / "missing.tar.gz"))
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [f"Error: {tmp_path / 'missing.tar.gz'}: no such cache archive"]
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"garbage")
    r = _run("import", str(bad))
    assert r.exit_code == 1 and "not a readable cache archive" in r.output and len(r.output.strip().splitlines()) == 1
    monkeypatch.setenv("KIMI_COMPILE_CACHE_READONLY", "1")
    r = _run("clear", "--yes")
    assert r.exit_code == 1 and "read-only" in r.output
    monkeypatch.setenv("KIMI_COMPILE_CACHE_MAX_BYTES", "-5")
    r = _run("stats")
    assert r.exit_code == 1 and "KIMI_COMPILE_CACHE_MAX_BYTES" in r.output
    blocker = tmp_path / "blocker"
    blocker.write_text("file")
    monkeypatch.delenv("KIMI_COMPILE_CACHE_READONLY")
    monkeypatch.delenv("KIMI_COMPILE_CACHE_MAX_BYTES")
    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(blocker / "c"))
    r = _run("import", str(tmp_path / "x.tar.gz"))
    assert r.exit_code == 1 and "is not writable" in r.output and len(r.output.strip().splitlines()) == 1
    # none of the failed commands touched the real cache: its two entries are intact and readable
    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(root))
    kept = CompileCache()
    assert kept.stats()["entries"] == 2 and kept.get("trace", "t1") is not None
