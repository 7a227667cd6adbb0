"""kimi_compile/recipe.py: schema, key-path errors, overrides, option coercion, the shipped recipes."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml

from kimi_compile.recipe import (
    BACKENDS,
    DTYPES,
    PRESETS,
    FP8TileOptions,
    ModelSpec,
    MXFP8Options,
    Recipe,
    RecipeError,
    coerce_options,
    load_recipe,
    parse_recipe,
    with_overrides,
)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

MINIMAL = {"name": "t", "model": {"preset": "kimi-k3-tiny"}}


def _full() -> dict:
    return yaml.safe_load((RECIPES / "kimi-k3.1-tiny-quant.yaml").read_text())


def _err(data: dict, source: str = "recipes/x.yaml") -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, source=source)
    return str(info.value)


# -- the shipped recipes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kimi-k3-tiny", "kimi-k3.1-tiny", "kimi-k3.1-tiny-quant"])
def test_shipped_recipes_load_and_round_trip(name):
    r = load_recipe(RECIPES / f"{name}.yaml")
    assert r.name == name
    assert r.model.checkpoint is None and r.model.preset in PRESETS and r.model.seed == 0
    names = [p.name for p in r.passes]
    assert names[0] == "cleanup" and names[-1] == "infer_shapes"
    from kimi_compile.pipeline import PASS_MODULES

    assert set(names) <= set(PASS_MODULES)  # every pass a shipped recipe names exists
    assert (r.backend.name, r.target) == ("onnxruntime", "cpu")
    d = r.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert parse_recipe(d, source="again") == r


def test_quant_recipe_precision_rules():
    r = load_recipe(RECIPES / "kimi-k3.1-tiny-quant.yaml")
    rules = {p.role: p for p in r.precision}
    assert list(rules) == ["indexer_qk", "index_k_cache", "latent_kv_cache", "projection_weight"]
    assert rules["indexer_qk"].options == MXFP8Options(rounding="floor", elem="e4m3", block=32)
    assert rules["index_k_cache"].format == "mxfp8"
    assert rules["latent_kv_cache"].options == FP8TileOptions(tile=16, scale_fmt="ue8m0")  # kv_lora_rank 16 here
    assert rules["projection_weight"].format == "bf16"
    assert r.to_dict()["precision"][3] == {"role": "projection_weight", "format": "bf16", "options": {}}
    assert not load_recipe(RECIPES / "kimi-k3.1-tiny.yaml").precision


def test_defaults_are_resolved():
    r = parse_recipe(MINIMAL)
    d = r.to_dict()
    assert d["export"] == {"block_size": 16, "max_seq_len": 256, "max_batch": 8, "prefill_chunk": 64}
    assert d["model"] == {"preset": "kimi-k3-tiny", "checkpoint": None, "seed": 0, "dtype": "float32"}
    assert d["parallel"] == {"tp": 1, "ep": 1, "cp": 1, "cp_layout": "zigzag", "sequence_parallel": False}
    assert d["backend"] == {"name": "onnxruntime", "options": {}}
    assert d["target"] == "cpu" and d["verify"] == {"tolerance": 1e-4, "accuracy": True}
    assert d["passes"] == [] and d["precision"] == []


def test_recipe_is_frozen_and_bare_pass_names():
    r = parse_recipe({**MINIMAL, "passes": ["cleanup", {"name": "infer_shapes", "enabled": False}]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"  # type: ignore[misc]
    assert [(p.name, p.enabled) for p in r.passes] == [("cleanup", True), ("infer_shapes", False)]
    assert [p.name for p in r.enabled_passes] == ["cleanup"]


def test_presets_match_the_model_spec_literal():
    hints = typing.get_type_hints(ModelSpec)
    literal = [a for a in typing.get_args(hints["preset"]) if a is not type(None)][0]
    assert typing.get_args(literal) == PRESETS


def test_import_does_not_pull_torch():
    code = "import sys, kimi_compile.recipe, kimi_compile.cache, kimi_compile.artifact; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


# -- errors name the file and key path ---------------------------------------------------------------------------


def test_pass_option_error_example_from_the_issue():
    """The pipeline validates pass options with coerce_options; the message has the file and the full key path."""

    @dataclasses.dataclass(frozen=True)
    class TopkOptions:
        topk: int = dataclasses.field(default=8, metadata={"positive": True})

    r = parse_recipe({**MINIMAL, "passes": ["cleanup", "infer_shapes", {"name": "fuse_x", "options": {"topk": -3}}]})
    with pytest.raises(RecipeError) as info:
        coerce_options(TopkOptions, r.passes[2].options, "passes[2].options", "recipes/x.yaml")
    assert str(info.value) == "recipes/x.yaml: passes[2].options.topk: expected a positive int, got -3"
    assert info.value.key_path == "passes[2].options.topk" and info.value.source == "recipes/x.yaml"
    assert isinstance(info.value, ValueError)
    pre = RecipeError("recipes/x.yaml: passes[0].name: unknown pass 'fuse_y'")  # the preformatted form
    assert str(pre) == "recipes/x.yaml: passes[0].name: unknown pass 'fuse_y'" and isinstance(pre, ValueError)


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d.update(pases=[]), "recipes/x.yaml: pases: unknown key (did you mean 'passes'?)"),
        (lambda d: d["export"].update(blok_size=4), "export.blok_size: unknown key (did you mean 'block_size'?)"),
        (lambda d: d["passes"][1].update(enable=False), "passes[1].enable: unknown key (did you mean 'enabled'?)"),
        (lambda d: d["precision"][0].update(fromat="bf16"),
         "precision[0].fromat: unknown key (did you mean 'format'?)"),
        (lambda d: d["precision"][0]["options"].update(roundin="ceil"),
         "precision[0].options.roundin: unknown key (did you mean 'rounding'?)"),
        (lambda d: d["parallel"].update(pp=2), "parallel.pp: unknown key"),
        (lambda d: d["export"].update(block_size=0), "export.block_size: expected a positive int, got 0"),
        (lambda d: d["export"].update(max_batch="8"), "export.max_batch: expected a positive int, got '8' (a string)"),
        (lambda d: d["export"].update(max_seq_len=True), "export.max_seq_len: expected a positive int, got true"),
        (lambda d: d["model"].update(dtype="fp32"),
         f"model.dtype: expected one of {', '.join(DTYPES)}, got 'fp32'"),
        (lambda d: d["model"].update(preset="kimi-k3.1-tiyn"), "(did you mean 'kimi-k3.1-tiny'?)"),
        (lambda d: d["model"].update(seed=-1), "model.seed: expected int >= 0, got -1"),
        (lambda d: d["passes"][0].update(enabled="yes"),
         "passes[0].enabled: expected a bool (true or false), got 'yes'"),
        (lambda d: d["passes"][0].update(name="Clean Up"), "passes[0]: expected a pass name in snake_case"),
        (lambda d: d["passes"][0].update(options=[1]), "passes[0].options: expected a mapping, got a list"),
        (lambda d: d.update(passes={"cleanup": {}}), "passes: expected a list of passes, got a mapping"),
        (lambda d: d["precision"][0].update(role="indexer_kq"), "precision[0].role: expected one of indexer_q,"),
        (lambda d: d["precision"][2].update(format="fp4"), "precision[2].format: expected one of fp32, bf16"),
        (lambda d: d["precision"][2]["options"].update(scale_fmt="e8m0"),
         "precision[2].options.scale_fmt: expected one of fp32, ue8m0, got 'e8m0'"),
        (lambda d: d["precision"][3].update(options={"tile": 128}), "precision[3].options.tile: unknown key"),
        (lambda d: d["precision"].append({"role": "indexer_q", "format": "bf16"}),
         "precision[4].role: 'indexer_q' already has a rule in precision[0] (indexer_qk); give each tensor role"),
        (lambda d: d["precision"].append({"role": "projection_weight", "format": "fp16"}),
         "precision[4].role: 'projection_weight' already has a rule in precision[3]; give"),
        (lambda d: d["precision"].insert(0, {"role": "indexer_k", "format": "bf16"}),
         "precision[1].role: 'indexer_qk' covers 'indexer_k', which already has a rule in precision[0]; give"),
        (lambda d: d["precision"].append({"format": "bf16"}), "precision[4].role: missing required key"),
        (lambda d: d["parallel"].update(sequence_parallel=True),
         "parallel.sequence_parallel: sequence_parallel requires parallel.tp > 1, got tp=1"),
        (lambda d: d["parallel"].update(tp=0), "parallel.tp: expected a positive int, got 0"),
        (lambda d: d["backend"].update(name="trt"), f"backend.name: expected one of {', '.join(BACKENDS)}"),
        (lambda d: d.update(target="cuda"), "target: backend onnxruntime builds for target cpu, got 'cuda'"),
        (lambda d: d["backend"].update(name="tensorrt"), "target: backend tensorrt builds engines for a GPU arch"),
        pytest.param(lambda d: d["backend"].update(name="cuda"), "target: backend cuda needs a GPU target",
                     marks=pytest.mark.skipif("cuda" not in BACKENDS, reason="the cuda backend is not built yet")),
        (lambda d: d["verify"].update(tolerance="1e-4"), "verify.tolerance: expected a positive float, got '1e-4' (a"),
        (lambda d: d["verify"].update(tolerance=-0.5), "verify.tolerance: expected a positive float, got -0.5"),
        (lambda d: d["export"].update(prefill_chunk=512), "export.prefill_chunk: prefill_chunk 512 exceeds"),
        (lambda d: d["model"].update(checkpoint="/ckpt"),
         "model.checkpoint: set model.preset or model.checkpoint, not both"),
        (lambda d: d["model"].update(preset=None), "recipes/x.yaml: model: set model.preset (one of kimi-k3-tiny"),
        (lambda d: d.pop("name"), "recipes/x.yaml: name: missing required key"),
        (lambda d: d.update(name=""), "name: expected a non-empty string"),
        (lambda d: d["backend"].update(options={"x": {1: 2}}), "backend.options.x: keys must be strings"),
    ],
)
def test_bad_values_fail_with_key_path(mutate, expected):
    data = _full()
    mutate(data)
    msg = _err(data)
    assert msg.startswith("recipes/x.yaml: ")
    assert expected in msg, msg


def test_valid_combinations():
    d = _full()
    d["backend"] = {"name": "tensorrt", "options": {"workspace_gb": 4}}
    d["target"] = "sm120"
    r = parse_recipe(d)
    assert r.backend.options == {"workspace_gb": 4} and r.target == "sm120"
    assert parse_recipe({**MINIMAL, "verify": {"tolerance": 1}}).verify.tolerance == 1.0


def test_values_no_backend_builds_are_refused_with_the_ones_that_exist():
    from kimi_compile.recipe import BACKENDS, DTYPES

    d = _full()
    d["parallel"] = {"tp": 2, "cp": 1, "sequence_parallel": False}
    assert _err(d) == ("recipes/x.yaml: parallel.tp: tp=2 runs its ranks over torch.distributed on backend cuda, got "
                       "backend 'onnxruntime' (it runs one rank)")
    d = _full()
    d["backend"] = {"name": "nccl-magic"}
    assert _err(d) == f"recipes/x.yaml: backend.name: expected one of {', '.join(BACKENDS)}, got 'nccl-magic'"
    d = _full()
    d["model"]["dtype"] = "float16"
    assert _err(d).startswith(f"recipes/x.yaml: model.dtype: expected one of {', '.join(DTYPES)}, got 'float16'")


def test_not_a_mapping():
    assert _err([1, 2]) == "recipes/x.yaml: a recipe is a mapping at the top level, got a list"
    assert "model: expected a mapping" in _err({"name": "t", "model": "kimi-k3-tiny"})


# -- load_recipe -------------------------------------------------------------------------------------------------


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError, match=r"nope\.yaml: recipe file not found"):
        load_recipe(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nmodel: {preset: kimi-k3-tiny\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml: invalid YAML: line \d+, column \d+"):
        load_recipe(bad)
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: t\nmodel: {preset: kimi-k3-tiny}\nname: u\n")
    with pytest.raises(RecipeError, match=r"dup\.yaml: invalid YAML: .*duplicate key 'name' \(line 3"):
        load_recipe(dup)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(RecipeError, match="the recipe is empty"):
        load_recipe(empty)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("name: t\nmodel: {preset: kimi-k3-tiny}\nexport: {max_seq: 4}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(unknown)
    assert str(info.value) == f"{unknown}: export.max_seq: unknown key (did you mean 'max_seq_len'?)"


def test_relative_checkpoint_resolves_against_the_recipe(tmp_path):
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "r.yaml"
    p.write_text("name: t\nmodel: {checkpoint: ../ckpt}\n")
    r = load_recipe(p)
    assert r.model.checkpoint == str((tmp_path / "ckpt").resolve()) and r.model.preset is None
    assert r.source == str(p)


# -- with_overrides ----------------------------------------------------------------------------------------------


def test_with_overrides(tmp_path, monkeypatch):
    r = load_recipe(RECIPES / "kimi-k3.1-tiny.yaml")
    monkeypatch.chdir(tmp_path)
    r2 = with_overrides(r, checkpoint="ckpt", backend=None)
    assert r2.model.checkpoint == str(tmp_path / "ckpt") and r2.model.preset is None
    assert r2.backend.name == "onnxruntime" and r2.source == r.source
    assert r.model.preset == "kimi-k3.1-tiny"  # the original is unchanged
    assert with_overrides(r) == r
    r3 = with_overrides(r, backend="tensorrt", target="sm89", seed=3)
    assert (r3.backend.name, r3.target, r3.model.seed) == ("tensorrt", "sm89", 3)
    with pytest.raises(RecipeError) as info:
        with_overrides(r, backend="tensorrt")
    assert "(overrides: --backend): target: backend tensorrt builds engines for a GPU arch" in str(info.value)
    with pytest.raises(RecipeError, match="model.dtype: expected one of"):
        with_overrides(r, dtype="int8")
    with pytest.raises(TypeError, match="unknown override 'chekpoint' \\(did you mean 'checkpoint'\\?\\)"):
        with_overrides(r, chekpoint="x")


# -- coerce_options ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Opts:
    mode: Literal["a", "b"] = "a"
    ratio: float = 0.5
    limit: int | None = None
    tags: tuple[str, ...] = ()
    flag: bool = False
    label: str = "x"
    level: int = dataclasses.field(default=1, metadata={"min": 0, "max": 3})

    def __post_init__(self):
        if self.limit is not None and self.limit < self.level:
            raise ValueError(f"limit {self.limit} is below level {self.level}")


@dataclasses.dataclass(frozen=True)
class _Required:
    size: int


def test_coerce_options_types_and_defaults():
    o = coerce_options(_Opts, {"mode": "b", "ratio": 2, "limit": 7, "tags": ["p", "q"], "flag": True}, "o", "s")
    assert o == _Opts(mode="b", ratio=2.0, limit=7, tags=("p", "q"), flag=True)
    assert isinstance(o.ratio, float)
    assert coerce_options(_Opts, None, "o", "s") == _Opts()
    assert coerce_options(_Opts, {"limit": None}, "o", "s").limit is None


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"mode": "c"}, "s: o.mode: expected one of a, b, got 'c'"),
        ({"ratio": "x"}, "s: o.ratio: expected a float, got 'x' (a string)"),
        ({"limit": 1.5}, "s: o.limit: expected an int, got 1.5"),
        ({"tags": "p"}, "s: o.tags: expected a list of str, got 'p' (a string)"),
        ({"tags": ["p", 3]}, "s: o.tags[1]: expected a string, got 3"),
        ({"flag": 1}, "s: o.flag: expected a bool (true or false), got 1"),
        ({"label": 3}, "s: o.label: expected a string, got 3"),
        ({"level": 4}, "s: o.level: expected int <= 3, got 4"),
        ({"limit": 0, "level": 1}, "s: o: limit 0 is below level 1"),
        ({"lvl": 1}, "s: o.lvl: unknown key (did you mean 'level'?)"),
        ([1], "s: o: expected a mapping, got a list"),
    ],
)
def test_coerce_options_errors(data, expected):
    with pytest.raises(RecipeError) as info:
        coerce_options(_Opts, data, "o", "s")
    assert str(info.value) == expected


def test_coerce_options_required_and_not_a_dataclass():
    with pytest.raises(RecipeError, match=r"^s: backend\.options\.size: missing required key$"):
        coerce_options(_Required, {}, "backend.options", "s")
    with pytest.raises(TypeError):
        coerce_options(dict, {}, "o", "s")


def test_to_dict_is_a_copy():
    r = parse_recipe({**MINIMAL, "passes": [{"name": "p", "options": {"k": [1, 2]}}]})
    d = r.to_dict()
    d["passes"][0]["options"]["k"].append(3)
    assert r.to_dict()["passes"][0]["options"] == {"k": [1, 2]}
    assert isinstance(r, Recipe) and copy.deepcopy(r) == r


def test_precision_rule_lookup_by_role():
    r = load_recipe(RECIPES / "kimi-k3.1-tiny-quant.yaml")
    assert r.precision_rule("indexer_q") is r.precision_rule("indexer_k") is r.precision_rule("indexer_qk")
    assert r.precision_rule("indexer_q").format == "mxfp8"
    assert r.precision_rule("latent_kv_cache").options.scale_fmt == "ue8m0"
    assert r.precision_rule("projection_activation") is None
    with pytest.raises(KeyError, match="unknown tensor role 'kv'"):
        r.precision_rule("kv")


def test_parallel_layouts_are_checked_against_the_model():
    tp2 = yaml.safe_load((RECIPES / "kimi-k3.1-tiny-tp2.yaml").read_text())
    assert parse_recipe(tp2).parallel.tp == 2
    d = {**tp2, "passes": [p for p in tp2["passes"] if p["name"] != "partition_tp"]}
    assert _err(d).startswith("recipes/x.yaml: parallel.tp: tp=2 needs the partition_tp pass in passes")
    d = {**tp2, "parallel": {"tp": 2, "ep": 4}}
    assert _err(d) == ("recipes/x.yaml: parallel.ep: ep=4 must divide parallel.tp=2 (experts are split within the "
                       "tensor-parallel group)")
    d = {**tp2, "parallel": {"tp": 8}}  # 4 MLA heads
    assert _err(d) == ("recipes/x.yaml: parallel.tp: tp=8 does not divide num_attention_heads: MLA heads are split "
                       "across ranks (4 % 8 = 4) (preset kimi-k3.1-tiny)")
