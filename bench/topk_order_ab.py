"""The relax_topk_order pass end to end: decode steps of one built artifact (whose IndexerTopK nodes carry sorted=0)
with the indexer kernel as built (no rank stage) and forced back to the sorted contract (sort=True: the rank kernel
and its key workspace, as before the pass), interleaved in one process on one GPU, graph replay both ways.

    python bench/topk_order_ab.py --out ab.json [--artifact artifacts/kimi-k3.1-small-cuda] [--decode 1x32768,...]

Each case runs `rounds` times in the order as-built, sorted, as-built, sorted, ... (bench/e2e_gpu.py's decode
timing: a fresh session, caches filled, `steps` timed steps after warm-up); the JSON holds every round's median and
the medians of those. The indexer nodes' `sorted` attributes are read from the artifact and recorded. On a machine
without CUDA it runs the script's logic on the artifact's CPU executor (where the indexer is the torch form and the
two orders time the same work).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import e2e_gpu as e2e  # noqa: E402

from kimi_compile.plugins.indexer_topk import triton as itk  # noqa: E402


def _orders(art: str) -> list[int]:
    """The sorted attribute of every kimi.IndexerTopK node in the artifact's decode graph (1 where absent)."""
    import onnx

    g = onnx.load(str(Path(art) / "graphs" / "decode.onnx"), load_external_data=False).graph
    return [next((a.i for a in n.attribute if a.name == "sorted"), 1) for n in g.node if n.op_type == "IndexerTopK"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--artifact", default=str(ROOT / "artifacts" / "kimi-k3.1-small-cuda"))
    ap.add_argument("--decode", default="1x32768,8x32768,32x32768")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not (Path(a.artifact) / "graphs" / "decode.onnx").is_file():
        ap.error(f"--artifact {a.artifact}: no graphs/decode.onnx there (build the cuda artifact first)")
    cases = []
    for spec in a.decode.split(","):
        try:
            B, ctx = map(int, spec.split("x"))
        except ValueError:
            ap.error(f"--decode: each case must be BATCHxCONTEXT (e.g. 1x32768), got {spec!r}")
        cases.append((spec, B, ctx))
    e2e.RESULT.update(e2e.meta())
    e2e.RESULT["command"] = " ".join([sys.executable, *sys.argv])
    e2e.RESULT["indexer_sorted_attrs"] = _orders(a.artifact)
    as_built = itk.indexer_topk

    def forced_sorted(*args, **kw):
        kw["sort"] = True
        return as_built(*args, **kw)

    summary = {}
    for spec, B, ctx in cases:
        runs = {"as built": [], "sorted": []}
        for _ in range(a.rounds):
            for name, fn in (("as built", as_built), ("sorted", forced_sorted)):
                itk.indexer_topk = fn
                try:
                    row = e2e.ours_decode(a.artifact, B, ctx, a.steps, graphs=e2e.DEV == "cuda")
                finally:
                    itk.indexer_topk = as_built
                runs[name].append(row["median_us"])
                e2e.case(section="decode", order=name, batch=B, context=ctx, **row)
                e2e.save(a.out)
        summary[spec] = {k: round(statistics.median(v), 1) for k, v in runs.items()}
        summary[spec]["sorted / as built"] = round(summary[spec]["sorted"] / summary[spec]["as built"], 4)
        e2e.log(spec, summary[spec])
    e2e.RESULT["summary_median_us"] = summary
    e2e.save(a.out)


if __name__ == "__main__":
    main()
