"""Speculative decoding over a Session: a drafter proposes up to k tokens per sequence, one forward of the target
scores them all, the acceptance rule keeps a prefix, and the caches roll back to it. The output distribution is the
target model's: greedy output is plain greedy decoding's, sampled output follows the target's distribution exactly.

One step for sequence b (cache length c_b = tokens the KDA state has absorbed, u_b = tokens after it, the last of
which is the token emitted last; drafts d_1..d_n):

    feed  = tokens[c_b:] + [d_1..d_n]                the prefill graph at start = c_b (T = u_b + n >= 1, ragged)
    logits at the last n + 1 positions               -> targets for d_1..d_n and the bonus token
    accept a drafts (greedy: longest matching prefix; sampling: min(1, p/q), residual resample on reject)
    a == n:  the state is exact: c_b += u_b + n     (nothing to undo)
    a <  n:  KDA conv/recurrent state rows <- the checkpoint taken before the forward; MLA latent and index-K
             rows roll back by length (BlockAllocator.truncate frees blocks past c_b); the accepted tokens stay
             in tokens[c_b:] and are replayed at the head of the next step's feed

Replay is deferred into the next verification forward instead of a forward of its own: the recurrence absorbs the
accepted tokens exactly as the plain prefill graph would (same graph, same start, causal positions), and the cost of
a step stays one forward of a few more tokens. The feed is capped at 2 (k + 1) tokens: a sequence whose replay backlog
reaches it drafts nothing that step, which commits it. Rows with drafts take a checkpoint (a copy of their conv and
state rows) only when their state moved since the last one. A step where no row has drafts or backlog runs the
decode graph (T = 1), so speculation turned off costs nothing.

Per sequence, an `AdaptiveK` controller turns the draft length down (to 0: off, with 1-token probes on shared
batch steps, spaced further apart after each failed one) when the estimated per-token acceptance makes drafting
unprofitable under a cost model of the verify forward (`verify_cost`, `token_cost`, in decode steps, fitted on the
H200 by bench/speculative_gpu.py) and of the replay a rejection forces on the next step; the rows of a batch pool
their evidence (the others' acceptance sets each row's prior), and its batch gate drops drafts that do not pay for
the whole batch's forward.
docs/speculative.md has the design, the cache bytes per method and the measurements.

Drafters: `NgramDrafter` (prompt lookup: the latest earlier occurrence of the longest suffix n-gram of the
prompt and output so far, from an incremental index), `ModelDrafter` (any artifact with the same vocabulary, e.g. a
tiny one; its own cache rolls back the same way). Imports no torch: tensors are handled by duck typing (numpy arrays or torch tensors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

METHODS = ("ngram", "draft")


# ---- configuration ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """`generate(..., speculative=...)`: a dict of these fields, a `SpecConfig`, or the CLI string `ngram:K` /
    `draft:K:ARTIFACT`."""

    method: Any = "ngram"  # "ngram" | "draft" | a Drafter instance
    k: int = 4  # most draft tokens per step and sequence
    adaptive: bool = True  # per-sequence draft length from the measured acceptance (False: always k)
    max_ngram: int = 3  # ngram: longest suffix n-gram looked up
    min_ngram: int = 1  # ngram: shortest
    draft: Any = None  # draft: an artifact directory or a loaded Session
    verify_cost: float = 0.05  # a verification forward over a decode step, in decode steps, and each further
    token_cost: float = 0.04  # token of it (H200, kimi-k3.1-small, 1024 context: fits 0.014 / 0.045 at B=1,
    #                           0.061 / 0.022 at B=8; bench/results/speculative_gpu_2026-12-04.json)
    probe_every: int = 8  # a sequence turned off drafts 1 token after this many steps (doubling after each
    probe_max: int = 64  # failed probe, up to probe_max; all rows probe on the same steps of the batch)
    decay: float = 0.8  # per observation: weight kept by the acceptance estimate's history

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"speculative.k: expected an int >= 1, got {self.k!r}")
        if isinstance(self.method, str) and self.method not in METHODS:
            raise ValueError(f"speculative.method: expected one of {', '.join(METHODS)} or a Drafter, "
                             f"got {self.method!r}")
        if self.method == "draft" and self.draft is None:
            raise ValueError("speculative.draft: method 'draft' needs a draft artifact directory (or Session)")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"speculative.min_ngram/max_ngram: expected 1 <= min <= max, got {self.min_ngram}, "
                             f"{self.max_ngram}")
        if not 0 <= self.decay < 1 or not 1 <= self.probe_every <= self.probe_max:
            raise ValueError(f"speculative.decay in [0, 1) and 1 <= probe_every <= probe_max expected, got "
                             f"{self.decay}, {self.probe_every}, {self.probe_max}")


def parse_spec(spec: Any) -> SpecConfig:
    """`SpecConfig` from a dict, a SpecConfig, or `METHOD:K` (`ngram:4`, `draft:4:path/to/artifact`)."""
    if isinstance(spec, SpecConfig):
        return spec
    if isinstance(spec, str):
        method, _, rest = spec.partition(":")
        k_text, _, draft = rest.partition(":")
        try:
            k = int(k_text) if k_text else SpecConfig.k
        except ValueError:
            raise ValueError(f"speculative: expected METHOD:K (ngram:4 or draft:4:ARTIFACT), got {spec!r}") from None
        return SpecConfig(method=method, k=k, draft=draft or None)
    if isinstance(spec, dict):
        known = {f.name for f in dataclasses.fields(SpecConfig)}
        bad = sorted(set(spec) - known)
        if bad:
            raise ValueError(f"speculative: unknown keys {bad}; expected some of {sorted(known)}")
        return SpecConfig(**spec)
    raise ValueError(f"speculative: expected a dict, a SpecConfig or 'METHOD:K', got {type(spec).__name__}")


# ---- acceptance -------------------------------------------------------------------------------------------------

def probabilities(logits: np.ndarray, temperature: float, top_k: int | None) -> np.ndarray:
    """Sampling distribution over the last axis: softmax(logits / temperature) over the top_k largest (float64)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    if top_k:
        cut = np.partition(z, -top_k, axis=-1)[..., -top_k, None]
        z = np.where(z < cut, -np.inf, z)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> tuple[int, list[int]]:
    """targets[i] = argmax after draft i (len(drafts) + 1 of them) -> (accepted, emitted): the longest prefix of
    drafts equal to the targets, then the target after it (the bonus token)."""
    a = 0
    while a < len(drafts) and int(drafts[a]) == int(targets[a]):
        a += 1
    return a, [int(d) for d in drafts[:a]] + [int(targets[a])]


def accept_probability(p: np.ndarray, q: np.ndarray | None, d: int) -> float:
    """min(1, p(d) / q(d)); q None: the draft was certain (q(d) = 1)."""
    qd = 1.0 if q is None else float(q[d])
    return 1.0 if qd <= 0 else min(1.0, float(p[d]) / qd)


def residual(p: np.ndarray, q: np.ndarray | None, d: int) -> np.ndarray:
    """Distribution to resample from after rejecting d: max(p - q, 0), normalized (q None: a point mass at d)."""
    r = np.array(p, dtype=np.float64)
    if q is None:
        r[d] = 0.0
    else:
        r = np.maximum(r - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else np.asarray(p, dtype=np.float64)


def accept_sampling(p: np.ndarray, q: np.ndarray | None, drafts: Sequence[int],
                    rng: np.random.Generator) -> tuple[int, list[int]]:
    """Speculative sampling: p [n + 1, V] target distributions after each draft prefix, q [n, V] the drafter's
    (None: deterministic drafts) -> (accepted, emitted). Draft i is kept with probability min(1, p_i/q_i); the
    first rejected one is replaced by a sample of the normalized residual max(p_i - q_i, 0); when all are kept a
    bonus token is sampled from p_n. Each emitted token then follows p exactly."""
    for i, d in enumerate(drafts):
        qi = None if q is None else q[i]
        if rng.random() >= accept_probability(p[i], qi, int(d)):
            r = residual(p[i], qi, int(d))
            return i, [int(x) for x in drafts[:i]] + [int(rng.choice(len(r), p=r))]
    n = len(drafts)
    return n, [int(x) for x in drafts] + [int(rng.choice(p.shape[-1], p=p[n]))]


# ---- drafters ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sampling:
    temperature: float
    top_k: int | None
    rng: np.random.Generator


class Drafter:
    """Proposes draft tokens. `start` once per batch; `propose(contexts, ks)` -> (drafts, q): for sequence b at
    most ks[b] tokens following contexts[b] (prompt + output so far), and the distributions they were drawn from
    ([n_b, V], or None for deterministic drafts)."""

    def start(self, batch_size: int, capacity: int, sampling: Sampling) -> None:
        pass

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]
                ) -> tuple[list[list[int]], list[np.ndarray | None]]:
        raise NotImplementedError


def ngram_lookup(context: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (max_ngram down to min_ngram) of `context`; [] when none occurs."""
    ctx = np.asarray(context, dtype=np.int64)
    L = len(ctx)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:L - 1], n)  # starts 0..L-1-n: never the suffix
        hits = np.flatnonzero((windows == ctx[L - n:]).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n
            return ctx[i:i + k].tolist()
    return []


class NgramIndex:
    """Prompt lookup over a growing context in O(new tokens) per call: for each n in min_ngram..max_ngram, the
    latest start of every n-gram that has a token after it. `lookup` answers what `ngram_lookup` answers (a test
    holds them equal). An n-gram's key is its ids packed into one int (21 bits each: ids below 2^21; a context
    with a larger id switches the index to tuple keys); a long stretch of new tokens (the prompt) is keyed with
    numpy in one pass, where dict.update keeps the latest start of a repeated n-gram."""

    BITS = 21

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.ns = range(max_ngram, min_ngram - 1, -1)
        self.latest: dict[int, dict] = {n: {} for n in self.ns}
        self.done = {n: 0 for n in self.ns}  # n-grams starting before this index are in latest[n]
        self.packed = True  # int keys (False: tuple keys)
        self.checked = 0  # context[:checked] holds no id past 2^21

    def _key(self, gram) -> Any:
        if not self.packed:
            return tuple(gram)
        key = 0
        for t in gram:
            key = (key << self.BITS) | t
        return key

    def _index(self, context: Sequence[int], n: int, lo: int, hi: int) -> None:
        """n-grams starting at lo..hi-1 into latest[n]."""
        table = self.latest[n]
        if self.packed and hi - lo > 32 and n * self.BITS < 64:
            a = np.asarray(context[lo:hi + n - 1], dtype=np.int64)
            keys = a[:hi - lo].copy()
            for j in range(1, n):
                keys = (keys << self.BITS) | a[j:j + hi - lo]
            table.update(zip(keys.tolist(), range(lo, hi)))
        else:
            key = self._key
            for i in range(lo, hi):
                table[key(context[i:i + n])] = i

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        L = len(context)
        if self.packed:
            lo, self.checked = self.checked, L
            if lo < L and (max(context[lo:]) >> self.BITS or min(context[lo:]) < 0):  # ids past 2^21: tuples
                self.packed = False
                self.latest = {n: {} for n in self.ns}
                self.done = {n: 0 for n in self.ns}
        key = self._key
        for n in self.ns:
            hi = L - n  # starts 0..L-1-n: the suffix itself never counts
            if hi < 1:
                continue
            lo = self.done[n]
            if lo < hi:
                if hi - lo == 1:
                    self.latest[n][key(context[lo:hi + n - 1])] = lo
                else:
                    self._index(context, n, lo, hi)
                self.done[n] = hi
            i = self.latest[n].get(key(context[hi:]))
            if i is not None:
                return [int(t) for t in context[i + n:i + n + k]]
        return []


class NgramDrafter(Drafter):
    """Prompt lookup (`ngram_lookup`), with one incremental `NgramIndex` per sequence: contexts only grow within a
    batch (prompt + emitted tokens), so each step indexes only the tokens emitted since the last."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.index: list[NgramIndex] = []

    def start(self, batch_size, capacity, sampling):
        self.index = [NgramIndex(self.max_ngram, self.min_ngram) for _ in range(batch_size)]

    def propose(self, contexts, ks):
        if len(self.index) != len(contexts):
            self.start(len(contexts), 0, None)
        return ([ix.lookup(c, k) if k > 0 else [] for ix, c, k in zip(self.index, contexts, ks)],
                [None] * len(ks))


class ModelDrafter(Drafter):
    """Drafts with another compiled model (same vocabulary) decoding autoregressively from its own cache. Its
    KDA state is checkpointed after absorbing the real tokens and restored before the next proposal (its drafts
    pollute it); its MLA rows roll back by length."""

    def __init__(self, session):
        self.session = session

    def start(self, batch_size, capacity, sampling):
        self.sampling = sampling
        self.cache = self.session.new_cache(batch_size, capacity)
        self.rollback = RowCheckpoint(self.session, self.cache)
        self.polluted = np.zeros(batch_size, dtype=bool)

    def _pick(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        s = self.sampling
        if s.temperature <= 0:
            return logits.argmax(-1), None
        q = probabilities(logits, s.temperature, s.top_k)
        return np.array([s.rng.choice(q.shape[-1], p=row) for row in q]), q

    def propose(self, contexts, ks):
        B = len(contexts)
        drafts: list[list[int]] = [[] for _ in range(B)]
        qs: list[list] = [[] for _ in range(B)]
        rows = [b for b in range(B) if ks[b] > 0]
        if not rows:
            return drafts, [None] * B
        cache, seq = self.cache, self.cache.seq_lens
        undo = [b for b in rows if self.polluted[b]]
        self.rollback.restore(undo)
        for b in undo:
            cache.blocks.truncate(b, int(self.rollback.length[b]))
        self.polluted[undo] = False
        feeds = [list(contexts[b][int(seq[b]):]) if b in rows else [] for b in range(B)]
        last = absorb(self.session, cache, feeds)  # the state is now exact at every drafting row
        self.rollback.take(rows)
        tok, q = self._pick(last)
        for i in range(max(ks)):
            for b in rows:
                if ks[b] > i:
                    drafts[b].append(int(tok[b]))
                    if q is not None:
                        qs[b].append(q[b])
            if i == max(ks) - 1:
                break
            grow = [b for b in rows if ks[b] > i + 1]
            ids = np.array([[drafts[b][-1] if b in grow else 0] for b in range(B)], dtype=np.int64)
            lens = np.array([int(b in grow) for b in range(B)], dtype=np.int64)
            logits = self.session._run("decode", ids, lens, cache)[:, 0]
            self.polluted[grow] = True
            tok, q = self._pick(self.session._host(logits))
        return drafts, [np.stack(x) if x else None for x in qs]


def drafter_for(cfg: SpecConfig, target) -> Drafter:
    """The drafter `cfg` names; a draft artifact given as a path is opened the way `target` (a Session) was."""
    vocab_size = target.vocab_size
    if isinstance(cfg.method, Drafter):
        return cfg.method
    if cfg.method == "ngram":
        return NgramDrafter(cfg.max_ngram, cfg.min_ngram)
    sess = cfg.draft
    if isinstance(sess, (str, Path)):
        sess = target.open_artifact(sess)
    if sess.vocab_size != vocab_size:
        raise ValueError(f"speculative.draft: the draft model's vocabulary ({sess.vocab_size}) differs from the "
                         f"target's ({vocab_size}); a draft model must share the tokenizer")
    return ModelDrafter(sess)


# ---- rollback state ---------------------------------------------------------------------------------------------

def _clone(t):
    return t.clone() if hasattr(t, "clone") else t.copy()


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted rows as [lo, hi) runs of consecutive rows: one slice copy each (no index tensor, no host sync)."""
    out: list[tuple[int, int]] = []
    for r in sorted({int(x) for x in rows}):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


class RowCheckpoint:
    """A copy of the per-sequence caches (KDA conv windows and recurrent states: every cache whose first dim is the
    batch) for chosen rows, with the cache length it was taken at. Paged pools are not copied: they roll back by
    length."""

    def __init__(self, session, cache):
        self.cache = cache
        self.names = [c["name"] for c in session.runtime["caches"] if c["shape"][0] == "batch"]
        self.saved: dict = {}
        self.length = np.zeros(cache.rows, dtype=np.int64)
        self.copies = 0  # rows copied (taken or restored), for the statistics

    def take(self, rows: Sequence[int]) -> None:
        if not rows:
            return
        idx = list(rows)
        for n in self.names:
            t = self.cache.tensors[n]
            if n not in self.saved:
                self.saved[n] = _clone(t)
            else:
                for lo, hi in _runs(idx):
                    self.saved[n][lo:hi] = t[lo:hi]
        self.length[idx] = self.cache.seq_lens[idx]
        self.copies += len(idx)

    def restore(self, rows: Sequence[int]) -> None:
        """State rows back to the checkpoint, in place (a captured graph keeps reading the same tensors)."""
        if not rows:
            return
        idx = list(rows)
        for n in self.names:
            for lo, hi in _runs(idx):
                self.cache.tensors[n][lo:hi] = self.saved[n][lo:hi]
        self.copies += len(idx)


def _t_bucket(T: int, static: bool) -> int:
    """Padded step length: at least 2 (the prefill graph's minimum); a power of two with static shapes (one
    captured program per (batch bucket, length bucket))."""
    T = max(T, 2)
    return 1 << (T - 1).bit_length() if static else T


def forward(session, cache, feeds: Sequence[Sequence[int]]):
    """One forward: feeds[b] (any length >= 0) appended to sequence b at its cache length. The decode graph when
    no row has more than one token, else the prefill graph. -> (logits [B, T, V] where the executor keeps them,
    phase)."""
    lens = np.array([len(f) for f in feeds], dtype=np.int64)
    if lens.max() <= 1:
        phase, T = "decode", 1
    else:
        phase, T = "prefill", _t_bucket(int(lens.max()), getattr(session.backend, "static_shapes", False))
    ids = np.zeros((len(feeds), T), dtype=np.int64)
    for b, f in enumerate(feeds):
        ids[b, :len(f)] = f
    return session._run(phase, ids, lens, cache), phase


def absorb(session, cache, feeds: Sequence[Sequence[int]]) -> np.ndarray:
    """Append feeds in chunks of at most export.prefill_chunk tokens; -> host logits [B, V] after each row's last
    fed token (zeros for rows fed nothing)."""
    chunk = int(session.runtime.get("prefill_chunk") or max(len(f) for f in feeds) or 1)
    last = np.zeros((len(feeds), session.vocab_size), dtype=np.float32)
    for off in range(0, max(len(f) for f in feeds), chunk):
        part = [list(f[off:off + chunk]) for f in feeds]
        logits, _ = forward(session, cache, part)
        host = session._host(logits)
        for b, p in enumerate(part):
            if p and off + len(p) == len(feeds[b]):
                last[b] = host[b, len(p) - 1]
    return last


# ---- the per-sequence draft length ------------------------------------------------------------------------------

def expected_tokens(alpha: float, k: int) -> float:
    """Tokens emitted by a step of k drafts each accepted with probability alpha (i.i.d.): 1 + alpha + ... +
    alpha^k."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


class AdaptiveK:
    """Per sequence: the draft length k_b in 0..k that maximizes expected tokens per unit of step cost, where a
    decode step costs 1 and a verification step with k drafts 1 + verify_cost + k token_cost, plus the replay it
    may force: a rejected draft leaves two tokens to absorb, so the next step runs the prefill graph (cost(1) - 1
    more) with probability 1 - alpha^k. The acceptance alpha is estimated from the drafts seen (accepted ones are
    successes, a rejection one failure; exponentially forgotten) over a prior of weight 4 whose mean is the
    batch's: 3:1 for a sequence alone, and the other sequences' pooled evidence (over the same 3:1) in a batch,
    since they share the drafter and the model. k_b = 0 turns drafting off; a sequence that is off drafts 1 token
    (a probe) on the batch steps that are multiples of its probe gap (probe_every, doubled after each failed probe
    up to probe_max, reset by an accepted one): the gaps are powers of two times probe_every, so the probes of a
    batch share steps.

    `gate` decides for the batch: one forward serves every row, so drafts are kept only when the batch's expected
    tokens per unit of cost (the forced replay included) beat plain decoding's (B tokens per decode step); a
    probe step or a replay backlog (the prefill graph runs anyway) keeps them.

    State: `success` / `failure` per row (prior included, as at B = 1), `evidence_s` / `evidence_f` (the row's
    own observations, for the other rows' prior) and `prior` (the prior's remaining weight, 1 at the start)."""

    def __init__(self, cfg: SpecConfig, rows: int):
        self.cfg = cfg
        self.success = np.full(rows, 3.0)
        self.failure = np.ones(rows)
        self.evidence_s = np.zeros(rows)
        self.evidence_f = np.zeros(rows)
        self.prior = np.ones(rows)
        self.gap = np.full(rows, cfg.probe_every, dtype=np.int64)
        self.probing = np.zeros(rows, dtype=bool)
        self.step = 0
        self._alpha: list[float] = []  # per row, the estimate (refresh: at each tick and after an update)
        self._stale = True
        self._k: dict[float, int] = {}  # best_k by alpha (exact: the same alpha gives the same k)

    def refresh(self) -> None:
        """This step's acceptance estimates of every row (once a step: they change only by update)."""
        self._stale = False
        s, f = self.success, self.failure
        if len(s) == 1:
            self._alpha = (s / (s + f)).tolist()
            return
        es, ef = self.evidence_s, self.evidence_f
        mean = (3.0 + es.sum() - es) / (4.0 + (es + ef).sum() - es - ef)  # the others' pooled evidence over 3:1
        self._alpha = np.clip((s + 4.0 * self.prior * (mean - 0.75)) / (s + f), 0.0, 1.0).tolist()

    def alpha(self, b: int) -> float:
        if self._stale:
            self.refresh()
        return self._alpha[b]

    def cost(self, k: int) -> float:
        """A step with k draft tokens (the longest row's), in decode steps."""
        c = self.cfg
        return 1 + (c.verify_cost + k * c.token_cost if k else 0)

    def replay(self, p_reject: float) -> float:
        """Expected cost of the replay a step forces on the next one: cost(1) - 1 when a draft is rejected."""
        return (self.cost(1) - 1) * p_reject

    def best_k(self, alpha: float) -> int:
        k = self._k.get(alpha)
        if k is None:
            if len(self._k) > 4096:
                self._k.clear()
            k = self._k[alpha] = max(range(self.cfg.k + 1), key=lambda k: (
                expected_tokens(alpha, k) / (self.cost(k) + self.replay(1 - alpha ** k if k else 0.0)), -k))
        return k

    def current(self, b: int) -> int:
        """The draft length the estimate gives now (k when not adaptive)."""
        return self.best_k(self.alpha(b)) if self.cfg.adaptive else self.cfg.k

    def tick(self) -> None:
        """A new batch step."""
        self.step += 1
        self.probing[:] = False
        if self._stale:
            self.refresh()

    def choose(self, b: int) -> int:
        """The draft length of sequence b at this step (a probe: 1 on the steps its gap divides)."""
        k = self.current(b)
        if not self.cfg.adaptive or k:
            return k
        self.probing[b] = self.step % int(self.gap[b]) == 0
        return int(self.probing[b])

    def gate(self, ks: list[int], rows: Sequence[int], forced: bool) -> list[int]:
        """This step's draft lengths for the batch (rows: the sequences still decoding). forced: a replay backlog
        runs the prefill graph anyway. Drafts that do not pay for the batch's verification forward and the replay
        it may force are dropped; rows on their probe step then still probe (1 token), so the estimates keep
        moving."""
        if not self.cfg.adaptive or forced or self.probing.any() or not any(ks):
            return ks
        spec, p_all = 0.0, 1.0
        for b in rows:
            a = self.alpha(b)
            spec += expected_tokens(a, ks[b])
            p_all *= a ** ks[b]
        if spec / (self.cost(max(ks)) + self.replay(1 - p_all)) > len(rows):
            return ks
        out = [0] * len(ks)
        for b in rows:
            self.probing[b] = ks[b] > 0 and self.step % int(self.gap[b]) == 0
            out[b] = int(self.probing[b])
        return out

    def update(self, b: int, proposed: int, accepted: int) -> None:
        if proposed:
            d = self.cfg.decay ** proposed
            rejected = accepted < proposed
            self.success[b] = d * self.success[b] + accepted
            self.failure[b] = d * self.failure[b] + rejected
            self.evidence_s[b] = d * self.evidence_s[b] + accepted
            self.evidence_f[b] = d * self.evidence_f[b] + rejected
            self.prior[b] *= d
            self._stale = True
            if self.probing[b]:
                self.gap[b] = self.cfg.probe_every if accepted else min(2 * self.gap[b], self.cfg.probe_max)


# ---- the generation loop ----------------------------------------------------------------------------------------

class Generation(list):
    """generate()'s token lists, with `stats`, per request: proposed / accepted draft tokens and their ratio
    (acceptance), tokens emitted, steps (forwards after the prompt's), spec_steps (those with drafts),
    tokens_per_step (tokens after the first per step: 1.0 is plain decoding), rollbacks, replayed (tokens fed again
    after a rollback), k_mean / k_final (draft length chosen), off_steps (steps with drafting off); and `batch`:
    method, k, adaptive, forwards per phase, checkpoint_rows (state rows copied)."""

    stats: list[dict]
    batch: dict


class SpeculativeBatch:
    """The speculative state of one batch over a target Session: its cache, each sequence's tokens, the state
    checkpoint, the drafter and the controller. `step()` runs one draft-verify-accept round; `flush()` absorbs
    every pending token (the state then equals plain decoding's after the same tokens)."""

    def __init__(self, session, prompts: list[list[int]], max_new_tokens: int, cfg: SpecConfig, *,
                 temperature: float = 0.0, top_k: int | None = None, rng: np.random.Generator | None = None,
                 stop_at_eos: bool = True):
        self.s, self.cfg = session, cfg
        self.B, self.max_new = len(prompts), max_new_tokens
        self.sampling = Sampling(temperature, top_k, rng or np.random.default_rng())
        self.stop_at_eos = stop_at_eos
        self.max_feed = 2 * (cfg.k + 1)
        need = max(len(p) for p in prompts) + max_new_tokens
        self.cache = session.new_cache(self.B, need)
        self.ckpt = RowCheckpoint(session, self.cache)
        self.fresh = np.zeros(self.B, dtype=bool)  # checkpoint row == state row (state did not move since)
        self.forced = False  # this step runs the prefill graph anyway (a row has a replay backlog)
        self.tokens = [list(p) for p in prompts]
        self.out: list[list[int]] = [[] for _ in prompts]
        self.done = np.zeros(self.B, dtype=bool)
        self.ctl = AdaptiveK(cfg, self.B)
        self.drafter = drafter_for(cfg, session)
        self.drafter.start(self.B, need, self.sampling)
        self.forwards = {"prefill": 0, "decode": 0}
        keys = ("proposed", "accepted", "steps", "spec_steps", "rollbacks", "replayed", "off_steps", "k_sum")
        self.st = [dict.fromkeys(keys, 0) for _ in prompts]
        self.done[:] = max_new_tokens == 0
        if max_new_tokens > 0:
            last = session.prefill_last(prompts, self.cache)
            first = session._pick(last, temperature, top_k, self.sampling.rng)
            for b in range(self.B):
                self._emit(b, [int(first[b])])

    def _emit(self, b: int, toks: list[int]) -> None:
        for t in toks:
            if self.done[b]:
                return
            self.tokens[b].append(t)
            self.out[b].append(t)
            if len(self.out[b]) >= self.max_new or (
                    self.stop_at_eos and self.s.eos_token_id is not None and t == self.s.eos_token_id):
                self.done[b] = True

    def _draft_lengths(self) -> list[int]:
        seq = self.cache.seq_lens.tolist()
        self.ctl.tick()
        ks = [0] * self.B
        live = self.live = [b for b in range(self.B) if not self.done[b]]
        pending = [len(self.tokens[b]) - seq[b] for b in range(self.B)]
        for b in live:
            k = self.ctl.choose(b)
            if k:
                ks[b] = max(0, min(k, self.max_new - len(self.out[b]) - 1, self.max_feed - pending[b]))
        # a replay backlog (more than the last emitted token to absorb) runs the prefill graph whatever is drafted
        self.forced = any(pending[b] > 1 for b in live)
        ks = self.ctl.gate(ks, live, forced=self.forced)
        for b in live:
            st = self.st[b]
            st["off_steps"] += ks[b] == 0
            st["k_sum"] += ks[b]
        return ks

    def step(self) -> None:
        seq = self.cache.seq_lens.tolist()
        ks = self._draft_lengths()
        live = self.live
        if any(ks):
            drafts, qs = self.drafter.propose(self.tokens, ks)
            drafts = [list(d[:k]) for d, k in zip(drafts, ks)]
            if any(len(d) < k for d, k in zip(drafts, ks)):  # the drafter found fewer: gate again on what it gave
                kept = self.ctl.gate([len(d) for d in drafts], live, forced=self.forced)
                drafts = [d[:n] for d, n in zip(drafts, kept)]
        else:
            drafts, qs = [[]] * self.B, [None] * self.B
        feeds = [[] if self.done[b] else self.tokens[b][seq[b]:] + drafts[b] for b in range(self.B)]
        drafting = [b for b in range(self.B) if drafts[b]]
        if drafting:
            self.ckpt.take([b for b in drafting if not self.fresh[b]])
            self.fresh[drafting] = True
        logits, phase = forward(self.s, self.cache, feeds)
        self.forwards[phase] += 1
        greedy = self.sampling.temperature <= 0
        picks = self.s._host(logits.argmax(-1)).tolist() if greedy else None
        if greedy and phase == "decode":  # one token per live row, nothing drafted: plain decoding
            for b in live:
                self.st[b]["steps"] += 1
                self._emit(b, [int(picks[b][0])])
            self.fresh[live] = False
            return
        host = None if greedy else self.s._host(logits)
        undo = []
        for b in live:
            n, u = len(drafts[b]), len(feeds[b]) - len(drafts[b])
            if greedy:
                a, emitted = accept_greedy(picks[b][u - 1:u + n], drafts[b])
            else:
                p = probabilities(host[b, u - 1:u + n], self.sampling.temperature, self.sampling.top_k)
                q = qs[b][:n] if qs[b] is not None else None
                a, emitted = accept_sampling(p, q, drafts[b], self.sampling.rng)
            st = self.st[b]
            st["steps"] += 1
            st["replayed"] += u - 1
            if n:
                st["spec_steps"] += 1
                st["proposed"] += n
                st["accepted"] += a
                self.ctl.update(b, n, a)
            if a < n:  # drafts past a are in the state: back to the checkpoint, replay the accepted next step
                undo.append(b)
                st["rollbacks"] += 1
                self.cache.blocks.truncate(b, seq[b])
            else:
                self.fresh[b] = False
            self._emit(b, emitted)
        self.ckpt.restore(undo)

    def flush(self) -> None:
        """Absorb every token not yet in the caches (the last emitted ones and any replay backlog)."""
        seq = self.cache.seq_lens
        absorb(self.s, self.cache, [self.tokens[b][int(seq[b]):] for b in range(self.B)])
        self.fresh[:] = False

    def run(self) -> Generation:
        while not self.done.all():
            self.step()
        return self.result()

    def result(self) -> Generation:
        out = Generation(self.out)
        out.stats = []
        for b, st in enumerate(self.st):
            steps, after_first = st["steps"], max(len(self.out[b]) - 1, 0)
            out.stats.append({
                "proposed": st["proposed"], "accepted": st["accepted"],
                "acceptance": round(st["accepted"] / st["proposed"], 4) if st["proposed"] else None,
                "tokens": len(self.out[b]), "steps": steps, "spec_steps": st["spec_steps"],
                "tokens_per_step": round(after_first / steps, 4) if steps else None,
                "rollbacks": st["rollbacks"], "replayed": st["replayed"],
                "k_mean": round(st["k_sum"] / steps, 3) if steps else None,
                "k_final": self.ctl.current(b), "off_steps": st["off_steps"],
            })
        method = self.cfg.method if isinstance(self.cfg.method, str) else type(self.cfg.method).__name__
        out.batch = {"method": method, "k": self.cfg.k, "adaptive": self.cfg.adaptive,
                     "forwards": dict(self.forwards), "checkpoint_rows": self.ckpt.copies}
        return out


def generate(session, prompts: list[list[int]], max_new_tokens: int, speculative: Any, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int | None = None, stop_at_eos: bool = True) -> Generation:
    """Session.generate with speculative decoding (the session has checked the prompts and the limits)."""
    cfg = parse_spec(speculative)
    return SpeculativeBatch(session, prompts, max_new_tokens, cfg, temperature=temperature, top_k=top_k,
                            rng=np.random.default_rng(seed), stop_at_eos=stop_at_eos).run()


# ---- cache bytes per method -------------------------------------------------------------------------------------

def rollback_bytes(cfg, k: int, block_size: int = 64) -> dict[str, int]:
    """Extra cache bytes per sequence that speculation with k draft tokens needs, from a model config
    (kimi_compile.config.KimiConfig), with the graphs' cache layouts (trace_spec.cache_specs: fp32 KDA states):

    checkpoint_replay  this module: one copy of every KDA conv window and recurrent state (independent of k), plus
                       the replay backlog's token ids (at most 2 (k + 1) int64)
    per_slot           one state slot per draft position (vLLM's spec_state_indices): k more recurrent states per KDA
                       layer, and conv windows k rows longer (W - 1 + k)
    paged_rows         both: the MLA latent and index-K rows the k drafts occupy until they are accepted or
                       truncated (what a block holds is rounded up by the allocator; this counts rows)"""
    from kimi_compile.trace_spec import cache_specs

    state = conv_row = paged = 0
    for s in cache_specs(cfg, block_size):
        per = math.prod(s.shape[1:]) * np.dtype(s.dtype).itemsize
        if s.kind == "state":
            state += per
        elif s.kind == "conv":
            conv_row += per // s.shape[1]
        else:
            paged += per // block_size
    W1 = cfg.short_conv_kernel_size - 1
    return {"checkpoint_replay": state + W1 * conv_row + 2 * (k + 1) * 8,
            "per_slot": k * (state + conv_row),
            "paged_rows": k * paged}
