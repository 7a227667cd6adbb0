"""ONNX Runtime's CUDA execution provider (onnxruntime-gpu) on onnxruntime-backend artifacts (issue 22): greedy
tokens (32 steps) and prefill logits against the CPU provider, and the decode step through the runtime at B=1 and 8
(caches as host numpy arrays fed each step: the runtime's ONNX Runtime path, no IO binding); writes JSON.

    KIMI_COMMIT=$(git rev-parse HEAD) python bench/ort_gpu.py --out $OUT/ort_gpu.json ART_DIR [ART_DIR ...]

onnxruntime-gpu (1.31.1 is a CUDA 13 build) in place of onnxruntime; its CUDA and cuDNN libraries come from the
nvidia-* wheels (onnxruntime.preload_dlls, or LD_LIBRARY_PATH). Medians of wall-clock steps after 8 warm-up steps.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kimi_compile.runtime import load  # noqa: E402

PROMPTS = [[5, 17, 3, 9], [9, 8, 7], [400, 1, 2, 3, 4]]


def decode_us(sess, B: int, steps: int = 40, warmup: int = 8) -> float:
    """Median wall-clock microseconds of one greedy decode step (host argmax) after a 4-token prefill."""
    cache = sess.new_cache(B, 200)
    sess.prefill_last([[3 + b, 4, 5, 6] for b in range(B)], cache)
    tok, ts = [7] * B, []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = sess.decode(tok, cache).argmax(-1).tolist()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[warmup:]) * 1e6


def check(art: str) -> dict:
    gpu, cpu = load(art, providers=["cuda", "cpu"]), load(art, providers=["cpu"])
    row = {"providers": gpu.backend.providers, "notes": gpu.backend.notes}
    row["tokens_equal_cpu_provider_32_steps"] = (gpu.generate(PROMPTS, 32, stop_at_eos=False) ==
                                                 cpu.generate(PROMPTS, 32, stop_at_eos=False))
    lg = gpu.prefill_last(PROMPTS, gpu.new_cache(len(PROMPTS)))
    lc = cpu.prefill_last(PROMPTS, cpu.new_cache(len(PROMPTS)))
    row["prefill_logits_rel_err"] = float(np.linalg.norm(lg - lc) / np.linalg.norm(lc))
    for B in (1, 8):
        row[f"decode_B{B}_median_us"] = {"cuda_ep": decode_us(gpu, B), "cpu_ep": decode_us(cpu, B)}
    return row


def main() -> None:
    import onnxruntime as ort
    from run_info import per_artifact

    per_artifact(check, ("onnxruntime-gpu", "onnxruntime"), __doc__.split("\n\n")[0],
                 lambda: {"ort_version": ort.__version__, "available": ort.get_available_providers()})


if __name__ == "__main__":
    main()
