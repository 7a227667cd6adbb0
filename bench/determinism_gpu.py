"""Where graph replay and eager execution of one cuda-backend program part ways (issue 15's bit-identity test), node
by node, on one GPU; writes JSON.

    python bench/determinism_gpu.py ARTIFACT [ARTIFACT ...] --out $OUT/determinism_gpu.json

For each artifact: a short prompt batch is prefilled and decoded until the decode step has been captured; then, from
one snapshot of every input of that step (caches included, restored before each run), the step's program runs
  eager twice        every step's outputs copied after it ran (run-to-run determinism of the kernels);
  as a CUDA graph    the same steps captured with a copy of every output after each step (the program's own graph
                     plus copies), replayed once; and the program's own captured graph, its logits.
The first node (in program order) whose outputs differ between two runs is named with its op and kernel, with the
largest absolute difference; nodes are compared bit for bit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kimi_compile.runtime import load  # noqa: E402

PROMPTS = [[5, 17, 3], [9, 8, 7], [400, 1, 2]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t: bit for bit, NaN included (padding rows of a batch bucket may hold NaN in both runs)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _diff(a: dict, b: dict, spec) -> dict | None:
    for k, s in enumerate(spec.steps):
        for o in s.outputs:
            x, y = a.get(o), b.get(o)
            if x is None or y is None or not isinstance(x, torch.Tensor):
                continue
            same = x.shape == y.shape and torch.equal(_bits(x), _bits(y))
            if not same:
                d = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else None
                return {"step": k, "node": s.name, "op": s.op, "impl": s.impl, "max_abs": d}
    return None


def check(art: str) -> dict:
    sess = load(art)
    assert sess.backend.graphs, "the artifact must run with CUDA graphs"
    cache = sess.new_cache(len(PROMPTS))
    last = sess.prefill_last(PROMPTS, cache)
    for _ in range(3):  # specialize, capture, replay
        last = sess._decode(last.argmax(-1).tolist(), cache)
    prog = sess.backend.program("decode")
    spec = next(iter(prog._specs.values()))
    out = {"artifact": os.path.basename(art.rstrip("/")), "streams": prog.streams, "steps": len(spec.steps),
           "graph_captured": spec.graph is not None, "capture_error": spec.capture_error}
    if spec.graph is None:
        return out
    feeds = spec.graph_inputs
    snap = {n: t.clone() for n, t in feeds.items()}

    def restore():
        for n, t in feeds.items():
            t.copy_(snap[n])
        torch.cuda.synchronize()

    def eager() -> dict:
        restore()
        env = spec._env(feeds)
        got = {}
        for s in spec.steps:
            spec._step(s, env)
            for o in s.outputs:
                if isinstance(env[o], torch.Tensor):
                    got[o] = env[o].clone()
        torch.cuda.synchronize()
        return got

    e1, e2 = eager(), eager()
    out["eager_vs_eager"] = _diff(e1, e2, spec) or "identical"
    # the steps captured with a probe copy after each (single stream, as the tiny presets' programs)
    restore()
    env = spec._env(feeds)
    probes = {o: torch.empty_like(t) for o, t in e1.items()}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s in spec.steps:
            spec._step(s, env)
            for o in s.outputs:
                if o in probes:
                    probes[o].copy_(env[o])
    restore()
    g.replay()
    torch.cuda.synchronize()
    out["eager_vs_graph_nodes"] = _diff(e1, {o: t.clone() for o, t in probes.items()}, spec) or "identical"
    restore()
    spec.graph.replay()
    torch.cuda.synchronize()
    lid = dict(prog.outputs)["logits"]
    own = spec.graph_outputs["logits"]
    out["eager_vs_program_graph_logits"] = ("identical" if torch.equal(_bits(own), _bits(e1[lid])) else
                                            {"max_abs": (own.double() - e1[lid].double()).abs().max().item()})
    return out


def main() -> None:
    from run_info import per_artifact

    per_artifact(check, ("torch", "triton", "fla-core"), __doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
