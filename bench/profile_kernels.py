"""Run each fused-op kernel variant twice on the benchmark shapes (no timing) and print registers / spills from
Triton's compiled kernels, for profiling under Nsight Compute on the H200:

    ncu --clock-control none --csv --metrics <list> -k regex:'_score|_cand|_final|_select|_sparse_mla|_combine' \
        python3 bench/profile_kernels.py

`bench/gpu_kernels.py` is the benchmark; this script only gives ncu one launch of each variant to read counters on.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kimi_compile.plugins.indexer_topk import triton as itk  # noqa: E402
from kimi_compile.plugins.quant import triton as qtk  # noqa: E402
from kimi_compile.plugins.sparse_mla import triton as mtk  # noqa: E402

DEV = "cuda"


def _paged(B, L, bs):
    nblk = (L + bs - 1) // bs
    return torch.randperm(B * nblk, device=DEV).int().view(B, nblk).contiguous(), B * nblk


def indexer(cases, variants):
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
        for cfg in variants:
            for _ in range(2):
                itk.indexer_topk_decode(q, w, codes, scales, bt, cl, topk, **cfg)
            torch.cuda.synchronize()
            print(f"indexer B={B} L={L} {cfg}", flush=True)


def mla(cases, variants):
    H, topk, bs, ctx = 128, 2048, 64, 16384
    for B in cases:
        bt, nb = _paged(B, ctx, bs)
        cache = torch.empty(nb, bs, 656, dtype=torch.uint8, device=DEV)
        qtk.mla_fp8_quantize_to_cache(torch.randn(nb * bs, 512, device=DEV), torch.randn(nb * bs, 64, device=DEV),
                                      torch.arange(nb * bs, device=DEV), cache)
        idx = torch.rand(B, ctx, device=DEV).argsort(-1)[:, :topk].int().contiguous()
        q = (torch.randn(B, H, 576, device=DEV) * 0.3).bfloat16()
        for cfg in variants(B):
            for _ in range(2):
                mtk.sparse_mla_decode(q, cache, bt, idx, **cfg)
            torch.cuda.synchronize()
            print(f"sparse_mla B={B} {cfg}", flush=True)


def regs():
    for mod in (itk, mtk):
        for name in dir(mod):
            fn = getattr(mod, name)
            cache = getattr(fn, "device_caches", None) or {}
            for dev_cache in (cache.values() if isinstance(cache, dict) else []):
                kcache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
                for key, ck in (kcache.items() if isinstance(kcache, dict) else []):
                    print(f"{name}: regs={getattr(ck, 'n_regs', '?')} spills={getattr(ck, 'n_spills', '?')} "
                          f"smem={ck.metadata.shared if hasattr(ck, 'metadata') else '?'} "
                          f"warps={ck.metadata.num_warps if hasattr(ck, 'metadata') else '?'}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="indexer,mla")
    args = ap.parse_args()
    if "indexer" in args.what:
        indexer([(32, 65536), (1, 131072)],
                [dict(impl="v2", bn=128, num_warps=4, num_stages=1, progs_per_sm=2), dict(impl="v3"), dict(impl="v4")])
    if "mla" in args.what:
        mla([32, 1], lambda B: [dict(impl="v1", nsplit=2 if B > 1 else None, bn=64, nacc=4 if B > 1 else 2,
                                     num_warps=8, num_stages=1)])
    regs()


if __name__ == "__main__":
    main()
