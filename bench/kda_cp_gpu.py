"""Context-parallel KDA on one GPU (issue 18, deliverable 2): the segment map of one piece by fla-core's chunk_kda over
the augmented state (values [0 | v], initial state [I | 0]: Dk + Dv columns) beside the torch chunked form it
replaces (the reference model's kda_chunked on the GPU) and beside the plain chunk_kda forward the replay runs, at
the small preset's KDA size (16 heads of 128), bf16 inputs, float32 state; plus the accuracy of the composed maps
against the sequential float64 recurrence. Medians of CUDA-event timings (each call launched directly: the three
are eager Python launches alike); writes JSON.

    KIMI_COMMIT=$(git rev-parse HEAD) python bench/kda_cp_gpu.py --out $OUT/kda_cp_gpu.json [--tokens 8192,32768]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kimi_compile.model.primitives import kda_chunked, kda_recurrent  # noqa: E402
from kimi_compile.plugins.kda_cp.cuda import chunk_recurrence  # noqa: E402
from kimi_compile.plugins.kda_recurrence.reference import initial_states, segment_map  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def inputs(T: int, H: int, D: int, gen, dtype=torch.bfloat16):
    k = torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(1, T, H, D, generator=gen, device="cuda").to(dtype)
    g = -torch.rand(1, T, H, D, generator=gen, device="cuda") * 0.05
    beta = torch.rand(1, T, H, generator=gen, device="cuda")
    return k, g, beta, v


def main() -> None:
    from run_info import run_info

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {**run_info("torch", "triton", "fla-core"), "rows": [], "accuracy": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    H, D = a.heads, a.dim
    for T in map(int, a.tokens.split(",")):
        k, g, beta, v = inputs(T, H, D, gen)
        s0 = torch.zeros(1, H, D, D, device="cuda")
        row = {"tokens": T, "heads": H, "dim": D, "dtype": "bfloat16"}
        row["map_fla_us"] = timed(lambda: segment_map(k, g, beta, v, recurrence=chunk_recurrence), a.reps)
        row["forward_fla_us"] = timed(lambda: chunk_recurrence(torch.zeros_like(k), k, v, g, beta, s0), a.reps)
        if T <= 8192:  # the torch chunked form: a Python loop over chunks (slow; one size is enough to compare)
            row["map_torch_chunked_us"] = timed(
                lambda: segment_map(k.float(), g, beta, v.float(),
                                    recurrence=lambda *x: kda_chunked(*x, 64)), max(2, a.reps // 5))
            row["torch_over_fla"] = row["map_torch_chunked_us"] / row["map_fla_us"]
        row["map_over_forward"] = row["map_fla_us"] / row["forward_fla_us"]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        save(res, a.out)
    # accuracy: P pieces' maps composed against the sequential float64 recurrence (float32 inputs)
    for P in (2, 4):
        T, Hs = 1024, 4
        k, g, beta, v = inputs(T, Hs, D, gen, torch.float32)
        s0 = torch.randn(1, Hs, D, D, generator=gen, device="cuda") * 0.1
        _, want = kda_recurrent(torch.zeros_like(k).double(), k.double(), v.double(), g.double(), beta.double(),
                                s0.double())
        cut = [T * i // P for i in range(P + 1)]
        maps = [segment_map(*(t[:, x:y] for t in (k, g, beta, v)), recurrence=chunk_recurrence)
                for x, y in zip(cut, cut[1:])]
        st = initial_states(maps, s0)
        got = maps[-1][0] @ st[-1] + maps[-1][1]
        _, whole = chunk_recurrence(torch.zeros_like(k), k, v, g, beta, s0)
        err = lambda x: float((x.double() - want).norm() / want.norm())  # noqa: E731
        row = {"pieces": P, "tokens": T, "heads": Hs, "dim": D, "dtype": "float32",
               "composed_maps_rel_err": err(got), "whole_chunk_kda_rel_err": err(whole)}
        print(json.dumps(row), flush=True)
        res["accuracy"].append(row)
        save(res, a.out)
    save(res, a.out)


def save(res: dict, path: str) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(res, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
