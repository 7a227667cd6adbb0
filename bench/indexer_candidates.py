"""How many candidates the indexer's threshold passes on a built artifact's own decode scores (issue 20): one decode
step per context with the caches filled as bench/e2e_gpu.py fills them, the kimi.IndexerTopK inputs captured, the
full scores computed by the op's torch form, and the candidate kernel (`_candidates`, plugins/indexer_topk/triton.py)
run on them. Candidates above 4096 send the exact select to its slow path (chunks re-read from memory per bisection
step), which is what made `_final_kernel` the largest indexer kernel of the e2e decode profile.

    python bench/indexer_candidates.py ARTIFACT --contexts 32767,32768,40000 --out F.json

On a GPU the kernel runs as compiled; on a CPU it needs TRITON_INTERPRET=1 and a Triton whose interpreter runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_gpu  # noqa: E402
from e2e_gpu import fill_caches, meta  # noqa: E402
from run_info import write_result  # noqa: E402

from kimi_compile.plugins.indexer_topk import cuda as icuda  # noqa: E402
from kimi_compile.plugins.indexer_topk import triton as itk  # noqa: E402
from kimi_compile.runtime import load  # noqa: E402


def _capture() -> list:
    """Wrap the IndexerTopK kernels of the cuda backend so each call's inputs and attributes are kept."""
    calls: list = []
    kernel = icuda.CUDA["IndexerTopK"]
    for k in (kernel, kernel.fallback):
        run = k.run

        def wrapped(x, a, _run=run):
            calls.append(([t.clone() if isinstance(t, torch.Tensor) else t for t in x], dict(a)))
            return _run(x, a)
        object.__setattr__(k, "run", wrapped)
    return calls


def candidates(x, a) -> list[dict]:
    """Per row of one IndexerTopK call: its visible length, keff and the candidate kernel's count."""
    q, w, pool, bt, start, lengths = x[:6]
    scale_pool = x[6] if len(x) > 6 else None
    B, T = q.shape[:2]
    if T != 1:
        raise ValueError(f"decode calls only (T = 1), got T = {T}")
    keys = icuda._keys(pool, bt, scale_pool if a["k_format"] == "mxfp8" else None, a["block"])
    cap = keys.shape[1]
    sc = (torch.einsum("bhd,bsd->bhs", q[:, 0].float(), keys).relu() * w[:, 0].float()[..., None]).sum(1)
    L = (start + lengths).to(torch.int32).reshape(B)
    pos = torch.arange(cap, device=sc.device)
    G = itk.GROUP
    gm = torch.where(pos[None] < L[:, None].long(), sc, float("-inf")).view(B, cap // G, G).amax(-1)
    ws = (sc.contiguous(), gm.contiguous(), torch.empty_like(sc), torch.empty(B, cap, dtype=torch.int32, device=sc.device),
          torch.zeros(B, dtype=torch.int32, device=sc.device))
    topk = int(a["topk"])
    itk._candidates(ws, L, cap, cap // G, topk, G, itk.num_sms(sc.device))
    return [{"L": int(n), "keff": min(int(n), topk), "candidates": int(c), "share": round(int(c) / max(int(n), 1), 4)}
            for n, c in zip(L.tolist(), ws[4].tolist())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--contexts", default="32767,32768,40000")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    try:
        contexts = [int(c) for c in a.contexts.split(",")]
    except ValueError:
        raise SystemExit(f"indexer_candidates: --contexts must be comma-separated token counts, got {a.contexts!r}")
    if any(c < 1 for c in contexts) or a.batch < 1:
        raise SystemExit(f"indexer_candidates: --contexts and --batch must be positive, got {a.contexts!r}, {a.batch}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("indexer_candidates: without a GPU set TRITON_INTERPRET=1 (the candidate kernel runs in "
                         "Triton's interpreter)")
    e2e_gpu.DEV = dev
    calls = _capture()
    sess = load(a.artifact)
    rows = []
    for ctx in contexts:
        cache = sess.new_cache(a.batch)
        fill_caches(sess, cache, ctx, torch.Generator(device=dev).manual_seed(0))
        calls.clear()
        sess._decode([5] * a.batch, cache)
        for i, (x, at) in enumerate(calls):
            for r in candidates(x, at):
                rows.append({"context": ctx, "call": i, **r})
                print(rows[-1], flush=True)
    out = {**meta(), "artifact": a.artifact, "device_kind": dev, "rows": rows}
    write_result(a.out, out)


if __name__ == "__main__":
    main()
