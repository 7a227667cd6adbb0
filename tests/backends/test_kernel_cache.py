"""The artifact's kernel cache (backends/cuda/kernel_cache.py) on files: pack merges warms into ARTIFACT/kernels with
an index of hashes, install copies what Triton's cache lacks and skips what does not match. The GPU round trip (warm,
then a fresh process that compiles nothing) is tests/backends/test_cuda_gpu.py."""

from __future__ import annotations

import json
import os

import pytest

from kimi_compile import warm
from kimi_compile.artifact import current_umask
from kimi_compile.backends.cuda import kernel_cache as kc
from kimi_compile.build import build
from kimi_compile.recipe import with_overrides


@pytest.fixture(scope="module")
def k31_cuda(tiny_build, tmp_path_factory):
    """kimi-k3.1-tiny on the cuda backend (the session's tiny build, its cache warm)."""
    from tests.backends.test_cuda import _cache_copy

    recipe = tiny_build[0]
    tmp = tmp_path_factory.mktemp("kc_k31")
    return build(with_overrides(recipe, backend="cuda", target="cuda"), tmp / "cuda",
                 cache=_cache_copy(tiny_build, tmp / "cache")).artifact


def _triton_cache(root, entries: dict[str, dict[str, bytes]]):
    """A Triton cache folder as Triton's compiler writes it: each entry's files, then (for entries with a `k.json`)
    its group file `__grp__k.json` with absolute child paths into `root`. Written by Triton's own FileCacheManager
    where triton is installed; without it (CI's CPU machine), in that manager's format (triton 3.6
    runtime/cache.py: put, put_group)."""
    try:
        from triton import knobs
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        for entry, files in entries.items():
            (root / entry).mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                (root / entry / name).write_bytes(data)
            if "k.json" in files:
                children = {n: str(root / entry / n) for n in files}
                (root / entry / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
        return root
    old = knobs.cache.dir
    knobs.cache.dir = str(root)
    try:
        for entry, files in entries.items():
            m = FileCacheManager(entry)
            paths = {name: m.put(data, name) for name, data in files.items()}
            if "k.json" in files:
                m.put_group("k.json", paths)
    finally:
        knobs.cache.dir = old
    return root


def _triton_group(root, entry: str):
    """What Triton's compiler finds for the kernel `entry` in the cache folder `root`: FileCacheManager.get_group
    (None, or the listed files that exist), or its logic where triton is not installed."""
    try:
        from triton import knobs
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        grp = root / entry / "__grp__k.json"
        if not grp.exists():
            return None
        children = json.loads(grp.read_text())["child_paths"]
        return {c: p for c, p in children.items() if os.path.exists(p)}
    old = knobs.cache.dir
    knobs.cache.dir = str(root)
    try:
        return FileCacheManager(entry).get_group("k.json")
    finally:
        knobs.cache.dir = old


def _record(device="NVIDIA H200", triton="3.6.0"):
    return {"device": {"name": device, "capability": "sm90"}, "versions": {"triton": triton}}


KERNEL = {"k.cubin": b"\x01" * 100, "k.json": b"{}", "k.ptx": b"ptx"}


def test_pack_then_install_gives_triton_every_kernel_where_it_looks(tmp_path):
    """Round trip through Triton's own cache manager: the warm folder is deleted after packing (as warm does), and in
    the serving process's cache folder Triton's compiler finds each kernel's whole group there (its metadata path
    is what makes a cache hit) -- the group file's absolute paths are rewritten on install."""
    import shutil

    src = _triton_cache(tmp_path / "warm", {"AAA": KERNEL, "BBB": {"cuda_utils.so": b"\x7fELF"}})
    (src / "BBB" / "tmp.pid_1_2").mkdir()  # a temp folder Triton left behind
    art = tmp_path / "art"
    art.mkdir()
    index = kc.pack(src, art, _record())
    shutil.rmtree(src)
    assert sorted(index["files"]) == ["AAA/__grp__k.json", "AAA/k.cubin", "AAA/k.json", "AAA/k.ptx",
                                      "BBB/cuda_utils.so"]
    assert index["entries"] == 2 and index["triton"] == "3.6.0"
    assert [p.name for p in art.iterdir()] == ["kernels"]  # no staging folder left
    stored = json.loads((art / "kernels" / "triton" / "AAA" / "__grp__k.json").read_text())
    assert stored == {"child_paths": {"k.cubin": "k.cubin", "k.json": "k.json", "k.ptx": "k.ptx"}}
    dst = tmp_path / "user"
    rep = kc.install(art, dst, "3.6.0")
    assert rep == {"status": "installed", "files": 5, "copied": 5, "present": 0, "skipped": [], "triton": "3.6.0"}
    assert _triton_group(dst, "AAA") == {n: str(dst / "AAA" / n) for n in KERNEL}
    assert (dst / "AAA" / "k.cubin").read_bytes() == b"\x01" * 100
    assert (dst / "BBB" / "cuda_utils.so").read_bytes() == b"\x7fELF"
    assert sorted(p.name for p in (dst / "AAA").iterdir()) == ["__grp__k.json", "k.cubin", "k.json", "k.ptx"]
    assert oct((dst / "AAA" / "k.cubin").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())  # not mkstemp's 0600
    assert oct((art / "kernels").stat().st_mode & 0o777) == oct(0o777 & ~current_umask())
    again = kc.install(art, dst, "3.6.0")
    assert again["copied"] == 0 and again["present"] == 5


def test_an_entry_triton_has_is_never_overwritten(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    kc.pack(_triton_cache(tmp_path / "w", {"AAA": KERNEL}), art, _record())
    dst = _triton_cache(tmp_path / "user", {"AAA": {"k.json": b"theirs"}})
    rep = kc.install(art, dst, "3.6.0")
    assert rep["present"] == 2 and rep["copied"] == 2  # their k.json and group file kept, the two others added
    assert (dst / "AAA" / "k.json").read_bytes() == b"theirs"


def test_a_second_warm_adds_entries_and_wins_on_a_conflict(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    kc.pack(_triton_cache(tmp_path / "h100", {"AAA": {"a": b"h100"}, "CCC": {"c": b"tune-h100"}}), art,
            _record("NVIDIA H100"))
    index = kc.pack(_triton_cache(tmp_path / "h200", {"CCC": {"c": b"tune-h200"}, "DDD": {"d": b"x"}}), art,
                    _record("NVIDIA H200"))
    assert sorted(index["files"]) == ["AAA/a", "CCC/c", "DDD/d"]
    assert [w["device"]["name"] for w in index["warms"]] == ["NVIDIA H100", "NVIDIA H200"]
    assert (art / "kernels" / "triton" / "CCC" / "c").read_bytes() == b"tune-h200"
    assert json.loads((art / "kernels" / "index.json").read_text()) == index
    assert sorted(p.name for p in art.iterdir()) == ["kernels"]
    other = kc.pack(_triton_cache(tmp_path / "new", {"EEE": {"e": b"y"}}), art, _record(triton="3.7.0"))
    assert sorted(other["files"]) == ["EEE/e"] and len(other["warms"]) == 1  # another Triton: the old never hit


def test_install_skips_a_modified_entry_whole_and_another_triton_version(tmp_path, caplog):
    art = tmp_path / "art"
    art.mkdir()
    kc.pack(_triton_cache(tmp_path / "w", {"AAA": KERNEL, "BBB": KERNEL}), art, _record())
    (art / "kernels" / "triton" / "BBB" / "k.cubin").write_bytes(b"\x02" * 100)  # same size, other bytes
    dst = tmp_path / "user"
    rep = kc.install(art, dst, "3.6.0")
    assert rep["copied"] == 4 and sorted(rep["skipped"]) == ["BBB/__grp__k.json", "BBB/k.cubin", "BBB/k.json",
                                                              "BBB/k.ptx"]
    assert not (dst / "BBB").exists()  # no part of it: Triton never sees a group without its cubin
    assert "BBB/k.cubin" in caplog.text and "does not match" in caplog.text
    other = kc.install(art, tmp_path / "user2", "3.7.0")
    assert other["status"] == "version" and other["copied"] == 0 and not (tmp_path / "user2").exists()


def test_an_entry_whose_group_names_files_elsewhere_is_not_packed(tmp_path, caplog):
    src = _triton_cache(tmp_path / "w", {"AAA": KERNEL, "BBB": {"x": b"1"}})
    (src / "AAA" / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.json": "/etc/passwd"}}))
    art = tmp_path / "art"
    art.mkdir()
    index = kc.pack(src, art, _record())
    assert sorted(index["files"]) == ["BBB/x"] and "entry AAA left out" in caplog.text


def test_no_kernels_and_bad_index(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    assert kc.install(art, tmp_path / "user", "3.6.0")["status"] == "none"
    (art / "kernels").mkdir()
    (art / "kernels" / "index.json").write_text("{not json")
    with pytest.raises(kc.KernelCacheError, match=r"kernels/index.json: cannot be read as JSON"):
        kc.install(art, tmp_path / "user", "3.6.0")
    (art / "kernels" / "index.json").write_text(json.dumps(
        {"schema": 1, "files": {"../../etc/passwd": {"sha256": "0" * 64, "bytes": 1}}}))
    with pytest.raises(kc.KernelCacheError, match=r"bad entry '../../etc/passwd'"):
        kc.install(art, tmp_path / "user", "3.6.0")


def test_warm_refuses_by_name(tmp_path, k31_cuda):
    import torch

    with pytest.raises(kc.KernelCacheError, match=r"--prompt-tokens 1 must be in 2\.\.\d+"):
        warm.warm(k31_cuda, prompt_tokens=1)
    with pytest.raises(kc.KernelCacheError, match=r"--batch \[0, 999\] outside 1\.\.\d+ \(export.max_batch\)"):
        warm.warm(k31_cuda, batches=[1, 0, 999])
    if not torch.cuda.is_available():
        with pytest.raises(kc.KernelCacheError, match="needs a CUDA GPU"):
            warm.warm(k31_cuda)


def test_exercise_runs_every_kind_of_step_on_cpu_tensors(k31_cuda):
    """warm's run, on the CPU executor (same program; on a GPU it also compiles): the long prompt in chunks, then a
    prefill and two decode steps per batch."""
    from kimi_compile.runtime import load

    sess = load(k31_cuda)
    n = sess.max_seq_len - 2
    said = []
    ran = warm.exercise(sess, n, [1, 3], said.append)
    chunk = int(sess.runtime["prefill_chunk"])
    assert ran[1]["prefill_lengths"] == warm.prefill_lengths(chunk)
    assert [(r["prefill"], r["decode"]) for i, r in enumerate(ran) if i != 1] == [([1, n], 1), ([1, 3], 1),
                                                                                    ([3, 3], 3)]
    assert len(said) == 4 and said[0].startswith(f"prefill of {n} tokens")


def test_prefill_lengths_meet_every_power_of_two_class():
    assert warm.prefill_lengths(64) == [2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64]
    assert warm.prefill_lengths(100) == [2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 100]
    for chunk in (64, 100, 4096):
        got = set(warm.prefill_lengths(chunk))
        for t in range(2, chunk + 1):  # the class of every length a chunk can have: next power of two, 16 | t
            p = 1 << (t - 1).bit_length()
            assert any((1 << (u - 1).bit_length()) == p and (u % 16 == 0) == (t % 16 == 0) for u in got) or \
                t > (1 << (chunk.bit_length() - 1)), t


def test_executor_on_cpu_installs_nothing(tmp_path):
    from kimi_compile.backends.cuda import Executor

    ex = Executor(tmp_path, {"recipe": {}}, device="cpu")
    assert ex.kernel_cache == {"status": "off"}


def test_inspect_shows_the_kernel_cache(k31_cuda, tmp_path):
    import shutil

    from click.testing import CliRunner

    from kimi_compile.cli import main

    art = tmp_path / "art"
    shutil.copytree(k31_cuda, art)
    r = CliRunner().invoke(main, ["inspect", str(art), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["kernel_cache"] is None
    kc.pack(_triton_cache(tmp_path / "w", {"AAA": {"a": b"12345"}}), art, _record())
    r = CliRunner().invoke(main, ["inspect", str(art), "--json"])
    assert json.loads(r.output)["kernel_cache"] == {"entries": 1, "bytes": 5, "triton": "3.6.0",
                                                    "devices": ["NVIDIA H200"]}
    r = CliRunner().invoke(main, ["inspect", str(art)])
    assert r.exit_code == 0 and "kernel cache: 1 entries" in r.output and "NVIDIA H200" in r.output
