"""Numerical verification against the PyTorch reference: fresh random ragged feeds for both phases, the reference's
outputs on them, ONNX Runtime runs of in-memory graphs, and the worst relative error.

`Verifier` is the pipeline's numerical check (`build --verify`): it runs ONNX Runtime on the graph after the trace
and after every pass and raises `VerifyError` naming the first pass that breaks the recipe's tolerance. After a pass
that changes the graph signature (it declares `changes_signature`, e.g. quantization splitting a cache into pools),
the feeds are re-derived for the new signature, the error against the fp32 reference is logged (not checked: that is
the quantization error the accuracy report states), and that graph becomes the expectation for later passes.
"""

from __future__ import annotations

import numpy as np

from kimi_compile.pipeline import VerifyError


def reference_feeds(model, opts, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """Fresh random, ragged feeds for both phases (decode starts from the reference prefill's caches)."""
    import torch

    from kimi_compile.trace import StepGraph, cache_specs

    cfg = model.config
    rng = np.random.default_rng(seed)
    B, MB, BS = 2, 4, opts.block_size
    NB = B * MB + 1
    T = min(2 * BS - 3, MB * BS - 2)
    lens = np.array([T, max(2, T // 2)], dtype=np.int64)
    bt = (np.arange(B * MB, dtype=np.int64).reshape(B, MB) + 1)
    caches = {}
    for s in cache_specs(cfg, BS):
        shape = [B if d == "batch" else NB if d == "num_blocks" else d for d in s.shape]
        caches[s.name] = np.zeros(shape, dtype=np.float32)
    prefill = {"input_ids": rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int64),
               "start": np.zeros(B, np.int64), "lengths": lens, "block_table": bt, **caches}
    ref = StepGraph(model, BS, False, opts.kda_chunk)
    with torch.no_grad():
        outs = ref(*[torch.from_numpy(v) for v in prefill.values()])
    specs = cache_specs(cfg, BS)
    after = {s.name: outs[1 + i].numpy() for i, s in enumerate(specs)}
    decode = {"input_ids": rng.integers(0, cfg.vocab_size, (B, 1)).astype(np.int64), "start": lens.copy(),
              "lengths": np.ones(B, np.int64), "block_table": bt, **after}
    return {"prefill": prefill, "decode": decode}


def reference_outputs(model, opts, phase: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch

    from kimi_compile.trace import StepGraph, cache_specs

    ref = StepGraph(model, opts.block_size, phase == "decode", opts.kda_chunk)
    with torch.no_grad():
        outs = ref(*[torch.from_numpy(v) for v in feeds.values()])
    names = ["logits", *[s.name + ".out" for s in cache_specs(model.config, opts.block_size)]]
    return {n: o.numpy() for n, o in zip(names, outs)}


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> float:
    """Worst relative error: logits on valid rows, and every cache output."""
    worst = 0.0
    lens = feeds["lengths"]
    for name, w in want.items():
        g = got[name]
        if name == "logits":
            g = np.concatenate([g[b, : lens[b]] for b in range(len(lens))])
            w = np.concatenate([w[b, : lens[b]] for b in range(len(lens))])
        denom = float(np.linalg.norm(w)) or 1.0
        worst = max(worst, float(np.linalg.norm(g.astype(np.float64) - w)) / denom)
    return worst


def ort_run(model_ir, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnx_ir as ir
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    model_ir = ir.external_data.load_to_model(model_ir)
    sess = ort.InferenceSession(ir.to_proto(model_ir).SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


class Verifier:
    """The pipeline's numerical check (kimi_compile.pipeline.Check) against the reference `model`."""

    def __init__(self, model, opts, tolerance: float, seed: int = 0, run=None):
        """`run(graph, feeds) -> outputs` executes a graph (default ONNX Runtime; a backend may bring its own CPU
        runner for graphs ONNX Runtime cannot feed, e.g. bfloat16 or float8 caches)."""
        from kimi_compile.trace_spec import PHASES

        self.run = run or ort_run
        self.tolerance = tolerance
        self.feeds = reference_feeds(model, opts, seed)
        self.expected = {p: reference_outputs(model, opts, p, self.feeds[p]) for p in PHASES}
        self._rebased_prefill: dict[str, np.ndarray] | None = None

    def __call__(self, phase: str, model, after: str, rebase: bool) -> dict:
        if rebase:
            from kimi_compile.accuracy import rebase_feeds

            self.feeds[phase] = rebase_feeds(model, self.feeds[phase], self._rebased_prefill)
            got = self.run(model, self.feeds[phase])
            err = compare({"logits": got["logits"]}, {"logits": self.expected[phase]["logits"]}, self.feeds[phase])
            self.expected[phase] = got
            if phase == "prefill":
                self._rebased_prefill = got
            return {"phase": phase, "after": after, "rel_err": err, "rebased": True,
                    "note": "error vs the fp32 reference after a signature change (not checked); later passes are "
                            "compared with this graph"}
        err = compare(self.run(model, self.feeds[phase]), self.expected[phase], self.feeds[phase])
        if err > self.tolerance:
            what = f"the traced {phase} graph differs from the reference" if after == "trace" else \
                f"pass {after!r} broke the {phase} graph"
            raise VerifyError(f"--verify: {what} (rel err {err:.2e} > {self.tolerance:.0e})")
        return {"phase": phase, "after": after, "rel_err": err}
