"""kimi_compile/debug.py: `kimi-compile debug` compares every intermediate tensor through Polygraphy and names the
first tensors past the tolerance with their node, layer and kimi.rule."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kimi_compile.artifact import ArtifactWriter
from kimi_compile.cache import sha256_file
from kimi_compile.cli import main
from kimi_compile.debug import DebugError, debug_artifacts
from kimi_compile.report import REPORTS

BROKEN = "model.model.layers.3.block_sparse_moe.shared_experts.up_proj.weight"


@pytest.fixture
def cache_env(tiny_build, monkeypatch):
    """`--against reference` re-reads the trace from the compile cache: point it at the suite's warm cache."""
    monkeypatch.setenv("KIMI_COMPILE_CACHE", str(tiny_build[2].root))
    monkeypatch.setenv("KIMI_COMPILE_CACHE_READONLY", "1")


def _break_weight(src, dst, name: str) -> None:
    """Copy of artifact `src` whose weight `name` is scaled and shifted in graphs/weights.bin (manifest rehashed, so
    it loads like a build that went wrong, not like a tampered file)."""
    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "graphs" / "prefill.onnx"), load_external_data=False)
    init = next(t for t in model.graph.initializer if t.name == name)
    loc = {e.key: e.value for e in init.external_data}
    off, n = int(loc["offset"]), int(loc["length"])
    path = dst / "graphs" / loc["location"]
    data = bytearray(path.read_bytes())
    w = np.frombuffer(bytes(data[off:off + n]), dtype=np.float32)
    data[off:off + n] = (w * -3.0 + 0.5).astype(np.float32).tobytes()
    path.write_bytes(bytes(data))
    manifest = json.loads((dst / "manifest.json").read_text())
    rel = f"graphs/{loc['location']}"
    manifest["files"][rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (dst / "manifest.json").write_text(json.dumps(manifest))


def test_artifact_matches_its_reference_trace(tiny_build, cache_env):
    res = debug_artifacts(tiny_build[1].artifact, "reference")
    assert res["against"].startswith("reference")
    for phase, r in res["phases"].items():
        assert r["compared"] > 50, (phase, r)  # the tensors the passes left with their exporter names
        assert r["failing"] == 0, (phase, r["first"][:3])


def test_broken_weight_is_found_at_its_layer(tiny_build, tmp_path):
    good = tiny_build[1].artifact
    _break_weight(good, tmp_path / "broken", BROKEN)
    res = debug_artifacts(tmp_path / "broken", good)
    for phase, r in res["phases"].items():
        assert r["failing"] > 0 and "logits" in r["failing_graph_outputs"], phase
        first = r["first"][0]
        assert first["layer"] == "3", (phase, r["first"][:3])
        assert first["op"] == "kimi.MoE" and first["rule"] == "fuse_moe"  # the fused MoE reads the weight
        assert all(f["layer"] in ("3", "4", "5", "") for f in r["first"])  # nothing before layer 3
    r = CliRunner().invoke(main, ["debug", str(tmp_path / "broken"), "--against", str(good), "--top", "2"])
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert "past the tolerance" in lines[1] and "(kimi.MoE, layer 3, kimi.rule fuse_moe)" in lines[2], r.output


def test_identical_artifacts_pass_with_exit_0(tiny_build):
    art = str(tiny_build[1].artifact)
    r = CliRunner().invoke(main, ["debug", art, "--against", art, "--phase", "decode", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert list(doc["phases"]) == ["decode"] and doc["phases"]["decode"]["failing"] == 0


def test_quantized_against_fp32_names_the_first_quantized_tensors(quant_build, tiny_build):
    res = debug_artifacts(quant_build[1].artifact, tiny_build[1].artifact, rtol=1e-2, atol=1e-3)
    pre = res["phases"]["prefill"]
    assert pre["compared"] > 50 and pre["failing"] > 0
    first = pre["first"][0]
    assert first["layer"] != "" and first["max_abs_err"] is not None and first["max_abs_err"] > 1e-3


def test_debug_refuses_artifacts_onnx_runtime_cannot_feed(tmp_path, tiny_build):
    with ArtifactWriter(tmp_path / "cuda", reports=REPORTS) as w:
        w.add_file("graphs/prefill.onnx", data=b"x")
        w.manifest.update({"backend": {"name": "cuda"}, "graphs": {}, "runtime": {}})
    with pytest.raises(DebugError, match="is a cuda artifact; debug runs graphs on ONNX Runtime"):
        debug_artifacts(tmp_path / "cuda", tiny_build[1].artifact)
    r = CliRunner().invoke(main, ["debug", str(tmp_path / "cuda")])
    assert r.exit_code == 1 and "onnxruntime artifacts" in r.output and "Traceback" not in r.output
