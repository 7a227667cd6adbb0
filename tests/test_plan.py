"""`kimi_compile.plan` (issue 17, deliverable 5): the plan of kimi-k3.1-tiny at tp2 + ep2, derived from a probe with
other widths, equals what the real partitioned graphs of kimi-k3.1-tiny hold: weight elements per rank exactly,
cache elements per token and per sequence, and the collectives (count and bytes per token) of the decode and prefill
graphs. The real graphs come from the build's own trace stage and pass pipeline (what `kimi-compile build` writes
into the artifact); the compile cache is the suite's when it is warm (CI), else $KIMI_COMPILE_CACHE."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def cache(request):
    from kimi_compile.cache import CompileCache

    if os.environ.get("KIMI_COMPILE_CACHE"):
        return CompileCache(read_only=False)
    return request.getfixturevalue("tiny_build")[2]


@pytest.fixture(scope="module")
def recipe():
    from kimi_compile.recipe import load_recipe

    return load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-tp2.yaml"))


@pytest.fixture(scope="module")
def real(recipe, cache):
    """Rank 0's decode and prefill graphs of kimi-k3.1-tiny-tp2 as the build makes them."""
    from kimi_compile import pipeline
    from kimi_compile.build import ModelSource, _trace_stage, trace_options
    from kimi_compile.trace_spec import PHASES

    with tempfile.TemporaryDirectory() as work:
        src = ModelSource(recipe, Path(work), lambda _m: None)
        graphs, key, _ = _trace_stage(src, trace_options(recipe), cache, lambda _m: None)
        res = pipeline.run(graphs, pipeline.resolve(recipe), cache=cache, keys=dict.fromkeys(PHASES, key))
    return {ph: res.graphs[f"{ph}.rank0"] for ph in PHASES}


@pytest.fixture(scope="module")
def planned(recipe, cache):
    from kimi_compile import plan

    (lp,) = plan.plan(recipe, cache=cache)
    return lp


def test_layout_names_and_parsing():
    from kimi_compile.plan import Layout, PlanError

    assert Layout.parse("tp8+ep16") == Layout(8, 16, 1)
    assert Layout.parse("tp8xcp4") == Layout(8, 1, 4)
    assert Layout.parse("tp8+ep16").dp == 2 and Layout.parse("tp8+ep16").world == 16
    assert Layout.parse("tp8xcp4").world == 32 and Layout.parse("tp8xcp4").built.cp == 4
    assert not Layout.parse("tp8xcp4").built.sequence_parallel
    with pytest.raises(PlanError, match="ep=3 must divide tp=8"):
        Layout.parse("tp8+ep3")
    with pytest.raises(PlanError, match="multiple of tp"):
        Layout.parse("tp8+ep12")


def test_probe_keeps_the_layer_kinds():
    from kimi_compile.config import preset
    from kimi_compile.plan import Layout, probe_config, region_counts

    pro = preset("kimi-k3.1-pro")
    p = probe_config(pro, Layout(8, 16))
    assert p.num_hidden_layers == 4 and set(region_counts(p)) == set(region_counts(pro))
    assert all(region_counts(p)[k] > 0 for k, n in region_counts(pro).items() if n)
    assert p.num_attention_heads % 8 == 0 and p.num_experts % 8 == 0 and p.vocab_size % 8 == 0
    assert region_counts(pro) == {"embed": 1, "head": 1, "kda": 69, "mla": 0, "mla_indexer": 24, "dense": 1,
                                  "moe": 92}


def _region_elements(m) -> dict[str, int]:
    from kimi_compile.plan import _region_kinds

    regions, where = _region_kinds(m)
    out: dict[str, int] = {}
    seen = set()
    for n in m.graph:
        for v in n.inputs:
            if v is not None and v not in seen and v.is_initializer() and v.const_value is not None:
                seen.add(v)
                if v.dtype.is_floating_point():
                    kind = regions[where[n]][0]
                    out[kind] = out.get(kind, 0) + math.prod(int(d) for d in v.shape)
    return out


def test_weights_per_rank_equal_the_real_rank_graph(planned, real):
    init = real["decode"].graph.initializers.values()
    floats = sum(math.prod(int(d) for d in v.shape) for v in init if v.dtype.is_floating_point())
    assert _region_elements(real["decode"]) == planned.weight_regions
    assert planned.weight_elements == floats
    assert planned.weight_bytes("fp32") - planned.weight_other_bytes == \
        sum(v.const_value.nbytes for v in init if v.dtype.is_floating_point())
    # integer constants (shapes, slice bounds): the same up to constants the exporter shares when two of the tiny
    # model's widths happen to be equal (the probe's widths are all distinct)
    other = sum(v.const_value.nbytes for v in init if not v.dtype.is_floating_point())
    assert abs(planned.weight_other_bytes - other) <= 64


def test_caches_per_token_equal_the_real_rank_graph(planned, real):
    token, seq = {}, {}
    for v in real["decode"].graph.inputs:
        kind = v.name.split(".")[0]
        if kind in ("kv", "index_k"):
            token[kind] = token.get(kind, 0) + math.prod(int(d) for d in v.shape[2:])
        elif kind in ("conv", "state"):
            seq[kind] = seq.get(kind, 0) + math.prod(int(d) for d in v.shape[1:])
    assert planned.cache_token == token and planned.cache_sequence == seq


def test_collectives_equal_the_real_rank_graphs(planned, real):
    """Count and bytes per token of every collective; one whose tensor has no shape in the graph is counted as
    unknown on both sides (its bytes are not: the plan says so in its notes)."""
    for phase, table in (("decode", planned.decode), ("prefill", planned.prefill)):
        want: dict[str, dict] = {}
        for n in real[phase].graph:
            if n.domain == "kimi" and n.op_type in ("AllReduce", "AllGather", "ReduceScatter", "AllToAll"):
                v = n.inputs[0] if n.op_type == "ReduceScatter" else n.outputs[0]
                row = want.setdefault(n.op_type, {"count": 0, "bytes": 0})
                row["count"] += 1
                if v.shape is None:
                    row["unknown"] = row.get("unknown", 0) + 1
                    continue
                row["bytes"] += math.prod(d for d in v.shape if isinstance(d, int)) * v.dtype.itemsize
        assert {k: {f: r[f] for f in ("count", "bytes", "unknown") if f in r} for k, r in table.items()} == want, \
            phase
    unknown = sum(r.get("unknown", 0) for t in (planned.decode, planned.prefill) for r in t.values())
    assert (unknown > 0) == any("no shape" in note for note in planned.notes)


def test_plan_json_is_complete(planned):
    d = planned.to_dict()
    json.dumps(d)
    assert d["layout"]["world"] == 2 and d["weight_bytes"]["fp32"] > d["weight_bytes"]["bf16"]


def test_plan_text_table_and_json(recipe, cache, planned):
    """What `kimi-compile plan` prints: the table (one column per layout) or JSON; tp2+ep4 composes dp 2."""
    from kimi_compile.plan import plan_text

    path = os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-tp2.yaml")
    text = plan_text(path, ("tp2+ep2", "tp2+ep4", "tp2xcp2"), act_dtype="fp32", cache=cache)
    assert "| per rank | tp2+ep2 | tp2+ep4 | tp2xcp2 |" in text and "2 attention data-parallel groups" in text
    doc = json.loads(plan_text(path, ("tp2+ep2", "tp2+ep4"), as_json=True, act_dtype="fp32", cache=cache))
    same, dp = doc["plans"]
    assert same["weight_elements"] == planned.weight_elements
    assert dp["layout"]["world"] == 4 and dp["weight_elements"] < same["weight_elements"]
    assert dp["decode"]["AllToAll"]["count"] == 2 * 5  # dispatch and combine per MoE layer (5 in the tiny)
    (cp,) = json.loads(plan_text(path, ("tp2xcp2",), as_json=True, act_dtype="fp32", cache=cache))["plans"]
    assert cp["layout"]["world"] == 4 and cp["weight_elements"] == planned.weight_elements  # cp replicates weights
    assert cp["decode"] == planned.decode and "AllGather(cp)" in cp["prefill"]  # decode stays whole


def test_cp_layouts_add_the_balance_table():
    """With a cp layout the plan appends the context-parallel balance of the target model (issue 18): at
    kimi-k3.1-pro's size zigzag stays within 2% of the mean rank, contiguous approaches (2P-1)/P."""
    from kimi_compile.config import preset
    from kimi_compile.plan import cp_balance, render_balance

    rows = cp_balance(preset("kimi-k3.1-pro"), [4])
    text = render_balance(rows)
    line = next(ln for ln in text.splitlines() if ln.startswith("| 1024K | 4 |"))
    zig, cont = (float(x) for x in line.split("|")[3:5])
    assert zig < 1.02 and 1.6 < cont < 1.75  # (2P-1)/P = 1.75 at P = 4
    assert {r["cp"] for r in rows} == {2, 4, 8} and len(text.splitlines()) == 4 + 9


def test_a_layout_the_model_cannot_split_is_refused_by_name():
    from kimi_compile.plan import Layout, PlanError, plan
    from kimi_compile.recipe import load_recipe

    recipe = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-tp2.yaml"))
    with pytest.raises(PlanError, match=r"layout 'tp3' does not fit kimi-k3.1-tiny: tp=3 does not divide "
                                        r"num_attention_heads"):
        plan(recipe, [Layout.parse("tp3")])


def test_ttft_model(recipe, cache, planned):
    """The TTFT model (issue 18): the calibration reproduces its measurement; cp divides the token-wise work by cp
    and the attention nearly so (zigzag); the table and JSON carry every (layout, length); bad --ttft is refused."""
    import dataclasses

    from click.testing import CliRunner

    from kimi_compile.cli import main
    from kimi_compile.config import preset
    from kimi_compile.plan import (CALIBRATION, Layout, calibrated_throughput, plan_text, prefill_flops,
                                   single_rank_plan)

    small = preset(CALIBRATION["preset"])
    rate = calibrated_throughput()
    one = single_rank_plan(small)
    assert one.expert_elements > 0 and one.weight_regions["embed"] == small.vocab_size * small.hidden_size
    assert abs(sum(prefill_flops(one, small, CALIBRATION["tokens"]).values()) / rate - CALIBRATION["seconds"]) < 1e-9
    cfg = preset("kimi-k3.1-tiny")
    cp4 = dataclasses.replace(planned, layout=Layout(tp=planned.layout.tp, cp=4))
    f1, f4 = prefill_flops(planned, cfg, 4096), prefill_flops(cp4, cfg, 4096)
    assert f4["linear"] == f1["linear"] / 4 and f4["kda"] == f1["kda"] / 4
    assert f1["attention"] / 4 < f4["attention"] < f1["attention"] / 4 * 1.05
    path = os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-tp2.yaml")
    doc = json.loads(plan_text(path, ("tp2", "tp2xcp2"), as_json=True, cache=cache, ttft=(8192, 65536)))
    rows = doc["ttft"]["rows"]
    assert [(r["layout"], r["tokens"]) for r in rows] == [("tp2", 8192), ("tp2", 65536), ("tp2xcp2", 8192),
                                                         ("tp2xcp2", 65536)]
    for r in rows:
        assert r["ttft_s"] == r["compute_s"] + r["comm_s"] and r["ttft_at_peak_s"] < r["ttft_s"]
    assert rows[2]["ttft_s"] < rows[0]["ttft_s"] and rows[1]["ttft_s"] > 8 * rows[0]["ttft_s"]  # quadratic indexer
    text = plan_text(path, ("tp2",), cache=cache, ttft=(8192,))
    assert "Modelled TTFT of one prompt" in text and "| tp2 | 8K |" in text
    bad = CliRunner().invoke(main, ["plan", path, "--ttft", "8k"])
    assert bad.exit_code != 0 and "--ttft" in bad.output and "comma-separated token counts" in bad.output
