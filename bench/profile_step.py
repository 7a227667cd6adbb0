"""Where one decode step of a built artifact spends its GPU time: torch.profiler over a few eager-program steps at a
batch and context (caches filled as in bench/e2e_gpu.py), top kernels and top graph nodes by CUDA time; writes JSON.

    python bench/profile_step.py ARTIFACT --batch 32 --context 32768 --out $OUT/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_gpu import fill_caches, meta  # noqa: E402

from kimi_compile.runtime import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sess = load(a.artifact)
    sess.backend.graphs = False
    cache = sess.new_cache(a.batch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    fill_caches(sess, cache, a.context, gen)
    tok = [5] * a.batch
    for _ in range(2):
        tok = sess._decode(tok, cache).argmax(-1).tolist()
    prog = sess.backend.program("decode")
    spec = next(iter(prog._specs.values()))
    per_node = collections.Counter()
    torch.cuda.synchronize()
    # per node: CUDA events around each step of the specialized program (inputs from a real step's feeds)
    feeds = {}
    orig = spec.run

    def capture_feeds(f):
        feeds.update(f)
        return orig(f)
    spec.run = capture_feeds
    sess._decode(tok, cache)
    spec.run = orig
    env = spec._env(feeds)
    for _ in range(a.steps):
        for s in spec.steps:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            outs = s.fn(spec._args(s, env), s.attrs)
            e1.record()
            for o, t in zip(s.outputs, outs):
                env[o] = t
            torch.cuda.synchronize()
            per_node[f"{s.op} [{s.impl}]"] += e0.elapsed_time(e1) * 1e3 / a.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            sess._decode(tok, cache)
        torch.cuda.synchronize()
    kern = sorted(((e.key, getattr(e, "device_time_total", 0) / a.steps) for e in prof.key_averages()), key=lambda kv: -kv[1])[:25]
    out = {**meta(), "batch": a.batch, "context": a.context,
           "per_op_us": dict(sorted(per_node.items(), key=lambda kv: -kv[1])[:30]),
           "top_kernels_us": dict(kern),
           "histogram": sess.manifest["graphs"]["decode"]["op_histogram"],
           "plan": spec.plan.summary() if spec.plan else None}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("per_op_us", "histogram", "plan")}, indent=0)[:6000])


if __name__ == "__main__":
    main()
