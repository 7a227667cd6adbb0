"""kimi_compile/backends/onnxruntime.py: execution providers (cuda, cpu) from the recipe or at load, and the CPU
fallback with a clear note when onnxruntime-gpu (the CUDA execution provider) is absent."""

from __future__ import annotations

import dataclasses
import logging

import onnxruntime as ort
import pytest
from click.testing import CliRunner

from kimi_compile.backends.onnxruntime import options, resolve_providers
from kimi_compile.build import build
from kimi_compile.cli import main
from kimi_compile.recipe import RecipeError
from kimi_compile.runtime import load
from kimi_compile.runtime.session import RuntimeInputError

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"


def test_resolve_providers():
    assert resolve_providers(["cuda", "cpu"], [CUDA, CPU]) == ([CUDA, CPU], [])
    assert resolve_providers(["cuda"], [CUDA, CPU]) == ([CUDA, CPU], [])  # CPU always closes the list
    use, notes = resolve_providers(["cuda", "cpu"], [CPU])
    assert use == [CPU] and len(notes) == 1
    assert "install onnxruntime-gpu" in notes[0] and "Running on the CPU" in notes[0]
    with pytest.raises(ValueError, match="unknown provider 'tpu'"):
        resolve_providers(["tpu"], [CPU])


def test_recipe_option_is_validated():
    assert options({"providers": ["cuda", "cpu"]}).providers == ("cuda", "cpu")
    assert options({}).providers == ("cpu",)
    with pytest.raises(RecipeError, match=r"backend.options.providers: expected a non-empty list of cuda, cpu"):
        options({"providers": ["gpu"]})
    with pytest.raises(RecipeError, match=r"backend.options"):
        options({"provider": ["cuda"]})


@pytest.mark.skipif(HAS_CUDA, reason="checks the fallback on a machine without onnxruntime-gpu")
def test_cuda_requested_without_onnxruntime_gpu_falls_back_with_a_note(tiny_build, caplog):
    art = tiny_build[1].artifact
    with caplog.at_level(logging.WARNING, logger="kimi_compile.backends.onnxruntime"):
        sess = load(art, providers=["cuda", "cpu"])
    assert sess.backend.providers == [CPU]
    assert any("install onnxruntime-gpu" in r.message for r in caplog.records)
    assert sess.generate([[1, 2, 3]], 3) == load(art).generate([[1, 2, 3]], 3)
    r = CliRunner().invoke(main, ["run", str(art), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                                  "--providers", "cuda,cpu"])
    assert r.exit_code == 0, r.output
    assert "1,2,3 -> " in r.output


def test_recipe_providers_reach_the_executor(tiny_build, tmp_path):
    recipe, _, cache, _ = tiny_build
    recipe = dataclasses.replace(recipe, backend=dataclasses.replace(recipe.backend, options={"providers": ["cuda",
                                                                                                        "cpu"]}))
    res = build(recipe, tmp_path / "art", cache=cache)
    assert res.cache_hits["trace"]["misses"] == 0 and res.cache_hits["pass"]["misses"] == 0
    sess = load(tmp_path / "art")
    assert sess.backend.providers == ([CUDA, CPU] if HAS_CUDA else [CPU])


def test_provider_errors_are_one_line(tiny_build, tmp_path):
    art = str(tiny_build[1].artifact)
    r = CliRunner().invoke(main, ["run", art, "--prompt-ids", "1", "--providers", "tpu"])
    assert r.exit_code == 1 and "unknown provider 'tpu'" in r.output and "Traceback" not in r.output
    with pytest.raises(RuntimeInputError, match="apply to onnxruntime artifacts"):
        from kimi_compile.artifact import ArtifactWriter

        with ArtifactWriter(tmp_path / "cuda") as w:
            w.add_file("x", data=b"x")
            w.manifest.update({"backend": {"name": "cuda"}, "runtime": {}, "graphs": {}})
        load(tmp_path / "cuda", providers=["cuda"])
