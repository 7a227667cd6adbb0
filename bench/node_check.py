"""Every kimi.* node of a built cuda artifact, on real activations: its kernel's outputs beside its reference
implementation's on the same inputs (one prefill chunk, a few decode steps, then a second prefill continuing the
sequences at start > 0: the shape of speculative verification and of chunked prefill, --continue tokens each); then
the whole step with every kernel against the same program with every kimi.* node on its reference. Writes JSON.

    python bench/node_check.py ARTIFACT --out $OUT/node_check.json [--prompt 64] [--decode-steps 2] [--batch 2]

Float outputs: relative error ||kernel - reference|| / ||reference||; integer outputs (top-k indices): the mean
overlap of each row's index sets (ties make sets, not orders, the contract). On a CPU the kernels are their torch
forms (errors at float32 rounding, about 1e-6: a smoke run of the script's logic, which tests/backends/test_cuda.py
runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kimi_compile import ops  # noqa: E402
from kimi_compile.backends.cuda.program import Program, _reference_fn  # noqa: E402
from kimi_compile.runtime import load  # noqa: E402


def compare(k: torch.Tensor, r: torch.Tensor) -> dict:
    if k.shape != r.shape:
        return {"shape_kernel": list(k.shape), "shape_reference": list(r.shape)}
    codes = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
    if k.dtype in codes and r.dtype in codes:  # FP8 codes / E8M0 bytes: compared as bytes
        kb, rb = k.contiguous().view(torch.uint8), r.contiguous().view(torch.uint8)
        return {"bytes_differing": int((kb != rb).sum().item()), "bytes": kb.numel()}
    if not k.dtype.is_floating_point:
        if k.dim() < 1 or k.numel() == 0:
            return {"equal": bool(torch.equal(k, r))}
        kk, rr = k.reshape(-1, k.shape[-1]).cpu().numpy(), r.reshape(-1, r.shape[-1]).cpu().numpy()
        ov = [len(set(a.tolist()) & set(b.tolist())) / max(1, len(set(b.tolist()))) for a, b in zip(kk, rr)]
        return {"index_overlap_mean": float(np.mean(ov)), "index_overlap_min": float(np.min(ov))}
    k, r = k.float(), r.float()
    fin = torch.isfinite(k).all().item()
    den = r.norm().item()
    return {"rel_err": (k - r).norm().item() / den if den else (k - r).norm().item(), "finite": bool(fin),
            "ref_norm": den}


class Checker:
    """Wraps each kernel step of a program: run the reference on cloned inputs first, then the kernel."""

    def __init__(self, prog: Program, phase: str):
        self.rows: list[dict] = []
        self.phase = phase
        self.saved = []  # (step, its kernel): `restore` puts them back
        for s in prog.steps:
            if not s.op.startswith("kimi."):
                continue
            op = ops.lookup(s.op.removeprefix("kimi."))
            ref = _reference_fn(op, [prog.values[o] for o in s.outputs], {})
            self.saved.append((s, s.fn))
            s.fn = self._wrap(s, s.fn, ref)

    def restore(self) -> None:
        for s, fn in self.saved:
            s.fn = fn

    def _wrap(self, s, kernel, ref):
        def run(x, a, **kw):  # kw: out= (the step's planned slots, for a kernel that writes into them)
            clones = [t.clone() if isinstance(t, torch.Tensor) else t for t in x]
            r = ref(clones, a)
            out = kernel(x, a, **kw)
            row = {"phase": self.phase, "node": s.name, "op": s.op, "impl": s.impl, "outputs": []}
            for ko, ro in zip(out, r):
                row["outputs"].append(compare(ko, ro))
            self.rows.append(row)
            return out
        return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=2)
    ap.add_argument("--continue", dest="cont", type=int, default=4, help="tokens of the continuing prefill (0: none)")
    a = ap.parse_args()
    from run_info import run_info

    res = {**run_info("torch", "triton"), "artifact": os.path.basename(a.artifact.rstrip("/"))}
    sess = load(a.artifact)
    sess.backend.graphs = False
    checkers = {p: Checker(sess.backend.program(p), p) for p in ("prefill", "decode")}
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, sess.vocab_size, (a.prompt + 7 * b,), generator=gen).tolist() for b in range(a.batch)]
    cache = sess.new_cache(a.batch)
    last = sess.prefill_last(prompts, cache)
    logits_kernels = [last.float().cpu()]
    for _ in range(a.decode_steps):
        last = sess._decode(last.argmax(-1).tolist(), cache)
        logits_kernels.append(last.float().cpu())
    n_first = len(checkers["prefill"].rows)
    conts = [torch.randint(3, sess.vocab_size, (a.cont,), generator=gen).tolist() for _ in range(a.batch)]
    if a.cont:
        last = sess.prefill_last(conts, cache)
        logits_kernels.append(last.float().cpu())
        for r in checkers["prefill"].rows[n_first:]:
            r["phase"] = "prefill (continued, start > 0)"
    res["nodes"] = checkers["prefill"].rows + checkers["decode"].rows
    for c in checkers.values():  # the same session from here on: its kernels alone, then its references alone
        c.restore()
    if a.cont:  # the same tokens as one prefill from position 0: the last logits agree up to rounding
        whole = [p + [int(t) for t in torch.stack(logits_kernels[:-1])[:, b].argmax(-1)][:a.decode_steps] + c
                 for b, (p, c) in enumerate(zip(prompts, conts))]
        w = sess.prefill_last(whole, sess.new_cache(a.batch)).float().cpu()
        res["continued_vs_whole_prefill"] = {**compare(logits_kernels[-1], w),
                                             "top1_agree": float((logits_kernels[-1].argmax(-1) == w.argmax(-1))
                                                                 .float().mean())}
    # whole steps: every kimi.* node on its reference (same weights, same onnx-op lowering), same tokens
    for p in ("prefill", "decode"):
        prog = sess.backend.program(p)
        for s in prog.steps:
            if s.op.startswith("kimi.") and s.impl != "reference":
                op = ops.lookup(s.op.removeprefix("kimi."))
                s.fn = _reference_fn(op, [prog.values[o] for o in s.outputs], s.inplace)
                s.writes_out = False  # the reference returns new tensors (the executor copies them into the slots)
    cache = sess.new_cache(a.batch)
    last = sess.prefill_last(prompts, cache)
    logits_ref = [last.float().cpu()]
    toks = [int(t) for t in logits_kernels[0].argmax(-1)]
    for i in range(a.decode_steps):
        last = sess._decode(logits_kernels[i].argmax(-1).tolist(), cache)
        logits_ref.append(last.float().cpu())
    if a.cont:
        logits_ref.append(sess.prefill_last(conts, cache).float().cpu())
    res["whole_step"] = [{"step": i, **compare(k, r),
                          "top1_agree": float((k.argmax(-1) == r.argmax(-1)).float().mean())}
                         for i, (k, r) in enumerate(zip(logits_kernels, logits_ref))]
    res["first_tokens"] = toks
    worst = sorted((max((o.get("rel_err", 0.0) for o in r["outputs"]), default=0.0), r["node"], r["op"], r["phase"])
                   for r in res["nodes"])[-12:]
    res["worst"] = worst
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({"whole_step": res["whole_step"], "worst": worst,
                      "continued_vs_whole_prefill": res.get("continued_vs_whole_prefill")}, indent=1))


if __name__ == "__main__":
    main()
