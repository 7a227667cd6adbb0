"""kimi_compile/pipeline.py: the pass loop owns caching, the verifier and dumps; results carry the statistics; a pass
declares signature changes (never special-cased by name)."""

from __future__ import annotations

import dataclasses
import json

import onnx_ir as ir
import pytest

from kimi_compile import pipeline
from kimi_compile.cache import CompileCache
from kimi_compile.passbase import KimiPass, KimiPassResult, PassStats
from kimi_compile.recipe import PassSpec, RecipeError
from tests.passes._graphs import mla_layer


class CountAddsPass(KimiPass):
    name = "count_adds"
    version = 1

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        for n in model.graph:
            if n.op_type == "Add":
                stats.add("adds")
            else:
                stats.refuse("not_add", node=n.name)
        return False


class SignaturePass(CountAddsPass):
    name = "signature"
    changes_signature = True

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        model.graph.inputs[0].metadata_props["kimi.touched"] = "1"
        return True


def test_result_carries_counts_and_near_misses_not_the_pass():
    m = mla_layer()
    p = CountAddsPass()
    r = p(m)
    assert isinstance(r, KimiPassResult) and r.modified is False
    assert r.counts.get("refused.not_add", 0) == len(r.near_misses) > 0
    assert not hasattr(p, "counts") and not hasattr(p, "near_misses")
    assert p(m).counts == r.counts  # a second run starts from zero


def test_run_caches_each_pass_and_keeps_the_first_signature_change(tmp_path):
    cache = CompileCache(root=tmp_path / "cache")
    passes = [CountAddsPass(), SignaturePass(), CountAddsPass()]
    first = pipeline.run({"decode": mla_layer()}, passes, cache=cache, keys={"decode": "k0"},
                         dump_dir=tmp_path / "dump")
    assert first.cache_hits == [False, False, False]
    assert [r.name for r in first.records] == ["count_adds", "signature", "count_adds"]
    assert first.records[0].near_misses == first.records[0].counts["refused.not_add"]
    assert "decode" in first.rebased  # the graph right after the declared signature change
    assert sorted(p.name for p in (tmp_path / "dump" / "decode").iterdir()) == [
        "00_count_adds.txt", "01_signature.txt", "02_count_adds.txt"]
    again = pipeline.run({"decode": mla_layer()}, passes, cache=cache, keys={"decode": "k0"})
    assert again.cache_hits == [True, True, True] and again.keys == first.keys
    assert [r.cached for r in again.records] == [True, True, True]
    assert again.graphs["decode"].graph.inputs[0].metadata_props.get("kimi.touched") == "1"


def test_check_runs_after_the_input_and_every_pass():
    seen = []

    def check(phase, model, after, rebase):
        seen.append((phase, after, rebase))
        return {"phase": phase, "after": after, "rel_err": 0.0}

    res = pipeline.run({"prefill": mla_layer()}, [CountAddsPass(), SignaturePass()], check=check)
    assert seen == [("prefill", "trace", False), ("prefill", "count_adds", False), ("prefill", "signature", True)]
    assert len(res.verify_log) == 3


def test_verifier_names_the_pass_that_breaks_a_graph():
    class BreakPass(CountAddsPass):
        name = "break"

        def run(self, model, stats):
            n = next(iter(model.graph))
            n.outputs[0].name = ""  # an unnamed output: the checker refuses the graph
            model.graph.append(ir.node("NoSuchOp", [n.outputs[0]], domain="kimi"))
            return True

    with pytest.raises(pipeline.VerifyError, match="after pass break"):
        pipeline.run({"decode": mla_layer()}, [BreakPass()])


def test_resolve_validates_names_and_options(tiny_build):
    recipe = tiny_build[0]
    with pytest.raises(RecipeError, match=r"passes\[0\]\.name: unknown pass 'fuse_everything'"):
        pipeline.resolve(dataclasses.replace(recipe, passes=(PassSpec(name="fuse_everything"),)))
    with pytest.raises(RecipeError, match=r"passes\[0\]\.options"):
        pipeline.resolve(dataclasses.replace(recipe, passes=(PassSpec(name="cleanup", options={"fold": 1}),)))
    names = [p.name for p in pipeline.resolve(recipe)]
    assert names == [s.name for s in recipe.passes if s.enabled]
    assert json.dumps([pipeline.options_dict(p) for p in pipeline.resolve(recipe)])  # cache keys are JSON-able
