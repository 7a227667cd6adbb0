"""Build, check and time every kept GPU kernel beside its baselines in one run (issue 6); writes JSON.

    KIMI_COMMIT=$(git rev-parse HEAD) python bench/gpu_kernels.py --out $OUT/gpu_kernels.json
        [--sections floors,indexer,mla,kda_decode,kda_prefill,quant,attn_res] [--no-compile] [--reps 30] [--quick]
        [--skip-prefill] [--flush write|read]

Method: CUDA events around each call, median (and p10/p90) over --reps runs; before every timed run a 256 MiB buffer is
zeroed so L2 (60 MB) holds none of the inputs ("L2 flushed"; --flush read reads it instead, leaving L2 clean).
"graph" rows replay a captured CUDA graph (how a decode step runs in the runtime, without Python launch overhead);
"direct" rows launch from Python. Compare rows of the same launch mode only. The floors come first: device copy
bandwidth (bytes read + written over time, 2 GiB copy) and the bf16 matmul rate (8192^3, random data);
floor_us = max(bytes / copy_bw, flops / matmul_rate), ratio = median / floor.
Each of our kernels is checked at the timed shape against an fp32 torch computation (indices as sets up to ties)
before it is timed. Kernels are named by strategy (plugins/indexer_topk/triton.py: "gluon", its fallback "triton").
The JSON records the commit measured, the device and the versions (bench/run_info.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kimi_compile.plugins.attn_res import cuda as acuda  # noqa: E402
from kimi_compile.plugins.attn_res import triton as atk  # noqa: E402
from kimi_compile.plugins.indexer_topk import reference as iref  # noqa: E402
from kimi_compile.plugins.indexer_topk import triton as itk  # noqa: E402
from kimi_compile.plugins.kda import reference as kref  # noqa: E402
from kimi_compile.plugins.kda import triton as ktk  # noqa: E402
from kimi_compile.plugins.quant import triton as qtk  # noqa: E402
from kimi_compile.plugins.quant.reference import mx_quantize_torch  # noqa: E402
from kimi_compile.plugins.sparse_mla import triton as mtk  # noqa: E402
from run_info import run_info  # noqa: E402

from bench import baselines as bl  # noqa: E402  (third-party kernels measured beside ours: bench/baselines)

DEV = "cuda"
RESULTS: dict = {}
ROWS: list = []
FLOOR = {"copy_GBps": None, "bf16_TFLOPs": None}
_FLUSH = None
FLUSH_MODE = "write"  # what flush=True means (--flush)


def log(*a):
    print(*a, flush=True)


def bench(fn, reps=30, graph=True, flush=True):
    """Median/p10/p90 microseconds of fn (CUDA events); graph=True times replays of a captured CUDA graph.
    flush: "write" (True, unless --flush read) zeroes a 256 MiB buffer before every run, as triton.testing.do_bench
    and DeepGEMM's benchmarks do; L2 is then full of dirty lines, which the timed run writes back as it evicts them.
    "read" reads the buffer instead (L2 left holding clean lines): the floors section measures what the difference
    costs a small read."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    if flush not in (False, True, "write", "read"):
        raise ValueError(f"bench: flush must be True, False, 'write' or 'read', got {flush!r}")
    if flush is True:
        flush = FLUSH_MODE
    sink = torch.empty((), dtype=torch.int64, device=DEV) if flush == "read" else None
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        fn()
        run = fn
    run()
    torch.cuda.synchronize()
    ev = []
    for _ in range(reps):
        if flush == "read":
            torch.sum(_FLUSH.view(torch.int64), 0, out=sink)
        elif flush:
            _FLUSH.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        ev.append((a, b))
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) * 1e3 for a, b in ev)
    return {"median_us": statistics.median(t), "p10_us": t[len(t) // 10], "p90_us": t[(9 * len(t)) // 10]}


def record(op, case, variant, shape, bytes_, flops, fn=None, timing=None, reps=30, graph=True, check=None, note=""):
    row = {"op": op, "case": case, "variant": variant, "shape": shape, "bytes": bytes_, "flops": flops,
           "graph": graph, "check": check, "note": note}
    try:
        if timing is None:
            timing = bench(fn, reps=reps, graph=graph)
        row.update(timing)
        t = row["median_us"] * 1e-6
        row["GBps"] = bytes_ / t / 1e9
        row["TFLOPs"] = flops / t / 1e12
        fb = bytes_ / (FLOOR["copy_GBps"] * 1e9) * 1e6
        ff = flops / (FLOOR["bf16_TFLOPs"] * 1e12) * 1e6
        row["floor_us"] = max(fb, ff)
        row["floor_bound"] = "bytes" if fb >= ff else "flops"
        row["ratio_to_floor"] = row["median_us"] / row["floor_us"]
        log(f"{op:12s} {case:22s} {variant:34s} {row['median_us']:10.1f} us  floor {row['floor_us']:8.1f}  "
            f"x{row['ratio_to_floor']:6.2f}  {'graph' if graph else 'direct'}  check={check}")
    except Exception as e:  # keep going: one failure must not lose the rest of the run
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        log(f"{op:12s} {case:22s} {variant:34s} ERROR {row['error'][:300]}")
        torch.cuda.synchronize()
    ROWS.append(row)
    return row


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------ floors
def floors():
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x), reps=20, graph=False, flush=False)
    FLOOR["copy_GBps"] = 2 * x.numel() / (t["median_us"] * 1e-6) / 1e9
    del x, y
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    t = bench(lambda: a @ b, reps=20, graph=False, flush=False)
    FLOOR["bf16_TFLOPs"] = 2 * n ** 3 / (t["median_us"] * 1e-6) / 1e12
    log(f"floors: copy {FLOOR['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {FLOOR['bf16_TFLOPs']:.0f} TFLOP/s")
    tiny = torch.zeros(1, device=DEV)
    t = bench(lambda: tiny.add_(1), reps=30, graph=True, flush=True)
    FLOOR["launch_us"] = t["median_us"]
    log(f"floors: one tiny kernel, graph replay after the L2 flush: {t['median_us']:.1f} us (launch + timing overhead)")
    # what the write flush costs a small kernel: a 16 MiB read (about the index-K bytes of B=1, L=128K) timed after
    # each flush; the write flush leaves L2 dirty, and the read's misses write those lines back first
    x = torch.empty(16 << 20, dtype=torch.uint8, device=DEV).random_()
    o = torch.empty((), dtype=torch.int64, device=DEV)
    for mode in ("write", "read"):
        t = bench(lambda: torch.sum(x.view(torch.int64), 0, out=o), reps=30, graph=True, flush=mode)
        FLOOR[f"read16MiB_{mode}_flush_us"] = t["median_us"]
    log(f"floors: a 16 MiB read after the write flush {FLOOR['read16MiB_write_flush_us']:.1f} us, after a read flush "
        f"{FLOOR['read16MiB_read_flush_us']:.1f} us")


# ------------------------------------------------------------------ indexer
def _paged_random(B, L, bs, gen_dev=DEV):
    nblk = (L + bs - 1) // bs
    perm = torch.randperm(B * nblk, device=gen_dev).int()
    return perm.view(B, nblk).contiguous(), B * nblk


def _strategies(codes, heads):
    """The indexer strategies that run here: the default ("gluon" where it applies) and the "triton" fallback."""
    return list(dict.fromkeys([itk.strategy_for(codes, heads), "triton"]))


def _baseline(lib: str, op: str, case: str, variant: str, rows) -> None:
    """Runs `rows()`, which records a third-party baseline's rows (bench/baselines); a baseline that cannot load or
    fails gets one error row instead, and the run goes on."""
    why = bl.unavailable(lib)
    if why is None:
        try:
            rows()
            return
        except Exception as e:  # noqa: BLE001 - a baseline failing must not lose our rows
            why = f"{type(e).__name__}: {e}"[:500]
            log(f"{lib} failed:", traceback.format_exc()[-800:])
    ROWS.append({"op": op, "case": case, "variant": variant, "error": why})
    log(f"{lib}:", why)


def _topk_overlap(idx, full_cpu, lens, topk) -> float:
    """Mean fraction of the exact fp32 top-k positions found in idx [B, topk] (positions >= 0)."""
    got = []
    for b, n in enumerate(lens):
        k = min(n, topk)
        exact = set(torch.topk(full_cpu[b, :n], k).indices.tolist())
        found = set(int(x) for x in idx[b].cpu().tolist() if x >= 0)
        got.append(len(exact & found) / k)
    return sum(got) / len(got)


def _deepgemm_rows(case, shape, q, w, codes, scales, bt, cl, L, topk, full_cpu, lens, args):
    """DeepGEMM's paged FP8 MQA logits (+ torch.topk) on the same cache, converted once (bench/baselines/deepgemm.py:
    q and K requantized to its per-token scale, so compare top-k overlap with the exact scores, not bits)."""
    def rows():
        kv = bl.to_deepgemm_cache(codes, scales)
        q8, w8 = bl.to_deepgemm_q(q[:, None], w[:, None])
        meta = bl.deepgemm_plan(cl)
        buf = torch.empty(q.shape[0], bl.lib("deepgemm").deepgemm_logits_stride(L), device=DEV)
        pos = torch.arange(L, device=DEV)

        def logits():
            return bl.deepgemm_paged_mqa_logits(q8, kv, w8, cl, bt, meta, L, out=buf)

        def with_topk():  # positions past each row's length masked (the kernel leaves them stale), then top-k
            x = logits()[:, :L].masked_fill(pos[None] >= cl[:, None], float("-inf"))
            return torch.topk(x, topk, dim=-1)

        chk = {"topk_overlap_with_exact": _topk_overlap(with_topk().indices, full_cpu, lens, topk)}
        bytes_ = int(cl.sum()) * 132 + q.numel() + q.shape[0] * topk * 8
        flops = 2 * int(cl.sum()) * q.shape[1] * 128
        record("indexer", case, "DeepGEMM fp8_paged_mqa_logits (logits only, schedule precomputed)", shape, bytes_,
               flops, logits, reps=args.reps, check=chk,
               note="their per-token-scale FP8 K (132 B/token, requantized from ours) and E4M3 q")
        record("indexer", case, "DeepGEMM fp8_paged_mqa_logits + mask + torch.topk", shape, bytes_, flops, with_topk,
               reps=args.reps, check=chk)

    _baseline("deepgemm", "indexer", case, "DeepGEMM fp8_paged_mqa_logits", rows)


def indexer_section(args):
    H, D, topk, bs = 64, 128, 2048, 64
    # the last two: a served model's cache is sized to its max_seq_len, not to the context (the small preset's
    # 139264 tokens), and the kernels' work split and threshold groups must follow each row's length
    for B, L, cap in ((32, 65536, 65536), (1, 131072, 131072), (32, 32768, 139264), (1, 32768, 139264)):
        case = f"B={B},L={L}" + (f",cap={cap}" if cap != L else "")
        bt, nb = _paged_random(B, L, bs)
        if cap > L:  # block-table columns past the context point at block 0 (never read)
            bt = torch.cat([bt, torch.zeros(B, (cap - L) // bs, dtype=bt.dtype, device=bt.device)], 1)
        codes = torch.empty(nb, bs, D, dtype=torch.uint8, device=DEV)
        scales = torch.empty(nb, bs, D // 32, dtype=torch.uint8, device=DEV)
        for i in range(0, nb * bs, 1 << 20):  # fill through our quantize kernel (random LayerNorm-like keys)
            n = min(1 << 20, nb * bs - i)
            k = torch.randn(n, D, device=DEV, dtype=torch.bfloat16)
            qtk.mxfp8_quantize_to_cache(k, torch.arange(i, i + n, device=DEV), codes, scales, "ceil")
        q = torch.randn(B, H, D, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(B, H, device=DEV) * H ** -0.5 * D ** -0.5
        cl = torch.full((B,), L, dtype=torch.int32, device=DEV)
        cl[0] = L - 777 if B > 1 else L
        rows = torch.arange(B, dtype=torch.int32, device=DEV)
        start, ones = (cl - 1).long(), torch.ones(B, dtype=torch.int64, device=DEV)  # the op's contract, T = 1
        shape = {"B": B, "L": L, "cap": cap, "H_I": H, "D_I": D, "topk": topk, "block_size": bs, "bytes_per_token": 132}
        bytes_ = int(cl.sum()) * 132 + q.numel() * 2 + w.numel() * 4 + B * topk * 8
        flops = 2 * int(cl.sum()) * H * D
        # fp32 reference scores for the check
        torch.backends.cuda.matmul.allow_tf32 = False
        full = torch.full((B, L), float("-inf"), device=DEV, dtype=torch.float64)
        for b in range(B):
            n = int(cl[b])
            pos = torch.arange(n, device=DEV)
            rws = bt[b].long()[pos // bs] * bs + pos % bs
            kf = (codes.view(-1, D)[rws].view(torch.float8_e4m3fn).float().view(n, 4, 32)
                  * torch.exp2(scales.view(-1, 4)[rws].float() - 127)[..., None]).view(n, D)
            full[b, :n] = ((kf @ q[b].float().T).relu() * w[b][None]).sum(-1).double()
        full_cpu = full.cpu()
        del full
        lens = [int(x) for x in cl.cpu()]
        for strat in _strategies(codes, H):
            try:
                oi = torch.full((B, topk), -7, dtype=torch.int32, device=DEV)
                os_ = torch.full((B, topk), float("nan"), device=DEV)
                for _ in range(2):  # twice: the self-cleaning workspace must be reusable
                    oi.fill_(-7)
                    os_.fill_(float("nan"))
                    itk.indexer_topk_rows(q, w, codes, scales, bt, rows, cl, topk, strategy=strat, out=(oi, os_))
                torch.cuda.synchronize()
                chk = iref.check_topk(oi, os_, full_cpu, lens, topk)
            except Exception as e:
                chk = {"ok": False, "error": str(e)[:300]}
            record("indexer", case, f"ours {strat} (indexer_topk_rows: unsorted int32)", shape, bytes_, flops,
                   lambda s=strat: itk.indexer_topk_rows(q, w, codes, scales, bt, rows, cl, topk, strategy=s),
                   check=chk, reps=args.reps)
            record("indexer", case, f"ours {strat} score kernel only", shape, bytes_, flops,
                   lambda s=strat: itk.indexer_scores(q, w, codes, scales, bt, rows, cl, topk, strategy=s),
                   reps=args.reps, note="stage timing: scores + group maxima, no selection")
        if cap == L:
            _deepgemm_rows(case, shape, q, w, codes, scales, bt, cl, L, topk, full_cpu, lens, args)
        try:
            ci, cs = itk.indexer_topk(q[:, None], w[:, None], codes, scales, bt, start, ones, topk)
            torch.cuda.synchronize()
            chk = iref.check_topk(ci[:, 0], cs[:, 0], full_cpu, lens, topk)
        except Exception as e:
            chk = {"ok": False, "error": str(e)[:300]}
        record("indexer", case, "ours indexer_topk (the op's contract: rows set-up, kernels, rank order)", shape,
               bytes_, flops, lambda: itk.indexer_topk(q[:, None], w[:, None], codes, scales, bt, start, ones, topk),
               check=chk, reps=args.reps, note="minus the indexer_topk_rows row: the row set-up and rank kernels' cost")
        try:
            ui, us = itk.indexer_topk(q[:, None], w[:, None], codes, scales, bt, start, ones, topk, sort=False)
            torch.cuda.synchronize()
            chk = iref.check_topk(ui[:, 0], us[:, 0], full_cpu, lens, topk)
        except Exception as e:
            chk = {"ok": False, "error": str(e)[:300]}
        record("indexer", case, "ours indexer_topk sorted=0 (the op as relax_topk_order leaves it: rows set-up, "
               "kernels, no rank order)", shape, bytes_, flops,
               lambda: itk.indexer_topk(q[:, None], w[:, None], codes, scales, bt, start, ones, topk, sort=False),
               check=chk, reps=args.reps, note="what the served decode runs where only SparseMLA reads the selection")
        if args.quick:
            del codes, scales
            torch.cuda.empty_cache()
            flush_json(args)
            continue
        eager = lambda: iref.indexer_topk_decode_eager(q, w, codes, scales, bt, cl, topk, max_context_len=L)
        ei, ev = eager()
        echk = iref.check_topk(ei, ev.double(), full_cpu, lens, topk, rtol=1e-2)
        record("indexer", case, "eager unfused bf16 (torch.topk)", shape, bytes_, flops, eager, graph=False,
               reps=max(5, args.reps // 3), check=echk)
        record("indexer", case, "eager unfused bf16 (torch.topk)", shape, bytes_, flops, eager, graph=True,
               reps=max(5, args.reps // 3), check=echk)
        sc_only = torch.randn(B, L, device=DEV)
        record("indexer", case, "torch.topk alone on [B,L] fp32", shape, B * L * 4, 0,
               lambda: torch.topk(sc_only, topk, dim=-1), graph=True, reps=args.reps)
        if not args.no_compile:
            comp = torch.compile(iref.indexer_topk_decode_eager, dynamic=False)
            record("indexer", case, "torch.compile(eager)", shape, bytes_, flops,
                   lambda: comp(q, w, codes, scales, bt, cl, topk, max_context_len=L), graph=True,
                   reps=max(5, args.reps // 3))
        del codes, scales
        torch.cuda.empty_cache()
        flush_json(args)
    if args.skip_prefill:
        return
    # prefill: one sequence of T new tokens, query t sees positions s <= t (the op's contract, one row per query)
    T = 4096
    bt, nb = _paged_random(1, T, bs)
    codes = torch.empty(nb, bs, D, dtype=torch.uint8, device=DEV)
    scales = torch.empty(nb, bs, D // 32, dtype=torch.uint8, device=DEV)
    k = torch.randn(nb * bs, D, device=DEV, dtype=torch.bfloat16)
    qtk.mxfp8_quantize_to_cache(k, torch.arange(nb * bs, device=DEV), codes, scales, "ceil")
    q = torch.randn(1, T, H, D, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(1, T, H, device=DEV) * 0.01
    st, ln = torch.zeros(1, dtype=torch.int64, device=DEV), torch.full((1,), T, dtype=torch.int64, device=DEV)
    pairs = T * (T + 1) // 2
    record("indexer", f"prefill T={T}", "ours indexer_topk (rows = T queries)", {"T": T, "topk": topk},
           T * 132 + q.numel() * 2, 2 * pairs * H * D,
           lambda: itk.indexer_topk(q, w, codes, scales, bt, st, ln, topk), graph=True, reps=10,
           note="the decode kernels with one row per query token; no query tiling (K re-read per row from L2)")
    flush_json(args)


# ------------------------------------------------------------------ sparse MLA
def _mla_pools(n, bs, scale=1.0):
    """The three latent-cache pools (plugins/sparse_mla/triton.py's layout) for n tokens, filled through our
    quantize kernel with random rows."""
    nb = (n + bs - 1) // bs
    kc = torch.empty(nb, bs, 512, dtype=torch.uint8, device=DEV)
    ks = torch.empty(nb, bs, 4, dtype=torch.uint8, device=DEV)
    kr = torch.empty(nb, bs, 64, dtype=torch.bfloat16, device=DEV)
    for i in range(0, nb * bs, 1 << 20):
        m = min(1 << 20, nb * bs - i)
        c = torch.randn(m, 512, device=DEV, dtype=torch.bfloat16) * scale
        pe = torch.randn(m, 64, device=DEV, dtype=torch.bfloat16) * scale
        qtk.mla_fp8_quantize_to_cache(c, pe, torch.arange(i, i + m, device=DEV), kc, ks, kr)
    return kc, ks, kr


def _mla_rows(kc, ks, kr, bt, idx):
    """Gathered rows of the selected positions idx [B, k]: (c float32 [B, k, 512], pe float32 [B, k, 64], valid)."""
    bs = kc.shape[1]
    valid = idx >= 0
    i = idx.clamp_min(0).long()
    row = torch.gather(bt.long(), 1, i // bs) * bs + i % bs
    B, K = idx.shape
    codes = kc.view(-1, 512)[row].view(torch.float8_e4m3fn).float().view(B, K, 4, 128)
    c = (codes * torch.exp2(ks.view(-1, 4)[row].float() - 127)[..., None]).view(B, K, 512)
    return c, kr.view(-1, 64)[row].float(), valid


def mla_eager(q, kc, ks, kr, bt, idx, sm):
    """Eager unfused baseline on the same pools: gather rows, dequantize to bf16, bf16 bmm, fp32 softmax, bmm."""
    c, pe, valid = _mla_rows(kc, ks, kr, bt, idx)
    kfull = torch.cat([c.bfloat16(), pe.bfloat16()], -1)  # [B, K, 576]
    s = torch.bmm(q, kfull.transpose(1, 2)).float() * sm  # [B, H, K]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.bmm(p.bfloat16(), c.bfloat16())


def _flashmla_rows(case, shape, q4, kc, ks, kr, bt, idx3, sm, ref, bytes_, flops, args):
    """FlashMLA's sparse FP8 decode on the same latent cache converted once to its 656-byte rows (exact: E8M0 scales
    as fp32) and the same selection as global rows; its split schedule is computed once, as a model does per step."""
    def rows():
        B, _, H, _ = q4.shape
        kv = bl.to_flashmla_cache(kc, ks, kr)
        sel = bl.to_flashmla_indices(idx3, bt, kc.shape[1])
        plan = bl.flashmla_plan(B, 1, H, idx3.shape[-1])
        out = torch.empty(B, 1, H, 512, dtype=torch.bfloat16, device=DEV)
        fn = lambda: bl.flashmla_sparse_decode(q4, kv, sel, sm, plan, out=out)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        err = rel(out[:, 0], ref)
        record("sparse_mla", case, "FlashMLA sparse FP8 decode (schedule precomputed)", shape,
               bytes_ + B * idx3.shape[-1] * 12, flops, fn, reps=args.reps, check={"ok": err < 1e-2, "rel_err": err},
               note="656-byte rows (fp32 tile scales); the same attention as ours")

    _baseline("flashmla", "sparse_mla", case, "FlashMLA sparse FP8 decode", rows)


def mla_section(args):
    H, topk, bs, ctx = 128, 2048, 64, 16384
    for B in (32, 1):
        case = f"B={B},topk={topk}"
        bt, nb = _paged_random(B, ctx, bs)
        kc, ks, kr = _mla_pools(nb * bs, bs)
        idx = torch.rand(B, ctx, device=DEV).argsort(-1)[:, :topk].contiguous()
        q = (torch.randn(B, H, 576, device=DEV) * 0.3).bfloat16()
        sm = 576 ** -0.5
        shape = {"B": B, "H": H, "topk": topk, "d_qk": 576, "d_v": 512, "bytes_per_token": 512 + 4 + 128,
                 "layout": "three pools: E4M3 codes [NB,BS,512] u8, E8M0 scales [NB,BS,4] u8, rope [NB,BS,64] bf16"}
        bytes_ = B * topk * 644 + q.numel() * 2 + B * H * 512 * 2 + B * topk * 8
        flops = 2 * B * H * topk * (576 + 512)
        # fp32 reference
        torch.backends.cuda.matmul.allow_tf32 = False
        ck, kp, _ = _mla_rows(kc, ks, kr, bt, idx)
        s = (torch.bmm(q.float()[..., :512], ck.transpose(1, 2)) + torch.bmm(q.float()[..., 512:], kp.transpose(1, 2)))
        ref = torch.bmm(torch.softmax(s * sm, -1), ck)
        del ck, kp, s
        q4, idx3 = q[:, None], idx[:, None]
        try:
            out = torch.full((B, 1, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
            for _ in range(2):
                out.fill_(float("nan"))
                mtk.sparse_mla(q4, kc, ks, kr, bt, idx3, sm, out=out)
            torch.cuda.synchronize()
            err = rel(out[:, 0], ref)
            chk = {"ok": bool(err < 1e-2) and not bool(out.isnan().any()), "rel_err": err}
        except Exception as e:
            chk = {"ok": False, "error": str(e)[:300]}
        record("sparse_mla", case, "ours (two passes)", shape, bytes_, flops,
               lambda: mtk.sparse_mla(q4, kc, ks, kr, bt, idx3, sm), check=chk, reps=args.reps)
        _flashmla_rows(case, shape, q4, kc, ks, kr, bt, idx3, sm, ref, bytes_, flops, args)
        if args.quick:
            del kc, ks, kr
            torch.cuda.empty_cache()
            flush_json(args)
            continue
        eager = lambda: mla_eager(q, kc, ks, kr, bt, idx, sm)
        echk = {"rel_err": rel(eager(), ref)}
        record("sparse_mla", case, "eager gather+attention bf16", shape, bytes_, flops, eager, graph=False,
               check=echk, reps=max(5, args.reps // 3))
        record("sparse_mla", case, "eager gather+attention bf16", shape, bytes_, flops, eager, graph=True,
               check=echk, reps=max(5, args.reps // 3))
        if not args.no_compile:
            comp = torch.compile(mla_eager, dynamic=False)
            record("sparse_mla", case, "torch.compile(eager)", shape, bytes_, flops,
                   lambda: comp(q, kc, ks, kr, bt, idx, sm), graph=True, reps=max(5, args.reps // 3))
        del kc, ks, kr
        torch.cuda.empty_cache()
        flush_json(args)
    if args.skip_prefill:
        return
    # prefill: per query token its own set
    T, L = 1024, 8192
    bt, nb = _paged_random(1, L, bs)
    kc, ks, kr = _mla_pools(nb * bs, bs)
    idx = torch.rand(T, L, device=DEV).argsort(-1)[:, :topk].contiguous()[None]
    q = (torch.randn(1, T, H, 576, device=DEV) * 0.3).bfloat16()
    record("sparse_mla", f"prefill T={T}", "ours (rows = T queries)", {"T": T, "H": H, "topk": topk},
           T * topk * 644 + q.numel() * 2 + T * H * 1024, 2 * T * H * topk * 1088,
           lambda: mtk.sparse_mla(q, kc, ks, kr, bt, idx, 576 ** -0.5), graph=True, reps=10,
           note="gathered rows per query token (no cross-token KV reuse)")
    flush_json(args)


# ------------------------------------------------------------------ KDA decode
def kda_decode_section(args):
    H, D = 96, 128
    try:
        from fla.ops.kda import fused_recurrent_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:
        fused_recurrent_kda = fused_recurrent_kda_fwd = None
        log("fla not importable:", e)
    for B in (1, 64):
        case = f"B={B},H={H}"
        q = kref.l2norm_ref(torch.randn(B, H, D, device=DEV)).mul(D ** -0.5).bfloat16()
        k = kref.l2norm_ref(torch.randn(B, H, D, device=DEV)).bfloat16()
        v = torch.randn(B, H, D, device=DEV).bfloat16()
        g = (-5 * torch.rand(B, H, D, device=DEV))
        beta = torch.rand(B, H, device=DEV)
        S0 = torch.randn(B, H, D, D, device=DEV) * 0.1
        shape = {"B": B, "H": H, "Dk": D, "Dv": D, "state": "fp32 [B,H,K,V] in place"}
        bytes_ = 2 * S0.numel() * 4 + B * H * D * (2 * 4 + 4 + 2)
        flops = 6 * B * H * D * D
        ro = kref.kda_decode_eager(q, k, v, g, beta, S0.clone())
        rS = S0.clone()
        kref.kda_decode_eager(q, k, v, g, beta, rS)
        S = S0.clone()
        try:
            out = torch.full((B, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
            ktk.kda_decode_step(q, k, v, g, beta, S, out=out)
            torch.cuda.synchronize()
            chk = {"ok": rel(out, ro) < 1e-2 and rel(S, rS) < 1e-5, "rel_err_o": rel(out, ro),
                   "rel_err_state": rel(S, rS)}
        except Exception as e:
            chk = {"ok": False, "error": str(e)[:300]}
        for gr in (True, False):  # each launch mode beside fla's in the same mode
            record("kda_decode", case, "ours in place", shape, bytes_, flops,
                   lambda: ktk.kda_decode_step(q, k, v, g, beta, S), graph=gr, check=chk, reps=args.reps)
        if fused_recurrent_kda is not None:
            q4, k4, v4, g4, b4 = (x[:, None] for x in (q, k, v, g, beta))
            fo, fS = fused_recurrent_kda(q4, k4, v4, g4, b4, scale=1.0, initial_state=S0.clone(),
                                         output_final_state=True)
            fchk = {"rel_err_o_vs_ref": rel(fo[:, 0], ro), "rel_err_state": rel(fS, rS)}
            for gr in (True, False):
                record("kda_decode", case, "fla fused_recurrent_kda (new state)", shape, bytes_, flops,
                       lambda: fused_recurrent_kda(q4, k4, v4, g4, b4, scale=1.0, initial_state=S,
                                                   output_final_state=True), graph=gr, check=fchk, reps=args.reps)
                record("kda_decode", case, "fla fused_recurrent_kda_fwd (in place)", shape, bytes_, flops,
                       lambda: fused_recurrent_kda_fwd(q4, k4, v4, g4, b4, scale=1.0, initial_state=S,
                                                       inplace_final_state=True), graph=gr, reps=args.reps)
        eager = lambda: kref.kda_decode_eager(q, k, v, g, beta, S)
        record("kda_decode", case, "eager unfused fp32", shape, bytes_, flops, eager, graph=False, reps=args.reps)
        record("kda_decode", case, "eager unfused fp32", shape, bytes_, flops, eager, graph=True, reps=args.reps)
        if not args.no_compile:
            comp = torch.compile(kref.kda_decode_eager, dynamic=False)
            record("kda_decode", case, "torch.compile(eager)", shape, bytes_, flops,
                   lambda: comp(q, k, v, g, beta, S), graph=True, reps=args.reps)
        flush_json(args)


# ------------------------------------------------------------------ KDA prefill
def _flashkda_rows(case, shape, xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, core_bytes, flops, rp, H, D, T):
    """The KDA core on the same post-convolution inputs: fla's chunk_kda with its in-kernel L2 norm, safe gate and
    beta sigmoid beside FlashKDA's fwd (bench/baselines/flashkda.py), which does the same work; fp32 final states."""
    from fla.modules.causal_conv1d.ops import causal_conv1d
    from fla.ops.kda import chunk_kda

    cq, ck, cv = (causal_conv1d(x, wt, activation="silu")[0].view(1, T, H, D) for x, wt in
                  ((xq, wq), (xk, wk), (xv, wv)))
    g = f.view(1, T, H, D)

    def fla_core():
        return chunk_kda(cq, ck, cv, g, b, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias,
                         use_beta_sigmoid_in_kernel=True)

    record("kda_prefill", case, "fla chunk_kda (in-kernel l2/gate/beta), post-conv inputs", shape, core_bytes, flops,
           fla_core, graph=False, reps=rp)

    def rows():
        final = torch.empty(1, H, D, D, device=DEV)
        out = torch.empty_like(cv)
        ws = torch.empty(bl.flashkda.flashkda_workspace_bytes(T, H), dtype=torch.uint8, device=DEV)

        def fkda():
            return bl.flashkda_prefill(cq, ck, cv, g, b, D ** -0.5, A_log, dt_bias.view(H, D), -5.0,
                                       final_state=final, out=out, workspace=ws)

        fo, fS = fla_core()
        fkda()
        torch.cuda.synchronize()
        chk = {"rel_err_out_vs_fla": rel(out.float(), fo.float()),
               "rel_err_state_vs_fla": rel(final.transpose(-1, -2).float(), fS.float())}
        record("kda_prefill", case, "FlashKDA fwd (in-kernel l2/gate/beta), post-conv inputs", shape, core_bytes,
               flops, fkda, graph=False, reps=rp, check=chk)

    _baseline("flashkda", "kda_prefill", case, "FlashKDA fwd", rows)


def kda_prefill_section(args):
    D, T = 128, 32768
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda import chunk_kda
    except Exception as e:
        log("fla not importable, skipping KDA prefill:", e)
        return
    for H in (12, 96):
        case = f"B=1,T={T},H={H}"
        C = H * D
        torch.manual_seed(H)
        xq, xk, xv, f, gate = (torch.randn(1, T, C, device=DEV, dtype=torch.bfloat16) for _ in range(5))
        wq, wk, wv = (torch.randn(C, 4, device=DEV, dtype=torch.bfloat16) * 0.5 for _ in range(3))
        b = torch.randn(1, T, H, device=DEV, dtype=torch.bfloat16)
        A_log = torch.randn(H, device=DEV) * 0.5
        dt_bias = torch.randn(C, device=DEV) * 0.5
        ow = torch.ones(D, device=DEV, dtype=torch.bfloat16)
        shape = {"B": 1, "T": T, "H": H, "D": D, "chunk": 64}
        core_bytes = T * H * D * (2 * 4 + 4) + T * H * 4
        io_bytes = T * C * 2 * 5 + T * H * 2 + T * C * 2  # x q/k/v, f, gate, b in; out
        flops = 2 * H * (6 * T * D * D + 3 * T * 64 * D + T * 64 * 64)
        # ours takes the layer's inputs as the cuda backend has them: u = [xq | xk | xv], the conv weights stacked, a
        # carried window (zero: a first chunk), lengths, the state (zero) updated in place
        u = torch.cat([xq, xk, xv], -1)
        cw = torch.cat([wq, wk, wv], 0)
        window = torch.zeros(1, 3, 3 * C, device=DEV, dtype=torch.bfloat16)
        lengths = torch.full((1,), T, device=DEV, dtype=torch.int64)
        state = torch.zeros(1, H, D, D, device=DEV)
        pre = {"scale": D ** -0.5, "l2_eps": 1e-6}
        q, k, v, fm, beta = ktk.kda_prefill_prepare(u, window, cw, f, b, lengths, **pre)  # no padding: f untouched
        g = -5.0 * torch.sigmoid(A_log.exp().view(H, 1) * (fm.float() + dt_bias.view(H, D)))  # core-only row's gate
        del fm

        def fla_pipeline():
            cq = causal_conv1d(xq, wq, activation="silu")[0]
            ck = causal_conv1d(xk, wk, activation="silu")[0]
            cv = causal_conv1d(xv, wv, activation="silu")[0]
            o, st = chunk_kda(cq.view(1, T, H, D), ck.view(1, T, H, D), cv.view(1, T, H, D), f.view(1, T, H, D), b,
                              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias,
                              use_beta_sigmoid_in_kernel=True)
            return rms_norm_gated(o, gate.view(1, T, H, D), ow, None, activation="sigmoid", eps=1e-5), st

        def ours():
            return ktk.kda_prefill(u, window, cw, f, b, lengths, A_log, dt_bias, gate, ow, state, lower_bound=-5.0,
                                   eps=1e-5, **pre), state

        try:
            fo, fS = fla_pipeline()
            oo, oS = ours()
            chk = {"rel_err_out_vs_fla": rel(oo.view(-1), fo.reshape(-1)), "rel_err_state_vs_fla": rel(oS, fS)}
        except Exception as e:
            chk = {"error": str(e)[:300]}
        rp = max(3, args.reps // 6)
        record("kda_prefill", case, "fla chunk_kda core only (pre-activated inputs)", shape, core_bytes, flops,
               lambda: chunk_kda(q, k, v, g, beta, scale=1.0, output_final_state=True), graph=False, reps=rp)
        record("kda_prefill", case, "fla pipeline: conv x3 + chunk_kda(in-kernel l2/gate/beta) + rms_norm_gated",
               shape, core_bytes + io_bytes, flops, fla_pipeline, graph=False, reps=rp)
        record("kda_prefill", case,
               "ours: fused pre (carried window, lengths) + fla gate, intra + fused chunk recurrence + fused post",
               shape, core_bytes + io_bytes, flops, ours, graph=False, reps=rp, check=chk)
        _flashkda_rows(case, shape, xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, core_bytes, flops, rp, H, D, T)
        record("kda_prefill", case, "ours: fused pre-kernel alone", shape, T * C * 2 * 6 + T * H * 6, 0,
               lambda: ktk.kda_prefill_prepare(u, window, cw, f, b, lengths, **pre), graph=False, reps=rp)
        if H == 12 and not args.quick:  # --quick: ours and the published kernels only, no eager baseline
            try:
                from fla.ops.kda.naive import naive_chunk_kda

                def eager():
                    qq, kk, vv, gg, bb = kref.kda_prefill_preprocess_ref(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias)
                    o, st = naive_chunk_kda(qq, kk, vv, gg, bb, scale=1.0, output_final_state=True)
                    return kref.kda_output_norm_ref(o, gate, ow), st
                record("kda_prefill", case, "eager unfused torch (fla naive_chunk_kda + torch pre/post)", shape,
                       core_bytes + io_bytes, flops, eager, graph=False, reps=2)
            except Exception as e:
                log("eager prefill failed:", e)
        del xq, xk, xv, f, gate, q, k, v, g, beta, u, state
        torch.cuda.empty_cache()
        flush_json(args)


# ------------------------------------------------------------------ quantize
def quant_section(args):
    N, bs = 131072, 64
    x = torch.randn(N, 128, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(N, device=DEV)
    codes = torch.empty(N // bs, bs, 128, dtype=torch.uint8, device=DEV)
    scales = torch.empty(N // bs, bs, 4, dtype=torch.uint8, device=DEV)
    for rnd in ("floor", "ceil"):
        qtk.mxfp8_quantize_to_cache(x, slots, codes, scales, rnd)
        rc, rs = mx_quantize_torch(x[:4096].float().cpu(), block=32, rounding=rnd)
        gc = codes.view(-1, 128)[slots[:4096]].cpu()
        gs = scales.view(-1, 4)[slots[:4096]].cpu()
        chk = {"ok": bool(torch.equal(gs, rs)) and bool(torch.equal(gc, rc)),
               "code_match": float((gc == rc).float().mean())}
        record("quant", f"mxfp8 index-K N={N}", f"ours rounding={rnd}", {"N": N, "D": 128}, N * (256 + 132 + 8), 0,
               lambda rnd=rnd: qtk.mxfp8_quantize_to_cache(x, slots, codes, scales, rnd), check=chk, reps=args.reps)
    c = torch.randn(N, 512, device=DEV, dtype=torch.bfloat16)
    pe = torch.randn(N, 64, device=DEV, dtype=torch.bfloat16)
    kc = torch.empty(N // bs, bs, 512, dtype=torch.uint8, device=DEV)
    ks = torch.empty(N // bs, bs, 4, dtype=torch.uint8, device=DEV)
    kr = torch.empty(N // bs, bs, 64, dtype=torch.bfloat16, device=DEV)
    qtk.mla_fp8_quantize_to_cache(c, pe, slots, kc, ks, kr)
    rc, rs = mx_quantize_torch(c[:2048].float().cpu(), block=128, rounding="ceil")
    got = slots[:2048]
    chk = {"ok": bool(torch.equal(kc.view(-1, 512)[got].cpu(), rc)) and bool(torch.equal(ks.view(-1, 4)[got].cpu(), rs))
           and bool(torch.equal(kr.view(-1, 64)[got].cpu(), pe[:2048].cpu())),
           "code_match": float((kc.view(-1, 512)[got].cpu() == rc).float().mean())}
    record("quant", f"mla latent N={N}", "ours (codes, E8M0 tile-128 scales, bf16 rope pools)", {"N": N},
           N * (1152 + 644 + 8), 0, lambda: qtk.mla_fp8_quantize_to_cache(c, pe, slots, kc, ks, kr), check=chk,
           reps=args.reps)
    flush_json(args)


# ------------------------------------------------------------------ Block Attention Residuals
def attn_res_section(args):
    """kimi.AttnResMerge / AttnResStage1: the Triton kernel (the cuda backend's default) beside the torch form it
    replaced (plugins/attn_res/cuda.py, the fallback), both replayed as CUDA graphs, bf16, at the small preset's
    D = 2048 and the released D = 7168; decode rows (T = 1) and one 4096-token prefill chunk."""
    eps, neps = 1e-6, 1e-5
    for D in (2048, 7168):
        for B, T in ((1, 1), (8, 1), (32, 1), (1, 4096)):
            g = torch.Generator(device=DEV).manual_seed(B * 7 + T + D)
            Lq, K, slot = 4, 4, 1
            bf = torch.bfloat16
            o1 = torch.randn(Lq, B, T, D, device=DEV, dtype=bf, generator=g)
            m1 = torch.randn(Lq, B, T, device=DEV, generator=g)
            l1 = torch.rand(Lq, B, T, device=DEV, generator=g) * 3 + 1
            p = torch.randn(B, T, D, device=DEV, dtype=bf, generator=g)
            q = torch.randn(D, device=DEV, dtype=bf, generator=g) * 0.05
            w = torch.rand(D, device=DEV, dtype=bf, generator=g) + 0.5
            a = {"slot": slot, "eps": eps, "norm_eps": neps}
            x = [o1, m1, l1, p, q, w]
            want = acuda.merge([t.float() for t in x], a)[0]
            got = atk.attn_res_merge(o1, m1, l1, p, q, w, slot, eps, neps)
            chk = {"rel_err_vs_fp32_torch": rel(got.float(), want)}
            case = f"merge D={D} B={B} T={T}"
            nbytes = (2 * B * T * D * 2) + B * T * D * 2 + 4 * D
            record("attn_res", case, "torch form (fallback)", {"B": B, "T": T, "D": D}, nbytes, 0,
                   lambda x=x, a=a: acuda.merge(x, a), reps=args.reps)
            record("attn_res", case, "triton.attn_res_merge", {"B": B, "T": T, "D": D}, nbytes, 0,
                   lambda x=x: atk.attn_res_merge(*x, slot, eps, neps), check=chk, reps=args.reps)
            bank = torch.randn(K, B, T, D, device=DEV, dtype=bf, generator=g)
            qs = torch.randn(Lq, D, device=DEV, dtype=bf, generator=g) * 0.05
            want = acuda.stage1([bank.float(), qs.float()], {"eps": eps})
            got = atk.attn_res_stage1(bank, qs, eps)
            chk = {"rel_err_vs_fp32_torch": max(rel(g_.float(), w_) for g_, w_ in zip(got, want))}
            case = f"stage1 K={K} L={Lq} D={D} B={B} T={T}"
            nbytes = (K + Lq) * B * T * D * 2 + Lq * D * 2
            record("attn_res", case, "torch form (fallback)", {"B": B, "T": T, "D": D, "K": K, "L": Lq}, nbytes, 0,
                   lambda bank=bank, qs=qs: acuda.stage1([bank, qs], {"eps": eps}), reps=args.reps)
            record("attn_res", case, "triton.attn_res_stage1", {"B": B, "T": T, "D": D, "K": K, "L": Lq}, nbytes, 0,
                   lambda bank=bank, qs=qs: atk.attn_res_stage1(bank, qs, eps), check=chk, reps=args.reps)
    flush_json(args)


def flush_json(args):
    RESULTS["rows"] = ROWS
    RESULTS["floors"] = FLOOR
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(RESULTS, fh, indent=1, default=str)
    os.replace(tmp, args.out)  # a reader never sees a half-written file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"),
                                                  f"gpu_kernels_{datetime.date.today().isoformat()}.json"))
    ap.add_argument("--sections", default="floors,indexer,mla,kda_decode,quant,kda_prefill")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="ours only: no eager / torch.compile baselines")
    ap.add_argument("--skip-prefill", action="store_true", help="skip the indexer / sparse MLA prefill rows")
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="how the L2 is flushed before each timed run: zero a 256 MiB buffer (write: the usual way, "
                         "L2 left dirty) or read it (L2 left clean)")
    args = ap.parse_args()
    global FLUSH_MODE
    FLUSH_MODE = args.flush
    RESULTS.update(run_info("torch", "triton", "fla-core", "flash-linear-attention"))
    RESULTS["timing"] = (f"CUDA events, median over reps; 256 MiB L2 flush ({args.flush}: "
                         f"{'zeroed' if args.flush == 'write' else 'read'}) before each rep; graph = CUDA graph replay")
    secs = args.sections.split(",")
    if "floors" not in secs:
        secs = ["floors"] + secs
    t0 = time.time()
    for s in secs:
        log(f"== {s} (t={time.time() - t0:.0f}s)")
        try:
            {"floors": floors, "indexer": lambda: indexer_section(args), "mla": lambda: mla_section(args),
             "kda_decode": lambda: kda_decode_section(args), "kda_prefill": lambda: kda_prefill_section(args),
             "quant": lambda: quant_section(args), "attn_res": lambda: attn_res_section(args)}[s]()
        except Exception:
            log(traceback.format_exc())
        flush_json(args)
    log(f"done in {time.time() - t0:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
