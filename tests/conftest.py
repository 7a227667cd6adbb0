import os
import shutil

import pytest
import torch

from kimi_compile.config import preset
from kimi_compile.model.weights import build_model, init_random


def _interpreter_bf16_dot() -> None:
    """Under TRITON_INTERPRET=1 Triton's interpreter stores bfloat16 as uint16 and its `tl.dot` multiplies those bit
    patterns (values near 1e10; triton-lang/triton#11584, left unfixed upstream; seen in triton 3.6 and 3.9): give it
    bfloat16 operands widened to fp32 (exact), so the kernels' bf16 GEMMs (sparse MLA) run correctly on CPU tensors.
    The GPU path is untouched."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    orig = ti.InterpreterBuilder.create_dot
    if getattr(orig, "widens_bf16", False):
        return

    def widen(h):
        if h.dtype != tl.bfloat16:
            return h
        return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):
        return orig(self, widen(a), widen(b), d, *args)

    create_dot.widens_bf16 = True
    ti.InterpreterBuilder.create_dot = create_dot


_interpreter_bf16_dot()


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="session")
def tiny_models():
    """Seeded random fp32 models of the two tiny presets."""
    return {name: init_random(build_model(preset(name)), seed=3) for name in ("kimi-k3-tiny", "kimi-k3.1-tiny")}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Recipes the suite builds and expects to find in the compile cache. The suite warms one cache with them once
# (`warm_cache`); its builds then read it read-only and hit every stage (tests/test_ci_cache.py asserts it).
WARM_RECIPES = ("kimi-k3.1-tiny", "kimi-k3.1-tiny-quant", "kimi-k3.1-tiny-nz", "kimi-k3-tiny")
# .ci/run warms a cache before the suite (`kimi-compile build` of WARM_RECIPES, then `kimi-compile cache export`)
# and names the archive here: the suite imports it instead of building (the CI workflow in the README).
ARCHIVE_ENV = "KIMI_TEST_CACHE_ARCHIVE"


def _recipe(name: str):
    from kimi_compile.recipe import load_recipe

    return load_recipe(os.path.join(ROOT, "recipes", f"{name}.yaml"))


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory):
    """The suite's warm compile cache, read-only: imported from $KIMI_TEST_CACHE_ARCHIVE (CI), else built here once
    from WARM_RECIPES. Returns (CompileCache (read-only), how it was warmed: "archive" or "built")."""
    from kimi_compile.build import build
    from kimi_compile.cache import CompileCache

    root = tmp_path_factory.mktemp("warm_cache") / "cache"
    archive = os.environ.get(ARCHIVE_ENV)
    if archive:
        CompileCache(root=root, read_only=False).import_(archive)
        how = "archive"
    else:
        writable = CompileCache(root=root, read_only=False)
        out = tmp_path_factory.mktemp("warm_builds")
        for name in WARM_RECIPES:
            build(_recipe(name), out / name, cache=writable)
        how = "built"
    return CompileCache(root=root, read_only=True), how


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory, warm_cache):
    """kimi-k3.1-tiny built once per session with verify=True, from the warm cache (read-only):
    (recipe, BuildResult, CompileCache, tmp dir). Tests that add to a cache take `tiny_cache` (a writable copy)."""
    from kimi_compile.build import build

    tmp = tmp_path_factory.mktemp("tiny_build")
    recipe = _recipe("kimi-k3.1-tiny")
    cache = warm_cache[0]
    return recipe, build(recipe, tmp / "art", verify=True, cache=cache), cache, tmp


def _cache_copy(tiny_build, dst):
    from kimi_compile.cache import CompileCache

    shutil.copytree(tiny_build[2].root, dst)
    return CompileCache(root=dst, read_only=False)


@pytest.fixture
def tiny_cache(tiny_build, tmp_path):
    """A private, writable copy of the warm compile cache (the test may add to it)."""
    return _cache_copy(tiny_build, tmp_path / "tiny_cache")


@pytest.fixture(scope="session")
def quant_build(tiny_build, warm_cache, tmp_path_factory):
    """kimi-k3.1-tiny-quant built once per session with verify=True from the warm cache: (recipe, BuildResult)."""
    from kimi_compile.build import build

    tmp = tmp_path_factory.mktemp("quant_build")
    recipe = _recipe("kimi-k3.1-tiny-quant")
    return recipe, build(recipe, tmp / "art", verify=True, cache=warm_cache[0])


@pytest.fixture(scope="session")
def suite_cache(warm_cache, tmp_path_factory):
    """One writable copy of the warm cache for the session's CLI tests (README commands, text prompts)."""
    from kimi_compile.cache import CompileCache

    root = tmp_path_factory.mktemp("suite_cache") / "cache"
    shutil.copytree(warm_cache[0].root, root)
    return CompileCache(root=root, read_only=False)


CORPUS = [
    "The cat sat on the mat. The dog sat on the log.",
    "Hello! How are you today? I am fine, thank you.",
    "Kimi compiles graphs ahead of time: trace, fuse, quantize, lower.",
    "A small tokenizer, trained here, for tests of text prompts.",
    "Numbers like 12, 345 and 6789 are split into short pieces.",
] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(ckpt, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained with `tokenizers` on CORPUS, with a chat template, saved into `ckpt`.
    Special tokens: <unk> 0, <|im_start|> 1, <|im_end|> 2 (the presets' eos_token_id)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None, "unk_token": "<unk>"}))


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory):
    """A kimi-k3.1-tiny checkpoint dir (random weights, seed 0) shipping a tokenizer and a chat template."""
    from kimi_compile.config import preset
    from kimi_compile.model import random_checkpoint

    ckpt = random_checkpoint("kimi-k3.1-tiny", 0, tmp_path_factory.mktemp("text_ckpt") / "ckpt")
    write_tokenizer(ckpt, preset("kimi-k3.1-tiny").vocab_size)
    return ckpt


@pytest.fixture(scope="session")
def text_build_run(text_checkpoint, suite_cache, tmp_path_factory):
    """kimi-k3.1-tiny built from text_checkpoint (`--model DIR`) through the CLI, cold (a new checkpoint): (artifact
    dir, the Python warnings the build raised)."""
    import warnings

    from click.testing import CliRunner

    from kimi_compile.cli import main

    out = tmp_path_factory.mktemp("text_build") / "k31-text"
    env = {"KIMI_COMPILE_CACHE": str(suite_cache.root), "KIMI_COMPILE_CACHE_READONLY": "0"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = CliRunner().invoke(main, ["build", os.path.join(ROOT, "recipes", "kimi-k3.1-tiny.yaml"), "--model",
                                      str(text_checkpoint), "--out", str(out), "--quiet"], env=env)
    assert r.exit_code == 0, r.output
    return out, [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.fixture(scope="session")
def text_build(text_build_run):
    """The artifact dir of text_build_run."""
    return text_build_run[0]
