"""kimi_compile/cache.py: keys, hits and misses, concurrency, eviction, read-only mode, corruption, export/import."""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import stat
import tarfile
import time
from pathlib import Path

import pytest

from kimi_compile.cache import CacheError, CompileCache, cache_key, default_cache_root, sha256_file


@pytest.fixture
def cc(tmp_path, monkeypatch):
    for var in ("KIMI_COMPILE_CACHE", "KIMI_COMPILE_CACHE_READONLY", "KIMI_COMPILE_CACHE_MAX_BYTES"):
        monkeypatch.delenv(var, raising=False)
    return CompileCache(root=tmp_path / "cache")


def _writer(payload: bytes, calls: list | None = None):
    def produce(d: Path) -> None:
        if calls is not None:
            calls.append(d)
        (d / "graph.onnx").write_bytes(payload)
        (d / "sub").mkdir()
        (d / "sub" / "weights.bin").write_bytes(payload * 2)

    return produce


# -- keys --------------------------------------------------------------------------------------------------------


def test_cache_key_is_canonical():
    a = cache_key(graph="abc", options={"x": 1, "y": [1, 2.5, None, True]}, version=2)
    b = cache_key(version=2, options={"y": [1, 2.5, None, True], "x": 1}, graph="abc")
    assert a == b and len(a) == 64 and int(a, 16) >= 0
    assert cache_key(graph="abc", options={"x": 2}, version=2) != cache_key(graph="abc", options={"x": 1}, version=2)
    assert cache_key(v=(1, 2)) == cache_key(v=[1, 2])
    assert CompileCache.cache_key(a=1) == cache_key(a=1)


@pytest.mark.parametrize(
    "parts, where",
    [
        ({"path": Path("/x")}, "'path' is a PosixPath"),
        ({"opts": {"s": {1, 2}}}, "'opts.s' is a set"),
        ({"opts": {"l": [1, b"x"]}}, "'opts.l[1]' is a bytes"),
        ({"f": float("nan")}, "'f' is nan"),
        ({"d": {1: 2}}, "'d' has a non-string key 1"),
    ],
)
def test_cache_key_rejects_non_json(parts, where):
    with pytest.raises(CacheError, match="cache_key: part " + where.replace("(", r"\(").replace("[", r"\[")):
        cache_key(**parts)


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(tmp_path / "env"))
    assert default_cache_root() == tmp_path / "env"
    monkeypatch.delenv("KIMI_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "kimi-compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_root() == tmp_path / "home" / ".cache" / "kimi-compile"
    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(tmp_path / "env"))
    monkeypatch.setenv("KIMI_COMPILE_CACHE_MAX_BYTES", "3M")
    monkeypatch.setenv("KIMI_COMPILE_CACHE_READONLY", "1")
    c = CompileCache()
    assert (c.root, c.max_bytes, c.read_only) == (tmp_path / "env", 3 * 1024**2, True)
    monkeypatch.setenv("KIMI_COMPILE_CACHE_MAX_BYTES", "lots")
    with pytest.raises(CacheError, match="KIMI_COMPILE_CACHE_MAX_BYTES: expected a byte count"):
        CompileCache()


# -- get / get_or_create -----------------------------------------------------------------------------------------


def test_miss_then_hit(cc):
    key = cache_key(x=1)
    assert cc.get("trace", key) is None
    calls: list = []
    entry, hit = cc.get_or_create("trace", key, _writer(b"abc", calls))
    assert not hit and len(calls) == 1
    assert entry == cc.root / "entries" / "trace" / key
    assert (entry / "graph.onnx").read_bytes() == b"abc" and (entry / "sub" / "weights.bin").read_bytes() == b"abcabc"
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["stage"] == "trace" and meta["key"] == key and meta["bytes"] == 9
    assert meta["files"]["sub/weights.bin"] == {"bytes": 6, "sha256": sha256_file(entry / "sub" / "weights.bin")}
    entry2, hit2 = cc.get_or_create("trace", key, _writer(b"zzz", calls))
    assert hit2 and entry2 == entry and len(calls) == 1
    assert cc.get("trace", key) == entry
    assert not list((cc.root / "tmp").iterdir())
    st = cc.stats()
    assert st["stages"]["trace"] == {"entries": 1, "bytes": st["bytes"], "hits": 2, "misses": 2}
    assert st["session"] == {"trace": {"hits": 2, "misses": 2}}
    assert st["bytes"] > 9  # files + meta.json


def test_producer_failure_leaves_nothing(cc):
    def boom(d: Path) -> None:
        (d / "half.onnx").write_bytes(b"x")
        raise RuntimeError("exporter failed")

    with pytest.raises(RuntimeError, match="exporter failed"):
        cc.get_or_create("trace", "k1", boom)
    assert cc.get("trace", "k1") is None
    assert not (cc.root / "entries" / "trace" / "k1").exists()
    assert not list((cc.root / "tmp").iterdir())
    entry, hit = cc.get_or_create("trace", "k1", _writer(b"ok"))
    assert not hit and (entry / "graph.onnx").read_bytes() == b"ok"


def test_bad_names_and_reserved_meta(cc):
    with pytest.raises(CacheError, match="invalid cache stage '../x'"):
        cc.get("../x", "k")
    with pytest.raises(CacheError, match="invalid cache key 'a/b'"):
        cc.get_or_create("trace", "a/b", _writer(b""))
    with pytest.raises(CacheError, match="wrote meta.json"):
        cc.get_or_create("trace", "k", lambda d: (d / "meta.json").write_text("{}"))
    with pytest.raises(CacheError, match="is a link or special file"):
        cc.get_or_create("trace", "k", lambda d: (d / "l").symlink_to("/etc/hostname"))
    assert cc.get("trace", "k") is None


def _build_in_process(root: str, key: str, marker: str, barrier, queue) -> None:
    def produce(d: Path) -> None:
        with open(marker, "a") as f:  # counts producer runs across processes
            f.write(f"{os.getpid()}\n")
        time.sleep(0.4)
        (d / "graph.onnx").write_bytes(b"G" * 1000)
        (d / "pid").write_text("built")

    try:
        barrier.wait(timeout=10)
        entry, hit = CompileCache(root=root).get_or_create("backend", key, produce)
        queue.put(("ok", str(entry), hit, (entry / "graph.onnx").read_bytes() == b"G" * 1000))
    except BaseException as e:  # report, never hang the parent
        queue.put(("error", repr(e), None, None))


def test_two_processes_build_one_key(cc, tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    marker = tmp_path / "runs.txt"
    key = cache_key(graph="g")
    procs = [ctx.Process(target=_build_in_process, args=(str(cc.root), key, str(marker), barrier, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert all(r[0] == "ok" for r in results), results
    assert {r[1] for r in results} == {str(cc.root / "entries" / "backend" / key)}
    assert sorted(r[2] for r in results) == [False, True]  # one built it, the other waited and hit
    assert all(r[3] for r in results)
    assert len(marker.read_text().splitlines()) == 1
    st = cc.stats()["stages"]["backend"]
    assert (st["entries"], st["hits"], st["misses"]) == (1, 1, 1)


# -- eviction ----------------------------------------------------------------------------------------------------


def test_lru_eviction_keeps_the_new_entry(tmp_path):
    cc = CompileCache(root=tmp_path / "c", max_bytes=2000)
    blob = lambda d: (d / "w.bin").write_bytes(os.urandom(600))  # noqa: E731 (entry ~= 600 B + meta)
    a, _ = cc.get_or_create("pass", "a", blob)
    b, _ = cc.get_or_create("pass", "b", blob)
    past = time.time() - 100
    os.utime(a, (past, past))
    os.utime(b, (past + 10, past + 10))
    assert cc.get("pass", "a") == a  # a is now the most recently used
    c, _ = cc.get_or_create("pass", "c", blob)  # 3 entries > 2000 B: evict the least recently used, b
    assert a.exists() and c.exists() and not b.exists()
    assert cc.stats()["stages"]["pass"]["entries"] == 2
    # an entry bigger than the whole cache still survives its own put
    big, hit = cc.get_or_create("pass", "big", lambda d: (d / "w.bin").write_bytes(b"x" * 5000))
    assert not hit and big.exists() and not a.exists() and not c.exists()


def test_max_bytes_argument_validated(tmp_path):
    with pytest.raises(CacheError, match="max_bytes: expected a positive byte count"):
        CompileCache(root=tmp_path, max_bytes=0)
    assert CompileCache(root=tmp_path, max_bytes="1G").max_bytes == 1024**3


# -- read-only ---------------------------------------------------------------------------------------------------


def test_read_only_serves_hits_and_writes_nothing(tmp_path, monkeypatch):
    root = tmp_path / "c"
    writable = CompileCache(root=root)
    entry, _ = writable.get_or_create("trace", "k", _writer(b"abc"))
    before = sorted(str(p) for p in root.rglob("*"))
    stats_before = (root / "stats.json").read_bytes()
    monkeypatch.setenv("KIMI_COMPILE_CACHE_READONLY", "1")
    ro = CompileCache(root=root)
    assert ro.read_only
    got, hit = ro.get_or_create("trace", "k", _writer(b"zzz"))
    assert hit and got == entry
    calls: list = []
    scratch, hit = ro.get_or_create("trace", "other", _writer(b"new", calls))
    assert not hit and len(calls) == 1 and (scratch / "graph.onnx").read_bytes() == b"new"
    assert root not in scratch.parents
    assert sorted(str(p) for p in root.rglob("*")) == before
    assert (root / "stats.json").read_bytes() == stats_before
    assert ro.stats()["session"] == {"trace": {"hits": 1, "misses": 1}}
    with pytest.raises(CacheError, match="read-only"):
        ro.clear()
    with pytest.raises(CacheError, match="read-only"):
        ro.import_(tmp_path / "x.tar.gz")
    ro._drop_scratch()  # what atexit does
    assert not scratch.exists()


def test_read_only_on_an_unwritable_dir(tmp_path):
    root = tmp_path / "c"
    CompileCache(root=root).get_or_create("trace", "k", _writer(b"abc"))
    os.chmod(root, stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        _, hit = CompileCache(root=root, read_only=True).get_or_create("trace", "k", _writer(b"zzz"))
        assert hit
        with pytest.raises(CacheError, match=r"compile cache dir .* is not writable .*KIMI_COMPILE_CACHE"):
            CompileCache(root=root / "sub").get_or_create("trace", "k2", _writer(b"abc"))
    finally:
        os.chmod(root, stat.S_IRWXU)


def test_unwritable_cache_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(CacheError, match=r"compile cache dir .*file/c is not writable"):
        CompileCache(root=blocker / "c").get_or_create("trace", "k", _writer(b"abc"))


# -- corruption --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda e: (e / "graph.onnx").write_bytes(b"abX"), "does not match its sha256"),
        (lambda e: (e / "graph.onnx").write_bytes(b"ab"), "has 2 bytes"),
        (lambda e: (e / "sub" / "weights.bin").unlink(), "sub/weights.bin is missing"),
        (lambda e: (e / "meta.json").unlink(), "meta.json is missing"),
        (lambda e: (e / "meta.json").write_text("{not json"), "meta.json is unreadable"),
    ],
)
def test_corrupt_entry_is_a_miss_and_rebuilt(cc, caplog, damage, reason):
    entry, _ = cc.get_or_create("trace", "k", _writer(b"abc"))
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="kimi_compile.cache"):
        assert cc.get("trace", "k") is None
    assert reason in caplog.text and "treating it as a miss" in caplog.text
    calls: list = []
    entry2, hit = cc.get_or_create("trace", "k", _writer(b"abc", calls))
    assert not hit and len(calls) == 1 and entry2 == entry
    assert (entry / "graph.onnx").read_bytes() == b"abc" and cc.get("trace", "k") == entry
    assert "rebuilding it" in caplog.text


# -- clear, export, import ---------------------------------------------------------------------------------------


def test_clear(cc):
    cc.get_or_create("trace", "a", _writer(b"1"))
    cc.get_or_create("pass", "b", _writer(b"2"))
    cc.get_or_create("pass", "c", _writer(b"3"))
    assert cc.clear(stage="pass") == 2
    st = cc.stats()
    assert list(st["stages"]) == ["trace"] and st["entries"] == 1
    assert cc.clear() == 1
    assert cc.stats()["entries"] == 0 and cc.stats()["stages"] == {}


def test_export_import_round_trip(cc, tmp_path):
    e1, _ = cc.get_or_create("trace", "a", _writer(b"1"))
    e2, _ = cc.get_or_create("pass", "b", _writer(b"22"))
    archive = tmp_path / "out" / "cache.tar.gz"
    assert cc.export(archive) == 2
    other = CompileCache(root=tmp_path / "other")
    assert other.import_(archive) == 2
    for stage, key, src in (("trace", "a", e1), ("pass", "b", e2)):
        got, hit = other.get_or_create(stage, key, _writer(b"never"))
        assert hit
        assert (got / "graph.onnx").read_bytes() == (src / "graph.onnx").read_bytes()
        assert (got / "meta.json").read_bytes() == (src / "meta.json").read_bytes()
    assert other.import_(archive) == 0  # already present
    assert not list((other.root / "tmp").iterdir())


def _tar_with(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _good_members(key: str = "k") -> list:
    data = b"payload"
    meta = {"stage": "trace", "key": key, "created": 0, "bytes": len(data),
            "files": {"graph.onnx": {"bytes": len(data), "sha256": __import__("hashlib").sha256(data).hexdigest()}}}
    return [_file(f"kimi-compile-cache/trace/{key}/graph.onnx", data),
            _file(f"kimi-compile-cache/trace/{key}/meta.json", json.dumps(meta).encode())]


def _symlink(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info, None


@pytest.mark.parametrize(
    "extra, message",
    [
        ([_file("/etc/evil", b"x")], "member '/etc/evil' is an absolute path"),
        ([_file("kimi-compile-cache/trace/../../../evil", b"x")], "is a '..' or backslash component"),
        ([_file("kimi-compile-cache/../evil", b"x")], "is a '..' or backslash component"),
        ([_symlink("kimi-compile-cache/trace/k/link", "/etc/passwd")], "is a link or special file"),
        ([_file("elsewhere/x", b"x")], "is outside kimi-compile-cache/"),
        ([_file("kimi-compile-cache/trace/k2/graph2.onnx", b"unlisted")], "graph2.onnx is not listed in meta.json"),
        ([_file("kimi-compile-cache/pass/j/graph.onnx", b"no meta")], "entry pass/j is corrupt (meta.json is missing)"),
    ],
)
def test_malicious_or_bad_archive_is_refused(cc, tmp_path, extra, message):
    cc.get_or_create("trace", "existing", _writer(b"1"))
    before = sorted(str(p) for p in (cc.root / "entries").rglob("*"))
    archive = _tar_with(tmp_path / "bad.tar.gz", _good_members("k2") + extra)
    with pytest.raises(CacheError) as info:
        cc.import_(archive)
    assert message in str(info.value) and str(archive) in str(info.value)
    assert sorted(str(p) for p in (cc.root / "entries").rglob("*")) == before
    assert not (tmp_path / "evil").exists() and not Path("/etc/evil").exists()
    assert not list((cc.root / "tmp").iterdir())


def test_archive_with_tampered_hash_is_refused(cc, tmp_path):
    members = _good_members()
    info, _ = members[0]
    members[0] = (info, b"PAYLOAD")  # same size, different bytes
    with pytest.raises(CacheError, match=r"graph.onnx does not match its sha256 in meta.json\); nothing was imported"):
        cc.import_(_tar_with(tmp_path / "t.tar.gz", members))
    assert cc.stats()["entries"] == 0


def test_import_of_a_good_handmade_archive_and_not_an_archive(cc, tmp_path):
    assert cc.import_(_tar_with(tmp_path / "g.tar.gz", _good_members())) == 1
    assert (cc.get("trace", "k") / "graph.onnx").read_bytes() == b"payload"
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar")
    with pytest.raises(CacheError, match="not a readable cache archive"):
        cc.import_(junk)
    with pytest.raises(CacheError, match="no such cache archive"):
        cc.import_(tmp_path / "missing.tar.gz")


def test_truncated_archive_is_refused(cc, tmp_path):
    cc.get_or_create("trace", "k", lambda d: (d / "w.bin").write_bytes(os.urandom(200_000)))
    archive = tmp_path / "c.tar.gz"
    cc.export(archive)
    data = archive.read_bytes()
    (tmp_path / "cut.tar.gz").write_bytes(data[: len(data) // 2])
    other = CompileCache(root=tmp_path / "other")
    with pytest.raises(CacheError, match="cut.tar.gz: not a readable cache archive"):
        other.import_(tmp_path / "cut.tar.gz")
    assert other.stats()["entries"] == 0


def _slow_build(root: str, marker: str) -> None:
    def produce(d: Path) -> None:
        (d / "half.bin").write_bytes(b"x" * 100)
        Path(marker).write_text("started")
        time.sleep(60)

    CompileCache(root=root).get_or_create("trace", "k", produce)


def test_killed_build_leaves_no_entry_and_no_lock(cc, tmp_path):
    ctx = multiprocessing.get_context("fork")
    marker = tmp_path / "started"
    p = ctx.Process(target=_slow_build, args=(str(cc.root), str(marker)))
    p.start()
    deadline = time.time() + 20
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    assert marker.exists()
    p.kill()
    p.join(timeout=10)
    assert cc.get("trace", "k") is None
    assert len(list((cc.root / "tmp").iterdir())) == 1  # the dead build's dir, never visible as an entry
    entry, hit = cc.get_or_create("trace", "k", _writer(b"abc"))  # the lock died with the process
    assert not hit and sorted(p.name for p in entry.iterdir()) == ["graph.onnx", "meta.json", "sub"]
    assert not list((cc.root / "tmp").iterdir())  # swept after the put


def test_an_entry_pinned_by_another_process_is_not_evicted(tmp_path):
    """A build pins the entries it reads (their weights are read lazily until its artifact is written); a second
    build sharing the cache must not evict them meanwhile (seen on a GPU machine: two concurrent builds, the second's
    eviction removed the first's pass entry mid-build). Two cache objects on one root stand for two processes: the
    pin is an fcntl lock on its own open file, which another descriptor cannot take, as another process cannot."""
    root = tmp_path / "c"
    blob = lambda d: (d / "w.bin").write_bytes(os.urandom(600))  # noqa: E731
    first, second = CompileCache(root=root, max_bytes=1500), CompileCache(root=root, max_bytes=1500)
    with first.pinned():
        a, _ = first.get_or_create("pass", "a", blob)
        past = time.time() - 100
        os.utime(a, (past, past))  # the least recently used entry
        b, _ = second.get_or_create("pass", "b", blob)
        c, _ = second.get_or_create("pass", "c", blob)  # over max_bytes: LRU would take a, which is pinned
        assert a.exists() and (a / "w.bin").exists()
        assert not b.exists() and c.exists()  # the eviction took the next one instead
        assert first.get("pass", "a") == a  # still a whole entry
    os.utime(a, (past, past))
    assert second.evict() == [("pass", "a")]  # unpinned: LRU applies again
    assert not a.exists() and c.exists()
