"""Speculative decoding (kimi_compile/runtime/speculative.py): greedy output equal to plain greedy on both tiny
presets and both executors, forced all-accept / all-reject drafters, the KDA state after rollback and replay equal to
plain decoding's, speculative sampling's output distribution equal to the target's (with a mutated rule that fails),
the adaptive draft length, the draft-model drafter, the CLI flag and the cache bytes per method."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from kimi_compile.runtime import speculative as sp
from tests.runtime.conftest import PROMPTS

N = 64
PRESETS = ("kimi-k3-tiny", "kimi-k3.1-tiny")


class Scripted(sp.Drafter):
    """Drafts the known plain-greedy continuation, corrupted where `corrupt(b, step, k)` says (a draft index, or
    None): row 0 is never corrupted (accepts all), row 1 rejects at a position cycling through 0..k, row 2 rejects
    the first draft every third step: the rows accept different numbers of tokens."""

    def __init__(self, want, vocab: int, corrupt=None, prompts=PROMPTS):
        self.want, self.vocab, self.step, self.prompts = want, vocab, 0, prompts
        self.corrupt = corrupt or (lambda b, n, k: None if b == 0 else n % (k + 1) if b == 1 else
                                   (0 if n % 3 == 0 else None))

    def propose(self, contexts, ks):
        self.step += 1
        out = []
        for b, (c, k) in enumerate(zip(contexts, ks)):
            i = len(c) - len(self.prompts[b])
            d = list(self.want[b][i:i + k])
            j = self.corrupt(b, self.step, k)
            if j is not None and j < len(d):
                d[j] = (d[j] + 1) % self.vocab
            out.append(d)
        return out, [None] * len(ks)


def _accept_all(want, vocab):
    return Scripted(want, vocab, lambda b, n, k: None)


def _reject_all(want, vocab):
    return Scripted(want, vocab, lambda b, n, k: 0)


def _generate(sess, drafter, k, n=N, adaptive=False, **kw):
    return sess.generate(PROMPTS, n, stop_at_eos=False, speculative={"method": drafter, "k": k,
                                                                      "adaptive": adaptive}, **kw)


# ---- greedy: identical to plain greedy --------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("backend", ["onnxruntime", "cuda"])
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_speculative_equals_plain_greedy_ragged(preset, backend, k, runtime_session, plain_greedy):
    sess = runtime_session(preset, backend)
    want = plain_greedy(preset, backend)
    got = _generate(sess, Scripted(want, sess.vocab_size), k)
    assert got == want
    acc = [s["acceptance"] for s in got.stats]
    assert acc[0] == 1.0 and 0 < acc[1] < 1 and 0 < acc[2] < 1 and acc[1] != acc[2], acc
    assert got.stats[0]["rollbacks"] == 0 and got.stats[1]["rollbacks"] > 0 and got.stats[2]["rollbacks"] > 0
    assert got.stats[0]["tokens_per_step"] > got.stats[1]["tokens_per_step"] > 1.0
    assert got.batch["forwards"]["prefill"] < N - 1  # fewer forwards than plain decoding's 63


@pytest.mark.parametrize("preset", PRESETS)
def test_ngram_default_through_generate_equals_plain(preset, runtime_session, plain_greedy):
    """The default drafter, through Session.generate's hook, as a dict and as the CLI string."""
    sess = runtime_session(preset, "onnxruntime")
    want = plain_greedy(preset, "onnxruntime")
    for spec in ({"method": "ngram", "k": 4}, "ngram:2"):
        got = sess.generate(PROMPTS, N, stop_at_eos=False, speculative=spec)
        assert got == want
        assert len(got.stats) == len(PROMPTS) and all(s["tokens"] == N for s in got.stats)
        assert got.batch["method"] == "ngram"


def test_ngram_accepts_on_a_repeating_continuation():
    """Prompt lookup proposes what followed the latest earlier occurrence of the longest suffix n-gram."""
    assert sp.ngram_lookup([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert sp.ngram_lookup([7, 8, 9, 7, 5, 7], 2) == [5, 7]  # "7" last followed by 5 (latest occurrence)
    assert sp.ngram_lookup([1, 2, 3], 4) == []
    assert sp.ngram_lookup([5, 5], 3) == [5]
    assert sp.ngram_lookup([1, 2, 9, 1, 2], 2, max_ngram=2, min_ngram=2) == [9, 1]
    assert sp.ngram_lookup([1, 2, 3, 9, 2, 3, 9, 4, 3], 2, max_ngram=3) == [9, 4]


def test_incremental_ngram_index_equals_the_lookup():
    """NgramIndex (what NgramDrafter runs: O(new tokens) a step) answers what ngram_lookup answers, on contexts
    that grow by one to five tokens at a time over a small vocabulary (many repeats) and a large one (few)."""
    rng = np.random.default_rng(0)
    for vocab, (lo, hi) in ((4, (2, 3)), (50, (1, 2)), (1000, (1, 3)), (8, (1, 5)), (-8, (1, 3))):
        big, vocab = vocab < 0, abs(vocab)  # big: ids past 2^21 from step 100 on (the index turns to tuple keys)
        ctx = rng.integers(0, vocab, 200 if vocab == 50 else 3).tolist()  # 200: the prompt's one-pass keys
        ix = sp.NgramIndex(max_ngram=hi, min_ngram=lo)
        hits = 0
        for i in range(300):
            k = int(rng.integers(1, 6))
            if big and i >= 100:
                ctx.append((1 << 22) + int(rng.integers(0, 2)))
            want = sp.ngram_lookup(ctx, k, hi, lo)
            assert ix.lookup(ctx, k) == want, (vocab, len(ctx))
            hits += bool(want)
            ctx += rng.integers(0, vocab, int(rng.integers(1, 6))).tolist()
        assert hits > 0
        assert ix.packed != big  # int keys; tuple keys once an id does not fit 21 bits


# ---- forced drafters ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_forced_all_accept_and_all_reject(preset, runtime_session, plain_greedy):
    sess = runtime_session(preset, "onnxruntime")
    want = plain_greedy(preset, "onnxruntime")
    k = 3
    got = _generate(sess, _accept_all(want, sess.vocab_size), k)
    assert got == want
    for s in got.stats:
        assert s["acceptance"] == 1.0 and s["rollbacks"] == 0 and s["steps"] == math.ceil((N - 1) / (k + 1))
    got = _generate(sess, _reject_all(want, sess.vocab_size), k)
    assert got == want
    for s in got.stats:
        assert s["acceptance"] == 0.0 and s["tokens_per_step"] == 1.0 and s["rollbacks"] == s["spec_steps"] > 0


def test_adaptive_k_turns_drafting_off_and_back_on(runtime_session, plain_greedy):
    """All-reject: the estimate falls, drafting stops (decode-graph steps, 1-token probes); all-accept keeps k."""
    sess = runtime_session("kimi-k3.1-tiny", "onnxruntime")
    want = plain_greedy("kimi-k3.1-tiny", "onnxruntime")
    got = _generate(sess, _reject_all(want, sess.vocab_size), 4, adaptive=True)
    assert got == want
    for s in got.stats:
        assert s["k_final"] == 0 and s["off_steps"] > N // 2 and s["proposed"] < 2 * N // 4
        assert s["spec_steps"] > 2  # the first steps and the probes
    assert got.batch["forwards"]["decode"] > N // 2
    got = _generate(sess, _accept_all(want, sess.vocab_size), 4, adaptive=True)
    assert got == want and all(s["k_final"] == 4 and s["off_steps"] == 0 for s in got.stats)


def test_adaptive_k_follows_the_cost_model():
    cfg = sp.SpecConfig(k=7, verify_cost=0.15, token_cost=0.05)
    ctl = sp.AdaptiveK(cfg, 1)
    assert ctl.best_k(0.0) == 0 and ctl.best_k(0.1) == 0  # drafting costs more than it gives
    assert 0 < ctl.best_k(0.5) < ctl.best_k(0.8) <= ctl.best_k(0.99) == 7
    assert sp.expected_tokens(0.5, 3) == 1 + 0.5 + 0.25 + 0.125 and sp.expected_tokens(1.0, 3) == 4



def test_probes_back_off_and_share_batch_steps():
    """A sequence that is off probes on the steps its gap divides; each failed probe doubles the gap up to
    probe_max, an accepted one resets it; every off row of a batch probes on the same steps."""
    cfg = sp.SpecConfig(k=4, probe_every=4, probe_max=16)
    ctl = sp.AdaptiveK(cfg, 3)
    ctl.success[:] = 0.0  # every row off (alpha 0)
    probes = {b: [] for b in range(3)}
    for step in range(1, 65):
        ctl.tick()
        for b in range(3):
            if ctl.choose(b):
                probes[b].append(step)
                ctl.update(b, 1, int(b == 2 and step == 8))  # row 2's probe at step 8 is accepted
                ctl.success[b] = 0.0
    assert probes[0] == probes[1] == [4, 8, 16, 32, 48, 64]  # gaps 4, 8, 16, 16 (max), ...
    assert probes[2] == [4, 8, 12, 16, 32, 48, 64]  # reset to 4 after the accepted probe at 8
    assert set(probes[2]) >= set(probes[0])  # no probe of a row with a larger gap falls on a step of its own


def test_batch_gate_keeps_drafts_only_when_they_pay_for_the_batch_forward():
    """One forward serves the batch: with 8 rows, one row's drafts at alpha 0.5 do not pay for the verification
    forward of all 8, at alpha 0.5 on every row they do; a replay backlog (forced) keeps them; a row on its probe
    step still probes (1 token) when the rest is dropped."""
    cfg = sp.SpecConfig(k=4, verify_cost=0.15, token_cost=0.05, probe_every=2)
    ctl = sp.AdaptiveK(cfg, 8)
    ctl.success[:], ctl.failure[:] = 1.0, 1.0  # alpha 0.5: best_k > 0 alone
    k = ctl.best_k(0.5)
    assert k > 0
    ctl.tick()
    rows = list(range(8))
    one = [k] + [0] * 7
    assert ctl.gate(one, rows, forced=False) == [0] * 8  # step 1: not a probe step
    assert ctl.gate(one, rows, forced=True) == one
    assert ctl.gate([k] * 8, rows, forced=False) == [k] * 8
    ctl.tick()
    assert ctl.gate(one, rows, forced=False) == [1] + [0] * 7  # step 2: row 0's probe
    solo = sp.AdaptiveK(cfg, 1)
    solo.success[:], solo.failure[:] = 1.0, 1.0
    solo.tick()
    assert solo.gate([k], [0], forced=False) == [k]  # B = 1: the gate agrees with best_k

PROMPTS8 = [PROMPTS[b % 3][b // 3:] + [b + 20] for b in range(8)]


def test_batch_of_8_all_reject_runs_few_verification_forwards(runtime_session):
    """B = 8, every draft rejected, adaptive k = 4, 64 tokens: the rows' pooled evidence turns the whole batch off
    after its first verification forward and the replay it forces (then shared probes), where per-row estimates
    over a fixed 3:1 prior kept every row drafting for four steps (12 verification forwards before, 9 now).
    All-accept keeps k = 4 on every row, and in a mixed batch the two accepting rows keep drafting while the six
    rejecting ones turn off. The output is plain greedy's throughout."""
    sess = runtime_session("kimi-k3.1-tiny", "onnxruntime")
    want = sess.generate(PROMPTS8, N, stop_at_eos=False)
    spec = {"k": 4, "adaptive": True}

    def run(corrupt):
        got = sess.generate(PROMPTS8, N, stop_at_eos=False, speculative={
            **spec, "method": Scripted(want, sess.vocab_size, corrupt, prompts=PROMPTS8)})
        assert got == want
        return got

    got = run(lambda b, n, k: 0)
    assert got.batch["forwards"]["prefill"] <= 9, got.batch
    assert all(s["acceptance"] == 0.0 and s["k_final"] == 0 for s in got.stats)
    got = run(lambda b, n, k: None)
    assert all(s["k_final"] == 4 and s["off_steps"] == 0 and s["acceptance"] == 1.0 for s in got.stats)
    assert got.batch["forwards"] == {"prefill": math.ceil((N - 1) / 5), "decode": 0}
    got = run(lambda b, n, k: None if b < 2 else 0)
    assert [s["k_final"] for s in got.stats] == [4, 4] + [0] * 6
    assert all(s["tokens_per_step"] > 2.5 for s in got.stats[:2]), got.stats[:2]


# ---- rollback and replay: the KDA state -------------------------------------------------------------------------

def _plain_states(sess, want, n):
    cache = sess.new_cache(len(PROMPTS), max(len(p) for p in PROMPTS) + n + 1)
    sess.prefill_last(PROMPTS, cache)
    for i in range(n):
        sess._run("decode", np.array([[w[i]] for w in want], dtype=np.int64), np.ones(len(PROMPTS), np.int64),
                  cache)
    return cache


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("preset,backend", [("kimi-k3-tiny", "onnxruntime"), ("kimi-k3.1-tiny", "onnxruntime"),
                                            ("kimi-k3.1-tiny", "cuda")])
def test_kda_state_after_replay_equals_plain_decoding(preset, backend, runtime_session, plain_greedy, monkeypatch):
    """Mixed and all-reject drafters, then flush: every conv window and recurrent state equals plain decoding's
    after the same tokens (fp32: the prefill and decode graphs sum in different orders, ~1e-6). Without the
    restore the states are far off: the test bites."""
    n = 24
    sess = runtime_session(preset, backend)
    want = plain_greedy(preset, backend, n)
    ref = _plain_states(sess, want, n)
    names = [c for c in ref.names if c.startswith(("conv.", "state."))]
    assert names

    def run(drafter):
        batch = sp.SpeculativeBatch(sess, PROMPTS, n, sp.SpecConfig(method=drafter, k=3, adaptive=False),
                                    stop_at_eos=False)
        got = batch.run()
        batch.flush()
        assert (batch.cache.seq_lens[:len(PROMPTS)] == ref.seq_lens[:len(PROMPTS)]).all()
        return got, {c: sess._host(batch.cache.tensors[c])[:len(PROMPTS)] for c in names}

    want_states = {c: sess._host(ref.tensors[c])[:len(PROMPTS)] for c in names}
    for drafter in (Scripted(want, sess.vocab_size), _reject_all(want, sess.vocab_size)):
        got, states = run(drafter)
        assert got == want and sum(s["rollbacks"] for s in got.stats) > 0
        for c in names:
            assert _rel(states[c], want_states[c]) < 1e-5, c
    monkeypatch.setattr(sp.RowCheckpoint, "restore", lambda self, rows: None)
    _, states = run(_reject_all(want, sess.vocab_size))
    assert max(_rel(states[c], want_states[c]) for c in names) > 1e-2


# ---- speculative sampling -------------------------------------------------------------------------------------

def _chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty: within 1e-3 of exact for df >= 10)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _spec_sampling_chi2(samples: int = 6000, V: int = 5, k: int = 3, seed: int = 0) -> float:
    """A synthetic target (first-order Markov chain P over V tokens) and a different draft chain Q; speculative
    sampling from token 0 until two tokens are out; chi-square p-value of those pairs against P's joint."""
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.ones(V) * 0.7, size=V)
    Q = rng.dirichlet(np.ones(V) * 0.7, size=V)
    counts = np.zeros((V, V))
    for _ in range(samples):
        seq = [0]
        while len(seq) < 3:
            drafts, prev = [], seq[-1]
            for _ in range(k):
                prev = int(rng.choice(V, p=Q[prev]))
                drafts.append(prev)
            ctx = [seq[-1], *drafts]
            _, emitted = sp.accept_sampling(P[ctx], Q[ctx[:-1]], drafts, rng)
            seq += emitted
        counts[seq[1], seq[2]] += 1
    expect = samples * P[0][:, None] * P
    stat = float(((counts - expect) ** 2 / expect).sum())
    return _chi2_pvalue(stat, V * V - 1)


def test_speculative_sampling_matches_the_target_distribution(monkeypatch):
    assert _spec_sampling_chi2() > 1e-3
    # mutated acceptance rule: accept with min(1, p) (ignoring q): the pairs no longer follow P
    monkeypatch.setattr(sp, "accept_probability", lambda p, q, d: min(1.0, float(p[d])))
    assert _spec_sampling_chi2() < 1e-6
    monkeypatch.undo()
    # mutated resampling: after a rejection, sample the target instead of the normalized residual
    monkeypatch.setattr(sp, "residual", lambda p, q, d: np.asarray(p, dtype=np.float64))
    assert _spec_sampling_chi2() < 1e-6


def test_point_mass_drafts_keep_the_target_distribution():
    """Prompt-lookup drafts are certain (q = one-hot): accept with p(d), resample from p without d."""
    rng = np.random.default_rng(1)
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    counts = np.zeros(3)
    for _ in range(30000):
        counts[sp.accept_sampling(p, None, [1], rng)[1][0]] += 1
    stat = float(((counts - 30000 * p[0]) ** 2 / (30000 * p[0])).sum())
    assert stat < 13.8  # chi-square, 2 degrees of freedom, p = 1e-3


def test_sampled_speculative_generation_is_seeded(runtime_session):
    sess = runtime_session("kimi-k3.1-tiny", "onnxruntime")
    kw = dict(temperature=0.8, top_k=50, seed=5, stop_at_eos=False, speculative={"method": "ngram", "k": 3})
    a, b = sess.generate(PROMPTS, 24, **kw), sess.generate(PROMPTS, 24, **kw)
    assert a == b and all(len(x) == 24 for x in a)
    assert a != sess.generate(PROMPTS, 24, **{**kw, "seed": 6})


# ---- the draft-model drafter ------------------------------------------------------------------------------------

def test_draft_artifact_drafter(runtime_session, runtime_artifact, plain_greedy):
    """kimi-k3.1-tiny drafted by kimi-k3-tiny (same vocabulary): plain greedy output; drafted by itself: every draft
    accepted (its own greedy continuation), with its drafter cache rolled back between steps."""
    sess = runtime_session("kimi-k3.1-tiny", "onnxruntime")
    want = plain_greedy("kimi-k3.1-tiny", "onnxruntime")
    got = sess.generate(PROMPTS, N, stop_at_eos=False, speculative={
        "method": "draft", "k": 3, "adaptive": False, "draft": str(runtime_artifact("kimi-k3-tiny", "onnxruntime"))})
    assert got == want and got.batch["method"] == "draft"
    got = sess.generate(PROMPTS, N, stop_at_eos=False, speculative={
        "method": "draft", "k": 3, "adaptive": False, "draft": runtime_session("kimi-k3.1-tiny", "onnxruntime")})
    assert got == want and all(s["acceptance"] == 1.0 for s in got.stats)
    sampled = sess.generate(PROMPTS, 16, temperature=1.0, seed=2, stop_at_eos=False,
                            speculative={"method": "draft", "k": 3, "draft": sess})
    assert all(len(x) == 16 for x in sampled) and all(s["proposed"] > 0 for s in sampled.stats)


# ---- configuration, CLI, layering ---------------------------------------------------------------------------------

def test_spec_strings_and_refusals():
    assert sp.parse_spec("ngram:4") == sp.SpecConfig(method="ngram", k=4)
    assert sp.parse_spec("draft:2:/a/b") == sp.SpecConfig(method="draft", k=2, draft="/a/b")
    assert sp.parse_spec({"k": 5}).k == 5
    for bad, match in [("eagle:3", "method"), ("ngram:x", "METHOD:K"), ({"k": 0}, "k"), ({"kk": 1}, "unknown"),
                       ("draft:3", "draft artifact"), ({"min_ngram": 3, "max_ngram": 2}, "min_ngram")]:
        with pytest.raises(ValueError, match=match):
            sp.parse_spec(bad)


def test_cli_run_speculative_json(runtime_artifact, plain_greedy):
    from click.testing import CliRunner

    from kimi_compile.cli import main

    art = runtime_artifact("kimi-k3.1-tiny", "onnxruntime")
    arg = ";".join(",".join(map(str, p)) for p in PROMPTS)
    r = CliRunner().invoke(main, ["run", str(art), "--prompt-ids", arg, "--max-new-tokens", "16", "--speculative",
                                  "ngram:3", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["tokens"] == [w[:16] for w in plain_greedy("kimi-k3.1-tiny", "onnxruntime")]
    assert [s["tokens"] for s in doc["speculative"]["requests"]] == [16, 16, 16]
    assert doc["speculative"]["method"] == "ngram" and doc["speculative"]["k"] == 3
    r = CliRunner().invoke(main, ["run", str(art), "--prompt-ids", "1,2", "--speculative", "ngram:0"])
    assert r.exit_code != 0 and "speculative.k" in r.output


def test_runtime_speculative_imports_no_torch():
    code = "import sys, kimi_compile.runtime.speculative; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


# ---- cache bytes per method -------------------------------------------------------------------------------------

def test_rollback_bytes_at_the_released_k31_size():
    """From the config: 69 KDA layers (96 heads x 128 x 128 fp32 state, conv window 3 rows of 3 x 12288 fp32),
    24 MLA layers (576 latent + 128 index-K values per token, fp32 as the graphs declare them)."""
    from kimi_compile.config import preset

    cfg = preset("kimi-k3.1-pro")
    kda = len(cfg.kda_layer_ids)
    state = cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4
    conv_row = 3 * cfg.kda_proj_dim * 4
    paged = len(cfg.mla_layer_ids) * (cfg.latent_dim + cfg.index_head_dim) * 4
    assert (kda, state, conv_row, paged) == (69, 6291456, 147456, 67584)
    for k in range(1, 8):
        b = sp.rollback_bytes(cfg, k)
        assert b["checkpoint_replay"] == kda * (state + 3 * conv_row) + 16 * (k + 1)
        assert b["per_slot"] == k * kda * (state + conv_row)
        assert b["paged_rows"] == k * paged
    assert sp.rollback_bytes(cfg, 1)["per_slot"] < sp.rollback_bytes(cfg, 1)["checkpoint_replay"] \
        < sp.rollback_bytes(cfg, 2)["per_slot"]


@pytest.mark.parametrize("name", ["kimi-k3.1-tiny", "kimi-k3-tiny"])
def test_copy_model_continues_its_orbits(name):
    """bench/copy_model.py (the model the GPU bench measures prompt lookup on): the reference model's greedy next
    token is the map's, on an orbit prompt and on uniform ids, and prompt lookup on an orbit proposes exactly that."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from copy_model import copy_model, orbit

    model, nxt = copy_model(name, period=24, seed=3)
    assert sorted(nxt.tolist()) == list(range(len(nxt)))  # a permutation: every id has one successor
    o = orbit(nxt, 11, 90)
    assert o[24] == o[0] and len(set(o[:24])) == 24
    rand = np.random.default_rng(0).integers(3, len(nxt), 40).tolist()
    with torch.no_grad():
        for ids in (o, rand):
            out = model(torch.tensor([ids]))
            pred = (out.logits if hasattr(out, "logits") else out)[0].argmax(-1).tolist()
            assert pred == [int(nxt[t]) for t in ids]
    assert sp.ngram_lookup(o[:60], 4) == o[60:64]
