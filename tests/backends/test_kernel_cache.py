"""The artifact's kernel cache (backends/cuda/kernel_cache.py) on files: pack merges warms into ARTIFACT/kernels with
an index of hashes, install copies what Triton's cache lacks and skips what does not match. The GPU round trip (warm,
then a fresh process that compiles nothing) is tests/backends/test_cuda_gpu.py."""

from __future__ import annotations

import json

import pytest

from kimi_compile import warm
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
    for entry, files in entries.items():
        (root / entry).mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (root / entry / name).write_bytes(data)
    return root


def _record(device="NVIDIA H200", triton="3.6.0"):
    return {"device": {"name": device, "capability": "sm90"}, "versions": {"triton": triton}}


def test_pack_then_install_copies_every_file_and_keeps_what_is_there(tmp_path):
    src = _triton_cache(tmp_path / "warm", {"AAA": {"k.cubin": b"\x01" * 100, "k.json": b"{}"},
                                            "BBB": {"cuda_utils.so": b"\x7fELF", "tmp.pid_1_2": b"partial"}})
    art = tmp_path / "art"
    art.mkdir()
    index = kc.pack(src, art, _record())
    assert sorted(index["files"]) == ["AAA/k.cubin", "AAA/k.json", "BBB/cuda_utils.so"]  # Triton's temp file left out
    assert index["entries"] == 2 and index["bytes"] == 106 and index["triton"] == "3.6.0"
    assert [p.name for p in art.iterdir()] == ["kernels"]  # no staging folder left
    dst = _triton_cache(tmp_path / "user", {"AAA": {"k.json": b"theirs"}})
    rep = kc.install(art, dst, "3.6.0")
    assert rep == {"status": "installed", "files": 3, "copied": 2, "present": 1, "skipped": [], "triton": "3.6.0"}
    assert (dst / "AAA" / "k.cubin").read_bytes() == b"\x01" * 100
    assert (dst / "AAA" / "k.json").read_bytes() == b"theirs"  # an entry Triton has is never overwritten
    assert (dst / "BBB" / "cuda_utils.so").read_bytes() == b"\x7fELF"
    assert sorted(p.name for p in (dst / "BBB").iterdir()) == ["cuda_utils.so"]  # no temp names left
    again = kc.install(art, dst, "3.6.0")
    assert again["copied"] == 0 and again["present"] == 3


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


def test_install_skips_a_modified_file_and_another_triton_version(tmp_path, caplog):
    art = tmp_path / "art"
    art.mkdir()
    kc.pack(_triton_cache(tmp_path / "w", {"AAA": {"a": b"good"}, "BBB": {"b": b"good"}}), art, _record())
    (art / "kernels" / "triton" / "BBB" / "b").write_bytes(b"evil")  # same size, other bytes
    dst = tmp_path / "user"
    rep = kc.install(art, dst, "3.6.0")
    assert rep["copied"] == 1 and rep["skipped"] == ["BBB/b"]
    assert not (dst / "BBB" / "b").exists()
    assert "BBB/b" in caplog.text and "does not match" in caplog.text
    other = kc.install(art, tmp_path / "user2", "3.7.0")
    assert other["status"] == "version" and other["copied"] == 0 and not (tmp_path / "user2").exists()


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
