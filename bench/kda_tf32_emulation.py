"""How far TF32 operands in the KDA's chunked recurrence move a float32 model's logits: the cuda artifact run on CPU
tensors (a machine without CUDA), its chunked form (kimi_compile.model.primitives.kda_chunked) once as is and once
with its q, k, v inputs and the operands of its `@` products (the intra-chunk solve's w and u, the state passes)
rounded to TF32's 10 mantissa bits (half away from zero on the magnitude; the hardware rounds to nearest even):
what fla-core's chunk_kda does to float32 on a GPU, Triton's default dot precision. Its einsums and the forward
substitution stay float32 here where fla's dots round them too, so the errors are a lower bound. Each beside ONNX
Runtime's fp32 reference artifact on the same prompts: the prefill and 12 teacher-forced decode steps (the
reference's greedy tokens fed to both).

    python bench/kda_tf32_emulation.py ORT_ARTIFACT CUDA_ARTIFACT [ORT CUDA ...] --out FILE

Per step: relative error of the last-token logits, the reference's top-1 margin and whether the argmax agrees.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kimi_compile.model.primitives as primitives  # noqa: E402
from kimi_compile.runtime import load  # noqa: E402
from run_info import run_info, write_result  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 250, 7, 12, 40, 41, 8, 300, 2, 77], [9, 8, 7], [400, 1, 2, 3, 4, 5, 6]]


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10 mantissa bits (half away from zero on the magnitude), stored as float32."""
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _tf32_chunked(chunked):
    def run(q, k, v, g, beta, state, chunk_size=64):
        matmul = torch.Tensor.__matmul__
        torch.Tensor.__matmul__ = lambda a, b: matmul(tf32(a), tf32(b))
        try:
            return chunked(tf32(q), tf32(k), tf32(v), g, beta, state, chunk_size)
        finally:
            torch.Tensor.__matmul__ = matmul
    return run


def teacher_forced(ort_dir: str, cuda_dir: str, steps: int = 12) -> list[dict]:
    ref, ours = load(ort_dir), load(cuda_dir)
    cr, co = ref.new_cache(len(PROMPTS)), ours.new_cache(len(PROMPTS))
    lr, lo = ref.prefill_last(PROMPTS, cr), ours.prefill_last(PROMPTS, co)
    rows = []
    for step in range(steps):
        a = np.asarray(lr, dtype=np.float64)
        b = lo.float().numpy().astype(np.float64)
        top2 = np.sort(a, -1)[:, -2:]
        rows.append({"step": step, "rel_err": float(np.linalg.norm(b - a) / np.linalg.norm(a)),
                     "margin": (top2[:, 1] - top2[:, 0]).tolist(), "agree": (a.argmax(-1) == b.argmax(-1)).tolist()})
        tokens = a.argmax(-1).tolist()
        lr, lo = ref._decode(tokens, cr), ours._decode(tokens, co)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="ORT_ARTIFACT CUDA_ARTIFACT, repeated")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if len(a.pairs) % 2:
        ap.error("artifacts come in pairs: ORT_ARTIFACT CUDA_ARTIFACT")
    res = {**run_info("torch", "onnxruntime"), "rows": []}
    chunked = primitives.kda_chunked
    for ort_dir, cuda_dir in zip(a.pairs[::2], a.pairs[1::2]):
        row = {"ort": Path(ort_dir).name, "cuda": Path(cuda_dir).name}
        for mode in ("fp32", "tf32_operands"):
            primitives.kda_chunked = chunked if mode == "fp32" else _tf32_chunked(chunked)
            try:
                row[mode] = teacher_forced(ort_dir, cuda_dir)
            finally:
                primitives.kda_chunked = chunked
            errs = [r["rel_err"] for r in row[mode]]
            print(row["cuda"], mode, f"rel err {min(errs):.2e} .. {max(errs):.2e}", flush=True)
        res["rows"].append(row)
    write_result(a.out, res)


if __name__ == "__main__":
    main()
