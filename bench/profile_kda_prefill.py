"""Where the cuda backend's KDA prefill (plugins/kda/triton.py: kda_prefill_prepare, fla-core's chunk_kda with its
in-kernel gate, kda_output_norm_gate) spends its device time at B=1, T=32768, H=96: torch.profiler's kernel table per
call, with and without an initial state. Needs a CUDA GPU and fla-core.

    python bench/profile_kda_prefill.py --out $OUT/prof_prefill.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from fla.ops.kda import chunk_kda

    from kimi_compile.plugins.kda import triton as ktk

    dev, T, H, D = "cuda", 32768, 96, 128
    C = H * D
    torch.manual_seed(0)
    u = torch.randn(1, T, 3 * C, device=dev, dtype=torch.bfloat16)
    f, gate = (torch.randn(1, T, C, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cw = torch.randn(3 * C, 4, device=dev, dtype=torch.bfloat16) * 0.5
    b = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(H, device=dev) * 0.5, torch.randn(C, device=dev) * 0.5
    ow = torch.ones(D, device=dev, dtype=torch.bfloat16)
    window = torch.zeros(1, 3, 3 * C, device=dev, dtype=torch.bfloat16)
    lengths = torch.full((1,), T, device=dev, dtype=torch.int64)
    out = {}
    for init in (True, False):
        state = torch.zeros(1, H, D, D, device=dev)

        def call():
            q, k, v, fm, beta = ktk.kda_prefill_prepare(u, window, cw, f, b, lengths, scale=D ** -0.5, l2_eps=1e-6)
            o, _ = chunk_kda(q, k, v, fm, beta, scale=1.0, initial_state=state if init else None,
                             output_final_state=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                             A_log=A_log, dt_bias=dt_bias)
            return ktk.kda_output_norm_gate(o, gate, ow, 1e-5)

        for _ in range(2):
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.reps):
                call()
            torch.cuda.synchronize()
        kern = sorted(((e.key[:90], round(e.device_time_total / a.reps, 1)) for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda kv: -kv[1])[:20]
        out[f"initial_state={init}"] = {"total_us": round(sum(v for _, v in kern), 1), "kernels_us": dict(kern)}
        print(init, out[f"initial_state={init}"]["total_us"], kern[:8])
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
