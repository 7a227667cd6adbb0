import os
import shutil

import pytest
import torch

from kimi_compile.config import preset
from kimi_compile.model.weights import build_model, init_random


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="session")
def tiny_models():
    """Seeded random fp32 models of the two tiny presets."""
    return {name: init_random(build_model(preset(name)), seed=3) for name in ("kimi-k3-tiny", "kimi-k3.1-tiny")}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory):
    """kimi-k3.1-tiny built once per session with verify=True: (recipe, BuildResult, CompileCache, tmp dir). Builds of
    variants start from a copy of its compile cache (the `tiny_cache` fixture), so the stages they share hit."""
    from kimi_compile.build import build
    from kimi_compile.cache import CompileCache
    from kimi_compile.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("tiny_build")
    recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny.yaml"))
    cache = CompileCache(root=tmp / "cache")
    return recipe, build(recipe, tmp / "art", verify=True, cache=cache), cache, tmp


def _cache_copy(tiny_build, dst):
    from kimi_compile.cache import CompileCache

    shutil.copytree(tiny_build[2].root, dst)
    return CompileCache(root=dst)


@pytest.fixture
def tiny_cache(tiny_build, tmp_path):
    """A private copy of tiny_build's compile cache (the test may add to it)."""
    return _cache_copy(tiny_build, tmp_path / "tiny_cache")


@pytest.fixture(scope="session")
def quant_build(tiny_build, tmp_path_factory):
    """kimi-k3.1-tiny-quant built once per session with verify=True (its trace hits tiny_build's cache):
    (recipe, BuildResult)."""
    from kimi_compile.build import build
    from kimi_compile.recipe import load_recipe

    tmp = tmp_path_factory.mktemp("quant_build")
    recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-quant.yaml"))
    return recipe, build(recipe, tmp / "art", verify=True, cache=_cache_copy(tiny_build, tmp / "cache"))
