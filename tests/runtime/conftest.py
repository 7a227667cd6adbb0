"""Artifacts and sessions shared by the runtime tests: one build per (preset, backend) per test session, built on
first use from a copy of the session's warm compile cache (kimi-k3.1-tiny on onnxruntime is tiny_build itself)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT, _cache_copy

PROMPTS = [[5, 17, 3, 99, 250, 7, 12, 40, 41, 8, 300, 2, 77], [9, 8, 7], [400, 1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="session")
def runtime_artifact(tiny_build, tmp_path_factory):
    """(preset, backend) -> artifact dir; the cuda builds are the same recipes with backend cuda, target cuda."""
    from kimi_compile.build import build
    from kimi_compile.recipe import load_recipe, with_overrides

    recipe, res, _, _ = tiny_build
    tmp = tmp_path_factory.mktemp("runtime_builds")
    cache = _cache_copy(tiny_build, tmp / "cache")
    built = {("kimi-k3.1-tiny", "onnxruntime"): res.artifact}

    def get(preset: str, backend: str):
        if (preset, backend) not in built:
            r = recipe if preset == "kimi-k3.1-tiny" else load_recipe(os.path.join(ROOT, "recipes", f"{preset}.yaml"))
            if backend != "onnxruntime":
                r = with_overrides(r, backend=backend, target=backend)
            built[(preset, backend)] = build(r, tmp / f"{preset}-{backend}", cache=cache).artifact
        return built[(preset, backend)]

    return get


@pytest.fixture(scope="session")
def runtime_session(runtime_artifact):
    """(preset, backend) -> a loaded Session, one per session (the cuda executor keeps its specialized programs)."""
    from kimi_compile.runtime import load

    sessions = {}

    def get(preset: str, backend: str):
        if (preset, backend) not in sessions:
            sessions[(preset, backend)] = load(runtime_artifact(preset, backend))
        return sessions[(preset, backend)]

    return get


@pytest.fixture(scope="session")
def plain_greedy(runtime_session):
    """(preset, backend, n) -> plain greedy tokens of PROMPTS (no eos stop), computed once."""
    done = {}

    def get(preset: str, backend: str, n: int = 64):
        if (preset, backend, n) not in done:
            done[(preset, backend, n)] = runtime_session(preset, backend).generate(PROMPTS, n, stop_at_eos=False)
        return done[(preset, backend, n)]

    return get
