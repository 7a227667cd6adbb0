"""Property tests (hypothesis): the recipe loader, the config parser and the manifest loader, fed random and mutated
YAML/JSON, raise only the project's own error types (RecipeError, ConfigError, ArtifactError), never a traceback of
another type. A fixed seed (derandomize) keeps CI reproducible."""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_compile.artifact import ArtifactError, ArtifactWriter, load_manifest
from kimi_compile.config import ConfigError, from_hf_dict, load_config, preset_hf_dict
from kimi_compile.recipe import RecipeError, load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parent.parent
FUZZ = settings(derandomize=True, database=None, deadline=None,
                max_examples=int(os.environ.get("KIMI_FUZZ_EXAMPLES", "150")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 40), 2 ** 40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                    max_leaves=12)


def _paths(doc, prefix=()):
    """Every key path of a nested dict/list document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated(draw, base):
    """`base` with a few of its values replaced by random JSON, deleted, or given an extra key."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["replace", "delete", "extra"]))
        if action == "replace":
            parent[path[-1]] = draw(JSON)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(JSON)
    return doc


RECIPE = yaml.safe_load((ROOT / "recipes" / "kimi-k3.1-tiny-quant.yaml").read_text())
CONFIG = preset_hf_dict("kimi-k3.1-tiny")


@FUZZ
@given(mutated(RECIPE))
def test_recipe_mutations_raise_only_recipe_errors(doc):
    try:
        parse_recipe(doc, source="fuzz.yaml")
    except RecipeError as e:
        assert str(e).startswith("fuzz.yaml")


@FUZZ
@given(st.one_of(JSON, st.text(max_size=200), st.binary(max_size=200)))
def test_recipe_files_of_random_bytes_raise_only_recipe_errors(content):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_bytes(content.encode("utf-8", "surrogatepass"))
        else:
            path.write_text(yaml.safe_dump(content))
        try:
            load_recipe(path)
        except RecipeError as e:
            assert str(path) in str(e)


@FUZZ
@given(mutated(CONFIG))
def test_config_mutations_raise_only_config_errors(doc):
    try:
        from_hf_dict(doc, source="fuzz/config.json")
    except ConfigError:
        pass


@FUZZ
@given(st.one_of(JSON.map(json.dumps), st.binary(max_size=300)))
def test_config_files_of_random_content_raise_only_config_errors(content):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        try:
            load_config(d)
        except ConfigError:
            pass


def _artifact(root: Path) -> dict:
    with ArtifactWriter(root) as w:
        w.add_file("graphs/prefill.onnx", data=b"graph")
        w.manifest.update({"backend": {"name": "onnxruntime"}, "runtime": {"max_seq_len": 8}})
    return json.loads((root / "manifest.json").read_text())


_BASE_DIR = Path(tempfile.mkdtemp(prefix="kimi-fuzz-manifest-"))
MANIFEST = _artifact(_BASE_DIR / "art")


@FUZZ
@given(st.one_of(mutated(MANIFEST).map(json.dumps), JSON.map(json.dumps), st.binary(max_size=300)))
def test_manifest_mutations_raise_only_artifact_errors(content):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "art"
        (root / "graphs").mkdir(parents=True)
        (root / "graphs" / "prefill.onnx").write_bytes(b"graph")
        (root / "manifest.json").write_bytes(content if isinstance(content, bytes) else content.encode())
        try:
            load_manifest(root)
        except ArtifactError as e:
            assert str(root) in str(e)
