"""Context parallelism end to end on CPU (issue 18): the tiny presets' prefill split over cp ranks by the
partition_cp pass (cp2 zigzag and cp4 zigzag on kimi-k3.1-tiny, cp2 contiguous on kimi-k3-tiny, tp2 x cp2 on
kimi-k3.1-tiny), every rank in its own process (torch.multiprocessing, gloo), against the single-rank artifact of
the same recipe in fp32. Prompts of 13, 7 and 3 tokens (none divides into 2P chunks; the
3-token prompt leaves chunks empty), then a second ragged prefill continuing them (start > 0), then 32 greedy
decode steps: logits within 1e-5 relative (each prompt's last token after each prefill, and every decode step),
the same tokens, and after each
prefill every rank's caches equal the single-rank caches (KDA conv windows and states, the MLA latent and index-K
pools: the same slots written, values to fp32 rounding).

The artifacts build from the suite's warm compile cache: the trace and the fusion passes hit, only the partition and
the cuda backend stages run here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.ranks import run_ranks

PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144], [5, 6, 7, 8, 9, 10, 12], [3, 4, 5]]
MORE = [[17, 18, 19, 20, 21], [23], [25, 26, 27, 28, 29, 30]]  # a second prefill from start > 0
STEPS = 32
CASES = {  # name -> (preset, cp, layout)
    "k31-cp2": ("kimi-k3.1-tiny", 2, "zigzag"),
    "k3-cp2-contiguous": ("kimi-k3-tiny", 2, "contiguous"),
    "k31-cp4": ("kimi-k3.1-tiny", 4, "zigzag"),
    "k31-tp2-cp2": ("kimi-k3.1-tiny", 2, "zigzag"),  # tp 2 x cp 2: four ranks
}
TP = {"k31-tp2-cp2": 2}


def _recipe(preset: str, cp: int, layout: str, tp: int = 1):
    from kimi_compile.recipe import load_recipe, with_overrides

    base = load_recipe(os.path.join(ROOT, "recipes", "kimi-k3.1-tiny-cp2.yaml"))
    return with_overrides(base, name=f"{preset}-tp{tp}-cp{cp}-{layout}", preset=preset, max_batch=4, cp=cp,
                          cp_layout=layout, tp=tp)


def _world(case: str) -> int:
    return CASES[case][1] * TP.get(case, 1)


@pytest.fixture(scope="module")
def artifacts(warm_cache, tmp_path_factory):
    """{case or "<preset>-cp1": artifact dir}."""
    from kimi_compile.build import build

    cache = warm_cache[0]
    out = tmp_path_factory.mktemp("cp")
    arts = {}
    for preset in sorted({p for p, _, _ in CASES.values()}):
        arts[f"{preset}-cp1"] = build(_recipe(preset, 1, "zigzag"), out / f"{preset}-cp1", cache=cache).artifact
    for name, (preset, cp, layout) in CASES.items():
        arts[name] = build(_recipe(preset, cp, layout, TP.get(name, 1)), out / name, cache=cache).artifact
    return arts


def _caches(sess, cache) -> dict:
    return {n: np.array(sess._host(cache.tensors[n]), dtype=np.float64) for n in cache.names}


def _generate(sess) -> dict:
    """Last-token logits of two ragged prefills (a context-parallel prefill produces no others) and of STEPS greedy
    decode steps, the tokens, the caches after each prefill."""
    from kimi_compile.runtime.session import RuntimeInputError

    cache = sess.new_cache(len(PROMPTS))
    if int(sess.manifest.get("parallel", {}).get("cp", 1)) > 1:  # every token's logits: refused before any work
        with pytest.raises(RuntimeInputError, match="only each prompt's last-token logits"):
            sess.prefill(PROMPTS, cache)
        assert cache.seq_lens.tolist() == [0] * len(PROMPTS)
    last = np.asarray(sess._host(sess.prefill_last(PROMPTS, cache)))
    caches1 = _caches(sess, cache)
    last2 = np.asarray(sess._host(sess.prefill_last(MORE, cache)))
    caches2 = _caches(sess, cache)
    nxt = last2.argmax(-1)
    tokens, steps = [nxt.tolist()], []
    for _ in range(STEPS - 1):
        step = sess.decode(nxt.tolist(), cache)
        steps.append(step)
        nxt = step.argmax(-1)
        tokens.append(nxt.tolist())
    return {"last": np.concatenate([last, last2]), "decode": np.stack(steps),
            "tokens": np.array(tokens), "caches1": caches1, "caches2": caches2}


def _worker(rank: int, world: int, port: int, paths: list[str], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    from kimi_compile.runtime import load

    try:
        queue.put((rank, {p: _generate(load(p)) for p in paths}, None))
    except Exception as e:  # noqa: BLE001 - reported to the test with the rank
        import traceback

        queue.put((rank, None, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _run_ranks(world: int, paths: list[str]) -> dict:
    """{rank: {artifact: results}} from `world` spawned processes."""
    return run_ranks(_worker, world, paths)


@pytest.fixture(scope="module")
def runs(artifacts):
    """{case: {rank: results}}, {preset: single-rank results}."""
    from kimi_compile.runtime import load

    ref = {preset: _generate(load(artifacts[f"{preset}-cp1"])) for preset in {p for p, _, _ in CASES.values()}}
    out = {}
    for world in sorted({_world(n) for n in CASES}):
        names = [n for n in CASES if _world(n) == world]
        res = _run_ranks(world, [str(artifacts[n]) for n in names])
        out.update({n: {r: res[r][str(artifacts[n])] for r in res} for n in names})
    return out, ref


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("case", list(CASES))
def test_cp_prefill_matches_the_single_rank_artifact(case, runs):
    out, ref = runs
    want = ref[CASES[case][0]]
    for rank, got in out[case].items():
        assert _rel(got["last"], want["last"]) < 1e-5, rank
        assert _rel(got["decode"], want["decode"]) < 1e-5, rank
        np.testing.assert_array_equal(got["tokens"], want["tokens"])  # 32 greedy tokens per sequence
        assert got["tokens"].shape == (STEPS, len(PROMPTS))


def _whole(case: str, ranks: dict) -> dict:
    """{cp index: caches} with tensor-parallel shards put back together: KDA states concatenated over their heads,
    conv windows per q / k / v part (partition_tp splits each by heads); pools are whole on every rank."""
    tp = TP.get(case, 1)
    out = {}
    for c in range(CASES[case][1]):
        group = [ranks[c * tp + t] for t in range(tp)]
        res = dict(group[0])
        for when in ("caches1", "caches2"):
            res[when] = {}
            for name, v in group[0][when].items():
                parts = [g[when][name] for g in group]
                if tp > 1 and name.startswith("state."):
                    v = np.concatenate(parts, axis=1)
                elif tp > 1 and name.startswith("conv."):
                    v = np.concatenate([np.concatenate([np.split(p_, 3, axis=2)[i] for p_ in parts], axis=2)
                                        for i in range(3)], axis=2)
                res[when][name] = v
        out[c] = res
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_caches_after_cp_prefill_equal_single_rank(case, runs):
    out, ref = runs
    want = ref[CASES[case][0]]
    for rank, got in _whole(case, out[case]).items():
        for when in ("caches1", "caches2"):
            assert set(got[when]) == set(want[when])
            for name, w in want[when].items():
                g = got[when][name]
                assert g.shape == w.shape, (rank, when, name)
                if name.startswith(("kv.", "index_k.")):  # paged pools: the same slots written
                    g, w = g[1:], w[1:]  # block 0 is the null block: padding rows write there (kimi_compile/paged.py)
                    written = np.abs(w).reshape(w.shape[0] * w.shape[1], -1).sum(-1) > 0
                    assert written.sum() == sum(len(p) for p in PROMPTS) + (when == "caches2") * sum(map(len, MORE))
                    np.testing.assert_array_equal(np.abs(g).reshape(written.shape[0], -1).sum(-1) > 0, written)
                assert _rel(g, w) < 1e-5, (rank, when, name, _rel(g, w))


def test_rank_graphs(artifacts):
    """What the pass put in the graphs: per KDA layer the three segment ops and two gathers, one gather of the
    lengths, of the slots, of each pool write's values and of the logits; decode graphs unchanged."""
    m = json.loads((artifacts["k31-cp2"] / "manifest.json").read_text())
    assert m["parallel"]["cp"] == 2 and m["parallel"]["cp_layout"] == "zigzag" and m["parallel"]["world"] == 2
    pre = m["graphs"]["prefill.rank1"]["op_histogram"]
    assert "kimi.KDA" not in pre
    assert pre["kimi.KDAConvTail"] == pre["kimi.KDASegmentMap"] == pre["kimi.KDASegmentReplay"] == 4
    assert pre["kimi.PagedWrite"] == 4
    assert pre["kimi.AllGather"] == 2 * 4 + 1 + 1 + 4 + 1  # KDA tails+maps, lengths, slots, pool values, logits
    # the LM head runs on each piece's last token only: its input gathered per row, [rows, 1, vocab] gathered out
    outs = {o["name"]: o for o in m["graphs"]["prefill.rank1"]["outputs"]}
    assert "logits" not in outs and outs["logits_last"]["shape"][1:] == [1, m["model_config"]["vocab_size"]]
    log = {r["name"]: r for r in m["pass_log"] if r.get("phase") == "prefill.rank1"}
    assert log["partition_cp"]["counts"]["last_token_head"] == 1
    assert pre["GatherElements"] >= 1
    assert m["graphs"]["decode.rank1"]["op_histogram"] == m["graphs"]["decode.rank0"]["op_histogram"]
    assert "kimi.AllGather" not in m["graphs"]["decode.rank0"]["op_histogram"]
    bal = {(r["tokens"], r["cp"], r["layout"]): r["max_over_mean"] for r in m["parallel"]["cp_balance"]["rows"]}
    assert bal[(1048576, 2, "zigzag")] < 1.01 < bal[(1048576, 2, "contiguous")]  # this model's balance, in the report
    assert "Context-parallel balance" in (artifacts["k31-cp2"] / "report.html").read_text()


def test_recipe_refusals_name_the_key():
    from kimi_compile.recipe import RecipeError, with_overrides

    base = _recipe("kimi-k3.1-tiny", 2, "zigzag")
    with pytest.raises(RecipeError, match=r"parallel.sequence_parallel: sequence_parallel with cp=2 is not"):
        with_overrides(base, tp=2, sequence_parallel=True)
    with pytest.raises(RecipeError, match=r"parallel.cp: cp=2 runs its ranks over torch.distributed on backend cuda"):
        with_overrides(base, backend="onnxruntime", target="cpu")
    with pytest.raises(RecipeError, match=r"parallel.cp_layout"):
        with_overrides(base, cp_layout="ring")


def test_onnxruntime_refuses_a_cp_artifact(artifacts):
    from kimi_compile.artifact import load_manifest
    from kimi_compile.backends import onnxruntime

    art = artifacts["k31-cp2"]
    with pytest.raises(ValueError, match=r"partitioned for 2 ranks"):
        onnxruntime.load(art, load_manifest(art))
