"""MatMulNZ (NZ-blocked weight, read block by block) vs torch.matmul on the plain weight, bf16, on a GPU.

    KIMI_COMMIT=$(git rev-parse HEAD) python bench/matmul_nz.py [--out FILE]

Shapes are the K3.1 projections at decode (M=1..64) and prefill (M=4096). The kernel picks its tiles by M
(plugins/matmul_nz/triton.py `tiles`); each row records them. Medians of CUDA-event timings with L2 flushed, both
sides launched directly (no CUDA graph); JSON with the commit measured, device, versions and command
(bench/run_info.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def timeit(fn, reps=50):
    """Median us of fn: the gpu_kernels timer (CUDA events, 256 MB L2 flush before each run), without a graph."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_kernels import bench

    return bench(fn, reps=reps, graph=False)["median_us"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"matmul_nz_{datetime.date.today()}.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from run_info import run_info

    from kimi_compile.plugins.matmul_nz import triton as tnz
    from kimi_compile.plugins.matmul_nz.reference import nd_to_nz_torch

    rows = []
    shapes = [("q_a_proj", 7168, 1536), ("q_b_proj", 1536, 18432), ("o_proj", 12288, 7168), ("kda_qkv", 7168, 12288)]
    for M in (1, 32, 4096):
        for name, K, N in shapes:
            x = torch.randn(M, K, device="cuda").bfloat16()
            w = (torch.randn(K, N, device="cuda") / K**0.5).bfloat16()
            w_nz = nd_to_nz_torch(w).contiguous()
            cfg = tnz.tiles(M)
            y = tnz.matmul_nz(x, w_nz, K, N)
            ref = x.float() @ w.float()
            err = float((y.float() - ref).norm() / ref.norm())
            t_nz = timeit(lambda: tnz.matmul_nz(x, w_nz, K, N))
            t_mm = timeit(lambda: x @ w)
            byts = (M * K + K * N + M * N) * 2
            rows.append({"shape": name, "M": M, "K": K, "N": N, "rel_err": err, "nz_us": round(t_nz, 2),
                         "torch_matmul_us": round(t_mm, 2), "nz_over_torch": round(t_nz / t_mm, 3),
                         "nz_GBps": round(byts / t_nz / 1e3, 1), "nz_TFLOPs": round(2 * M * K * N / t_nz / 1e6, 1),
                         "config": cfg})
            print(rows[-1], flush=True)
    res = {"benchmark": "matmul_nz", **run_info("torch", "triton"),
           "note": "median of 50 CUDA-event timings, 256 MB L2 flush before each; direct launches", "rows": rows}
    tmp = Path(a.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=2) + "\n")
    tmp.replace(a.out)  # never a half-written result


if __name__ == "__main__":
    main()
