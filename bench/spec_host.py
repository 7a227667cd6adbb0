"""Host work of the speculative decoding loop per step, with the forward stubbed out (issue 19): how many
microseconds a step of `Session.generate(..., speculative=...)` spends outside the model, against plain greedy
decoding's, at B = 1 and B = 8; writes JSON.

    python bench/spec_host.py --out bench/results/spec_host_DATE.json [--batches 1,8] [--new-tokens 96]
        [--prompt-len 1024] [--k 4] [--reps 5]

The executor is the cuda backend's `Executor` (its `run`: numpy inputs to torch tensors, caches updated in place,
static shapes so T is padded to the power-of-two buckets and batches to their bucket) over a stub program that
returns instantly: caches with the names, count and batch rows of kimi-k3.1-small's (6 KDA conv + state, 2 MLA
latent + index-K pools) but a few values a row, so a checkpoint copy costs the dispatch of a copy, not its bytes;
logits that hold only their argmax (`StubLogits`), so no vocabulary-sized work runs on the CPU. What remains is
the runtime's own work: the drafter, the controller, the acceptance, checkpoint copies, block tables, feeds.

Scenarios (the stub's next token is a function of the fed token and its position):
  nothing   prompts and output are one increasing run of ids: prompt lookup never proposes (random weights on the
            "repetitive" set measured on the GPU)
  sparse    prompts and output uniform over the vocabulary (a hash of (token, position)): a lookup hits now and
            then (the last token occurred in the prompt), and is rejected (the "non-repetitive" set on the GPU)
  reject    prompts of ids in 0..255, output a hash of (token, position): every lookup hits, every draft is
            rejected, on every row at once
  accept    a repeated 24-token motif and a stub that continues it: every draft is accepted

host us/step = seconds from the end of the prompt's forward to generate's return, less the seconds inside the stub
program, over the forwards after the prompt's: the best of --reps runs (a shared machine's noise only adds), the
median beside it. One thread (torch.set_num_threads(1)): the Python
loop is what is measured; the numbers are a CPU's, a GPU host adds its launch costs to both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from run_info import run_info, write_result

from kimi_compile.backends.cuda import Executor, options
from kimi_compile.config import preset
from kimi_compile.runtime.session import Session
from kimi_compile.trace_spec import cache_specs

VOCAB = 32768  # kimi-k3.1-small's


class StubLogits:
    """[B, T, V] logits of which only the argmax exists ([B, T] token ids): indexing the leading dims and
    argmax(-1) are what greedy decoding asks of them."""

    def __init__(self, tok):
        self.tok = tok

    def __getitem__(self, i):
        return StubLogits(self.tok[i])

    def argmax(self, dim: int):
        assert dim == -1
        return self.tok


class StubProgram:
    """Returns at once: caches as given (updated in place, like the captured graphs), logits whose argmax is
    `rule(ids, positions)`; the seconds spent here are counted apart."""

    def __init__(self, ex):
        self.ex = ex

    def run(self, feeds, plan=True, graphs=False):
        t0 = time.perf_counter()
        ids = feeds["input_ids"]
        pos = feeds["start"][:, None] + torch.arange(ids.shape[1])
        out = {"logits": StubLogits(self.ex.rule(ids, pos)), **{n + ".out": feeds[n] for n in self.ex.cache_names}}
        t1 = time.perf_counter()
        self.ex.calls.append((t0, t1))
        return out


class StubExecutor(Executor):
    """The cuda Executor's run / host / zeros / batch buckets on CPU tensors, with static shapes (as with CUDA
    graphs on the GPU), over `StubProgram`."""

    def __init__(self, cache_names: list[str], rule):
        self.torch, self.manifest, self.rank = torch, {}, None
        self.options, self.device = options({}), torch.device("cpu")
        self.plan, self.graphs, self._static, self.streams = True, True, True, False
        self.cache_names, self.rule = cache_names, rule
        self.calls: list[tuple[float, float]] = []  # (entry, exit) of every stub call
        self._programs = {"decode": StubProgram(self), "prefill": StubProgram(self)}

    def stack(self, rows):
        return StubLogits(torch.stack([r.tok for r in rows]))


def stub_session(rule, max_seq_len: int) -> Session:
    """kimi-k3.1-small's cache names and kinds, each row 4 values (the copies' dispatch, not their bytes)."""
    caches = [{"name": c.name, "dtype": "float32",
               "shape": ["batch", 4] if c.shape[0] == "batch" else ["num_blocks", 64, 4]}
              for c in cache_specs(preset("kimi-k3.1-small"), 64)]
    rt = {"block_size": 64, "vocab_size": VOCAB, "eos_token_id": None, "max_seq_len": max_seq_len,
          "prefill_chunk": 4096, "caches": caches}
    return Session(StubExecutor([c["name"] for c in caches], rule), rt)


MOTIF = 24


def scenario(name: str, B: int, L: int, seed: int = 0):
    """(prompts, rule) of a scenario (module docstring)."""
    rng = np.random.default_rng(seed)
    if name == "nothing":
        return [list(range(3 + b, 3 + b + L)) for b in range(B)], lambda ids, pos: ids + 1
    if name == "sparse":
        return ([rng.integers(3, VOCAB, L).tolist() for _ in range(B)],
                lambda ids, pos: (ids * 7919 + pos * 104729 + 11) % VOCAB)
    if name == "reject":
        return ([rng.integers(0, 256, L).tolist() for _ in range(B)],
                lambda ids, pos: (ids * 7919 + pos * 104729 + 11) % 256)
    if name == "accept":
        motif = np.arange(100, 100 + MOTIF)
        nxt = torch.zeros(VOCAB, dtype=torch.int64)
        nxt[torch.from_numpy(motif)] = torch.from_numpy(np.roll(motif, -1))
        return [np.tile(motif, L // MOTIF + 1)[b:b + L].tolist() for b in range(B)], lambda ids, pos: nxt[ids]
    raise ValueError(f"scenario: expected nothing, sparse, reject or accept, got {name!r}")


def measure(name: str, B: int, L: int, new: int, reps: int, spec) -> dict:
    """Host microseconds per forward of the decode loop: from the end of the prompt's forward (the prompt fits one
    chunk) to generate's return, less the stub's own time; the best of reps runs after one warm-up, and the
    median."""
    prompts, rule = scenario(name, B, L)
    sess = stub_session(rule, L + new + 64)
    ex = sess.backend

    def one():
        ex.calls = []
        out = sess.generate(prompts, new, stop_at_eos=False, speculative=spec)
        end = time.perf_counter()
        loop = ex.calls[1:]
        return (end - ex.calls[0][1] - sum(t1 - t0 for t0, t1 in loop)) / len(loop), len(loop), out

    one()
    rows = [one() for _ in range(reps)]
    host = [h for h, _, _ in rows]
    steps, out = rows[-1][1], rows[-1][2]
    row = {"host_us_per_step": round(min(host) * 1e6, 1),
           "host_us_per_step_median": round(statistics.median(host) * 1e6, 1), "steps": steps,
           "host_us_per_token": round(min(host) * 1e6 * steps / (B * (new - 1)), 2)}
    if spec is not None:
        st = out.stats
        prop = sum(s["proposed"] for s in st)
        row.update(forwards=out.batch["forwards"], proposed=prop,
                   acceptance=round(sum(s["accepted"] for s in st) / prop, 3) if prop else None,
                   checkpoint_rows=out.batch["checkpoint_rows"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--scenarios", default="nothing,sparse,reject,accept")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    res = {**run_info("torch", "numpy"), "threads": 1, "new_tokens": a.new_tokens, "prompt_len": a.prompt_len,
           "rows": []}
    for B in [int(x) for x in a.batches.split(",")]:
        for name in a.scenarios.split(","):
            plain = measure(name, B, a.prompt_len, a.new_tokens, a.reps, None)
            spec = measure(name, B, a.prompt_len, a.new_tokens, a.reps, {"method": "ngram", "k": a.k})
            row = {"scenario": name, "batch": B, "plain": plain, "ngram_adaptive": spec,
                   "extra_us_per_step": round(spec["host_us_per_step"] - plain["host_us_per_step"], 1)}
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
    write_result(a.out, res)


if __name__ == "__main__":
    main()
