"""Run each kept fused-op kernel twice on the benchmark shapes (no timing) and print registers / spills from Triton's
compiled kernels, for profiling under Nsight Compute on the H200:

    ncu --clock-control none --csv --metrics <list> -k regex:'_score|_cand|_final|_mla_|_sum' \
        python3 bench/profile_kernels.py [--what indexer,mla]

`bench/gpu_kernels.py` is the benchmark; this script only gives ncu one launch of each kernel to read counters on
(the indexer once per strategy: the default "gluon" where it applies, and the "triton" fallback). It prints the
commit, device and versions it ran with (bench/run_info.py) for the ncu JSON written from its output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kimi_compile.plugins.indexer_topk import triton as itk  # noqa: E402
from kimi_compile.plugins.quant import triton as qtk  # noqa: E402
from kimi_compile.plugins.sparse_mla import triton as mtk  # noqa: E402
from run_info import run_info  # noqa: E402

DEV = "cuda"


def _paged(B, L, bs):
    nblk = (L + bs - 1) // bs
    return torch.randperm(B * nblk, device=DEV).int().view(B, nblk).contiguous(), B * nblk


def indexer(cases):
    H, D, topk, bs = 64, 128, 2048, 64
    for B, L in cases:
        bt, nb = _paged(B, L, bs)
        codes = torch.empty(nb, bs, D, dtype=torch.uint8, device=DEV)
        scales = torch.empty(nb, bs, D // 32, dtype=torch.uint8, device=DEV)
        k = torch.randn(nb * bs, D, device=DEV, dtype=torch.bfloat16)
        qtk.mxfp8_quantize_to_cache(k, torch.arange(nb * bs, device=DEV), codes, scales, "ceil")
        del k
        q = torch.randn(B, H, D, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(B, H, device=DEV) * H ** -0.5 * D ** -0.5
        cl = torch.full((B,), L, dtype=torch.int32, device=DEV)
        rows = torch.arange(B, dtype=torch.int32, device=DEV)
        for strat in dict.fromkeys([itk.strategy_for(codes, H), "triton"]):
            for _ in range(2):
                itk.indexer_topk_rows(q, w, codes, scales, bt, rows, cl, topk, strategy=strat)
            torch.cuda.synchronize()
            print(f"indexer B={B} L={L} strategy={strat}", flush=True)


def mla(cases):
    H, topk, bs, ctx = 128, 2048, 64, 16384
    for B in cases:
        bt, nb = _paged(B, ctx, bs)
        kc = torch.empty(nb, bs, 512, dtype=torch.uint8, device=DEV)
        ks = torch.empty(nb, bs, 4, dtype=torch.uint8, device=DEV)
        kr = torch.empty(nb, bs, 64, dtype=torch.bfloat16, device=DEV)
        qtk.mla_fp8_quantize_to_cache(torch.randn(nb * bs, 512, device=DEV), torch.randn(nb * bs, 64, device=DEV),
                                      torch.arange(nb * bs, device=DEV), kc, ks, kr)
        idx = torch.rand(B, ctx, device=DEV).argsort(-1)[:, :topk].contiguous()[:, None]
        q = (torch.randn(B, 1, H, 576, device=DEV) * 0.3).bfloat16()
        for _ in range(2):
            mtk.sparse_mla(q, kc, ks, kr, bt, idx, 576 ** -0.5)
        torch.cuda.synchronize()
        print(f"sparse_mla B={B}", flush=True)


def regs():
    from kimi_compile.plugins.indexer_topk import gluon

    for mod in (itk, gluon, mtk):
        for name in dir(mod):
            fn = getattr(mod, name)
            cache = getattr(fn, "device_caches", None) or {}
            for dev_cache in (cache.values() if isinstance(cache, dict) else []):
                kcache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
                for ck in (kcache.values() if isinstance(kcache, dict) else []):
                    print(f"{name}: regs={getattr(ck, 'n_regs', '?')} spills={getattr(ck, 'n_spills', '?')} "
                          f"smem={ck.metadata.shared if hasattr(ck, 'metadata') else '?'} "
                          f"warps={ck.metadata.num_warps if hasattr(ck, 'metadata') else '?'}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="indexer,mla")
    args = ap.parse_args()
    print(json.dumps(run_info("torch", "triton")), flush=True)
    if "indexer" in args.what:
        indexer([(32, 65536), (1, 131072)])
    if "mla" in args.what:
        mla([32, 1])
    regs()


if __name__ == "__main__":
    main()
