"""Triton kernels: fused lightning indexer over the paged MXFP8 index-K cache (score + ReLU + weights + top-k).

Semantics: plugins/indexer_topk/torch_ref.py. No host sync, CUDA-graph capturable. impl "v1" (first pass), five launches:
1. `_score_kernel` (grid rows x splits): per 64-token tile, gather codes/scales through the block table, four
   bf16 tensor-core dots [BN,32]x[32,H] (E4M3 codes are exact in bf16) each scaled by its E8M0 group scale, ReLU,
   head weighting, head sum -> fp32 score; writes scores to a workspace row and a 256-bin histogram of the top 8
   bits of the order-preserving int32 key (one masked vector atomic per program).
2-5. radix select with 8-bit digits over the L2-resident scores: passes 2-4 recompute the threshold digit of the
   previous level from the remaining k and histogram the next digit of the keys sharing the prefix; pass 5 writes
   every key above the exact threshold key plus the needed number of ties (atomic slot counters), and -1 / -inf
   padding past min(topk, len). (256 bins: tl.histogram costs ~bins/32 ops per element, so 4 x 8 bits beats
   3 x 11 bits by ~5x.)
Workspace histograms/counters clean themselves (pass 2 zeroes hist3 + counters, pass 3 hist1 + hist4, pass 4 hist2,
pass 5 hist3), so a workspace must not serve two calls in flight on different streams. Output order is unspecified.

impl "v2" (default in the second pass; `_score2_kernel`, `_cand_kernel`, `_final_kernel`), three launches:
1. score: per tile of 128 keys the E4M3 codes go to fp16 (one cvt per code pair), each 32-group pre-scaled by
   2^(e_g - e_max) (exact above fp16's range floor), one fp16 tensor-core dot chain against q scaled by a power of two
   (exact), relu, weights, head sum, times 2^(e_max - 127); manual prefetch (codes of tile t+1, block-table rows of
   tile t+2 in flight while tile t computes). Writes scores and the max of every group of G positions (G ~ L/(2k)).
2. threshold + candidates: T = top 16 bits of the k-th largest group max (bisection over the register-resident group
   maxima): at least k scores are >= T, so every top-k score is a candidate; each program of the row recomputes T
   and appends its slice's candidates (atomic slot counter). Typically ~1.2-1.5 k candidates.
3. exact select among the candidates, one program per row: bisection for the k-th key, ties to the lower position
   (a second bisection on position), deterministic slots (cumsum); resets the counter.
impl "v3" (default since the third pass; `_score3_kernel` + v2's `_cand_kernel` / `_final_kernel`): one tile per cache
page; the page's four [BS, 32] code groups arrive by TMA (fp8 descriptor over the pool, Hopper+) or plain loads,
software-pipelined by tl.range; the four E8M0 scales load as one int32 per row (cp.async-able); a program's
block-table entries load once up front. Same fp16 math as v2. Measured on the H200 (bench/results/
gpu_kernels_2026-12-02_v3.json): score kernel 143 us vs v2's 191 us at B=32 L=64K, 17 us vs 24 us at B=1 L=128K.
Since the fifth pass v3 runs one page per iteration with three stages: Triton issues the next TMA loads at the end of
the loop body, so with two stages (one buffer) their latency was exposed (bench/results/gpu_kernels_2026-12-02_v9.json:
B=32 153.4 vs 160.0 us, score kernel 124.6 vs 131.3 us).
The exact select stops its bisection as soon as exactly k keys are >= mid, and a row with at most k candidates takes
them all without a search (ncu, B=1: 11.1 us vs 12.4 before).
Tried on the H200 and dropped (correct, slower; bench/results/gpu_kernels_2026-12-02_v3.json): radix selects (8-bit
tl.histogram, 4-bit comparison counts; 4x slower than the bisection), the final selection in the row's last program,
one K=128 dot instead of four chained K=32 dots (no gain). Also dropped after the fourth pass
(bench/results/gpu_kernels_2026-12-02_v5.json, ncu_indexer_2026-12-02_v5.json): a histogram-guided select (group
maxima counted by the top 12 key bits in the score kernel, candidates binned for the final search): B=1 34.5 vs
35.0 us, B=32 165.8 vs 159.9 us (the score kernel's atomics cost more than the shorter searches save: the selects
are latency chains of loads, atomics and barriers, ~10 us each at B=1 whatever the step count); and the page's
scales by TMA (B=32 227.6 vs 165.8 us); programmatic dependent launch of the two select kernels
(bench/results/gpu_kernels_2026-12-02_v6.json: B=1 38.0 vs 34.0 us, B=32 165.8 vs 160.1 us).
Power-of-two cache pages in [16, 256] only; other page sizes fall back to v2.
impl "v4" (the default since 2026-12-03 where it applies; plugins/indexer_topk/gluon.py): the score kernel
rewritten in Gluon (explicit layouts, shared memory and barriers): per 64-key page one TMA for the codes and one for
the scales on one mbarrier, two thread barriers instead of ~12, and a fixed permutation of each code group's 32
positions (applied to q too, so the dot is unchanged) that makes a thread's codes 8 consecutive bytes (64-bit
shared loads); ~35% fewer instructions per page than v3, 96 registers. Same select kernels. H200
(bench/results/gpu_kernels_2026-12-03_v13.json, side by side): B=32 L=64K 123.8 us vs v3 153.3 (score kernel 94.8
vs 124.7), B=1 L=128K 33.1 vs 36.0 (14.9 vs 17.9). Measured and not kept as defaults: 3 or 4 ring slots (B=32
125.9 / 129.6 us; the page loop is unrolled once per slot), 5 programs per SM (126.1), 4 candidate programs per SM
(132.3); without the permutation / scale TMA 128.9 us (v12.json: the first v4); the previous page's epilogue
software-pipelined between this page's async wgmmas and their wait, 127.0 us (v15.json; 128 registers); two
pages per ring slot (twice the bytes in flight, no more unrolling), 127.8 us (v16.json). Hopper+, 64-key pages and 64
index heads; elsewhere v4 falls back to v3.
`indexer_topk_decode_onnx_contract` adapts the output to kimi.IndexerTopK's contract (int64, sorted, -1 / -1e30).
"""

from __future__ import annotations

import torch

NBIN = 256  # radix digit: 8 bits, 4 levels over the 32-bit key
_HIST_W = 4 * NBIN


try:  # triton is optional: importing this module on a CPU machine without it must work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    _NB = tl.constexpr(NBIN)
    _HW = tl.constexpr(_HIST_W)

    @triton.jit
    def _key(x):
        i = x.to(tl.int32, bitcast=True)
        return tl.where(i < 0, i ^ 0x7FFFFFFF, i)

    @triton.jit
    def _find_bin(hist, krem, NB: tl.constexpr):
        idx = tl.arange(0, NB)
        cs = tl.cumsum(hist, 0)
        tot = tl.sum(hist, 0)
        ge = tot - cs + hist
        t = tl.max(tl.where(ge >= krem, idx, -1), 0)
        above = tl.sum(tl.where(idx > t, hist, 0), 0)
        return t, krem - above

    @triton.jit
    def _score_kernel(Q, W, KC, KS, BT, ROW_SEQ, ROW_LEN, SC, HIST, stride_bt, cap, tiles_per_prog,
                      BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, HIST_ON: tl.constexpr):
        r = tl.program_id(0)
        s = tl.program_id(1)
        L = tl.load(ROW_LEN + r)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        h = tl.arange(0, H)
        d = tl.arange(0, 32)
        n = tl.arange(0, BN)
        qb = Q + r.to(tl.int64) * H * D + h[None, :] * D + d[:, None]  # q^T group tiles [32, H]
        q0 = tl.load(qb + 0)
        q1 = tl.load(qb + 32)
        q2 = tl.load(qb + 64)
        q3 = tl.load(qb + 96)
        wv = tl.load(W + r * H + h).to(tl.float32)
        hist = tl.zeros([_NB], dtype=tl.int32)
        t0 = s * tiles_per_prog
        t1 = tl.minimum(t0 + tiles_per_prog, tl.cdiv(L, BN))
        for t in range(t0, t1):
            pos = t * BN + n
            valid = pos < L
            blk = tl.load(BT + seq * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
            row = blk * BS + (pos % BS)
            cp = KC + row[:, None] * D + d[None, :]
            sp = KS + row * (D // 32)
            c0 = tl.load(cp + 0, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            c1 = tl.load(cp + 32, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            c2 = tl.load(cp + 64, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            c3 = tl.load(cp + 96, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            s0 = (tl.load(sp + 0, mask=valid, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            s1 = (tl.load(sp + 1, mask=valid, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            s2 = (tl.load(sp + 2, mask=valid, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            s3 = (tl.load(sp + 3, mask=valid, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            acc = tl.dot(c0, q0) * s0[:, None]
            acc += tl.dot(c1, q1) * s1[:, None]
            acc += tl.dot(c2, q2) * s2[:, None]
            acc += tl.dot(c3, q3) * s3[:, None]
            sc = tl.sum(tl.maximum(acc, 0.0) * wv[None, :], 1)
            tl.store(SC + r.to(tl.int64) * cap + pos, sc, mask=valid)
            if HIST_ON:
                hist += tl.histogram((_key(sc) >> 24) + 128, _NB, mask=valid)
        if HIST_ON:
            tl.atomic_add(HIST + r * _HW + tl.arange(0, _NB), hist, mask=hist > 0, sem="relaxed")

    @triton.jit
    def _select_kernel(SC, HIST, ST, OUT_I, OUT_S, ROW_LEN, cap, chunk, topk,
                       PASS: tl.constexpr, BLK: tl.constexpr, KP2: tl.constexpr):
        # PASS 2..4: threshold digit of level PASS-1, histogram of level PASS; PASS 5: emit.
        r = tl.program_id(0)
        s = tl.program_id(1)
        L = tl.load(ROW_LEN + r)
        keff = tl.minimum(L, topk)
        hrow = HIST + r * _HW
        st = ST + r * 8
        ar = tl.arange(0, _NB)
        if PASS == 2:
            T, krem = _find_bin(tl.load(hrow + ar), keff, _NB)
            P = T - 128
        else:
            T, krem = _find_bin(tl.load(hrow + (PASS - 2) * _NB + ar), tl.load(st + 2 * (PASS - 3) + 1), _NB)
            P = tl.load(st + 2 * (PASS - 3)) * 256 + T
        if PASS < 5:
            if s == 0:
                tl.store(st + 2 * (PASS - 2), P)
                tl.store(st + 2 * (PASS - 2) + 1, krem)
                if PASS == 2:
                    tl.store(hrow + 2 * _NB + ar, tl.zeros([_NB], tl.int32))
                    tl.store(st + 6, 0)
                    tl.store(st + 7, 0)
                elif PASS == 3:
                    tl.store(hrow + ar, tl.zeros([_NB], tl.int32))
                    tl.store(hrow + 3 * _NB + ar, tl.zeros([_NB], tl.int32))
                else:
                    tl.store(hrow + _NB + ar, tl.zeros([_NB], tl.int32))
            h = tl.zeros([_NB], dtype=tl.int32)
        else:
            thr = P
            ties = krem
            ngt = keff - ties
            if s == 0:
                tl.store(hrow + 2 * _NB + ar, tl.zeros([_NB], tl.int32))
                kk = tl.arange(0, KP2)
                pm = (kk >= keff) & (kk < topk)
                tl.store(OUT_I + r.to(tl.int64) * topk + kk, tl.full([KP2], -1, tl.int32), mask=pm)
                tl.store(OUT_S + r.to(tl.int64) * topk + kk, tl.full([KP2], float("-inf"), tl.float32), mask=pm)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, L)
        for p0 in range(lo, hi, BLK):
            pos = p0 + tl.arange(0, BLK)
            valid = pos < hi
            x = tl.load(SC + r.to(tl.int64) * cap + pos, mask=valid, other=float("-inf"))
            kk = _key(x)
            if PASS < 5:
                member = valid & ((kk >> (32 - 8 * (PASS - 1))) == P)
                h += tl.histogram((kk >> (32 - 8 * PASS)) & 255, _NB, mask=member)
            else:
                gt = valid & (kk > thr)
                gi = gt.to(tl.int32)
                base = tl.atomic_add(st + 6, tl.sum(gi, 0), sem="relaxed")
                slot = base + tl.cumsum(gi, 0) - 1
                o = r.to(tl.int64) * topk + slot
                tl.store(OUT_I + o, pos, mask=gt)
                tl.store(OUT_S + o, x, mask=gt)
                eq = valid & (kk == thr)
                ei = eq.to(tl.int32)
                tb = tl.atomic_add(st + 7, tl.sum(ei, 0), sem="relaxed")
                rank = tb + tl.cumsum(ei, 0) - 1
                take = eq & (rank < ties)
                o2 = r.to(tl.int64) * topk + ngt + rank
                tl.store(OUT_I + o2, pos, mask=take)
                tl.store(OUT_S + o2, x, mask=take)
        if PASS < 5:
            tl.atomic_add(hrow + (PASS - 1) * _NB + ar, h, mask=h > 0, sem="relaxed")


    # ------------------------------------------------------------------ v2: fp16 tensor cores + threshold select
    @triton.jit
    def _unkey(k):
        return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)

    @triton.jit
    def _pow2(e):  # 2^e as fp32 for integer e (clamped to the normal range; below it flushes to 0)
        return (tl.minimum(tl.maximum(e + 127, 0), 254) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _tile_rows(BT, seq, stride_bt, t, L, t1, n, BS: tl.constexpr, BN: tl.constexpr):
        pos = t * BN + n
        valid = (pos < L) & (t < t1)
        blk = tl.load(BT + seq * stride_bt + pos // BS, mask=valid, other=0).to(tl.int64)
        return blk * BS + (pos % BS), valid

    @triton.jit
    def _q_fp16(Q, W, r, h, d, H: tl.constexpr):
        # q^T of row r as four [32, H] fp16 group tiles, scaled by a power of two into fp16 range (exact for bf16
        # q), and the head weights with that power of two taken back out
        qb = Q + r.to(tl.int64) * H * 128 + h[None, :] * 128 + d[:, None]
        q0 = tl.load(qb + 0).to(tl.float32)
        q1 = tl.load(qb + 32).to(tl.float32)
        q2 = tl.load(qb + 64).to(tl.float32)
        q3 = tl.load(qb + 96).to(tl.float32)
        qmax = tl.max(tl.max(tl.maximum(tl.maximum(tl.abs(q0), tl.abs(q1)), tl.maximum(tl.abs(q2), tl.abs(q3))), 1), 0)
        qe = ((qmax.to(tl.int32, bitcast=True) >> 23) & 255) - 127
        shift = tl.where(qmax > 0, 8 - qe, 0)
        shift = tl.minimum(tl.maximum(shift, -120), 120)
        qs = _pow2(shift)
        wv = tl.load(W + r * H + h).to(tl.float32) * _pow2(-shift)
        return ((q0 * qs).to(tl.float16), (q1 * qs).to(tl.float16), (q2 * qs).to(tl.float16),
                (q3 * qs).to(tl.float16), wv)

    @triton.jit
    def _score2_kernel(Q, W, KC, KS, BT, ROW_SEQ, ROW_LEN, SC, GM, stride_bt, cap, ngcap, tiles_per_prog,
                       BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
        # Per tile of BN keys: E4M3 codes -> fp16 (one cvt per 2 codes), each 32-group pre-scaled by
        # 2^(e_g - e_max) (exact unless below fp16 range), one fp16 tensor-core dot chain [BN,128]x[128,H] against
        # q (scaled by a power of two into fp16 range, exact), relu, head weights, head sum, times 2^(e_max-127).
        # Manual software pipeline: codes of tile t+1 and the block-table rows of tile t+2 are in flight while
        # tile t is computed. Writes fp32 scores and the max of every group of G positions (for the threshold).
        r = tl.program_id(0)
        s = tl.program_id(1)
        L = tl.load(ROW_LEN + r)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        h = tl.arange(0, H)
        d = tl.arange(0, 32)
        n = tl.arange(0, BN)
        q0, q1, q2, q3, wv = _q_fp16(Q, W, r, h, d, H)
        t0 = s * tiles_per_prog
        t1 = tl.minimum(t0 + tiles_per_prog, tl.cdiv(L, BN))
        row, valid = _tile_rows(BT, seq, stride_bt, t0, L, t1, n, BS, BN)
        cp = KC + row[:, None] * D + d[None, :]
        sp = KS + row * (D // 32)
        c0 = tl.load(cp + 0, mask=valid[:, None], other=0)
        c1 = tl.load(cp + 32, mask=valid[:, None], other=0)
        c2 = tl.load(cp + 64, mask=valid[:, None], other=0)
        c3 = tl.load(cp + 96, mask=valid[:, None], other=0)
        e0 = tl.load(sp + 0, mask=valid, other=127).to(tl.int32)
        e1 = tl.load(sp + 1, mask=valid, other=127).to(tl.int32)
        e2 = tl.load(sp + 2, mask=valid, other=127).to(tl.int32)
        e3 = tl.load(sp + 3, mask=valid, other=127).to(tl.int32)
        rown, validn = _tile_rows(BT, seq, stride_bt, t0 + 1, L, t1, n, BS, BN)
        for t in range(t0, t1):
            # issue tile t+1's loads and tile t+2's block-table lookup before computing tile t
            cpn = KC + rown[:, None] * D + d[None, :]
            spn = KS + rown * (D // 32)
            n0 = tl.load(cpn + 0, mask=validn[:, None], other=0)
            n1 = tl.load(cpn + 32, mask=validn[:, None], other=0)
            n2 = tl.load(cpn + 64, mask=validn[:, None], other=0)
            n3 = tl.load(cpn + 96, mask=validn[:, None], other=0)
            f0 = tl.load(spn + 0, mask=validn, other=127).to(tl.int32)
            f1 = tl.load(spn + 1, mask=validn, other=127).to(tl.int32)
            f2 = tl.load(spn + 2, mask=validn, other=127).to(tl.int32)
            f3 = tl.load(spn + 3, mask=validn, other=127).to(tl.int32)
            rown2, validn2 = _tile_rows(BT, seq, stride_bt, t + 2, L, t1, n, BS, BN)
            emax = tl.maximum(tl.maximum(e0, e1), tl.maximum(e2, e3))
            a0 = c0.to(tl.float8e4nv, bitcast=True).to(tl.float16) * _pow2(e0 - emax).to(tl.float16)[:, None]
            a1 = c1.to(tl.float8e4nv, bitcast=True).to(tl.float16) * _pow2(e1 - emax).to(tl.float16)[:, None]
            a2 = c2.to(tl.float8e4nv, bitcast=True).to(tl.float16) * _pow2(e2 - emax).to(tl.float16)[:, None]
            a3 = c3.to(tl.float8e4nv, bitcast=True).to(tl.float16) * _pow2(e3 - emax).to(tl.float16)[:, None]
            acc = tl.dot(a0, q0)
            acc = tl.dot(a1, q1, acc)
            acc = tl.dot(a2, q2, acc)
            acc = tl.dot(a3, q3, acc)
            sc = tl.sum(tl.maximum(acc, 0.0) * wv[None, :], 1) * _pow2(emax - 127)
            pos = t * BN + n
            tl.store(SC + r.to(tl.int64) * cap + pos, sc, mask=valid)
            gm = tl.max(tl.reshape(tl.where(valid, sc, float("-inf")), [BN // G, G]), 1)
            tl.store(GM + r.to(tl.int64) * ngcap + t * (BN // G) + tl.arange(0, BN // G), gm)
            c0, c1, c2, c3, e0, e1, e2, e3, valid = n0, n1, n2, n3, f0, f1, f2, f3, validn
            rown, validn = rown2, validn2

    @triton.jit
    def _pred(k, p, tk, tp, MODE: tl.constexpr):
        if MODE == 0:
            res = k >= tk
        elif MODE == 1:
            res = k > tk
        elif MODE == 2:
            res = k == tk
        else:
            res = (k == tk) & (p <= tp)
        return res

    @triton.jit
    def _count(CS, CP, base, nc, kr, pr, tk, tp, MODE: tl.constexpr, INREG: tl.constexpr, CH: tl.constexpr):
        # number of candidates satisfying _pred; INREG: kr/pr hold all of them (masked keys = INT_MIN)
        if INREG:
            c = tl.sum(_pred(kr, pr, tk, tp, MODE).to(tl.int32), 0)
        else:
            c = nc * 0
            for i in range(0, nc, CH):
                ar = i + tl.arange(0, CH)
                m = ar < nc
                k = tl.where(m, _key(tl.load(CS + base + ar, mask=m, other=0.0)), -2147483648)
                p = tl.load(CP + base + ar, mask=m, other=0)
                c += tl.sum(_pred(k, p, tk, tp, MODE).to(tl.int32), 0)
        return c

    @triton.jit
    def _select_body(CS, CP, base, nc, target, L, xr, pr, OUT_I, OUT_S, obase, INREG: tl.constexpr,
                     CH: tl.constexpr):
        # exact top-`target` of the nc candidates: the target-th largest key by bisection between the keys' min and
        # max, stopping as soon as exactly `target` keys are >= mid; ties to the lower position (a second bisection
        # on position, over [0, L)). target == nc: all of them, no search. xr / pr: the first CH candidate slots.
        ar = tl.arange(0, CH)
        m = ar < nc
        kr = tl.where(m, _key(xr), -2147483648)
        z64 = nc.to(tl.int64) * 0
        cge = nc  # keys >= lo
        if INREG:
            lo = z64 + tl.min(tl.where(m, kr, 2147483647), 0)
            hi = z64 + tl.max(kr, 0)
        else:
            lo = z64 - 2147483647
            hi = z64 + 2147483647
        lo = tl.where(target >= nc, z64 - 2147483647, lo)  # every candidate is selected: no search
        hi = tl.where(target >= nc, lo, hi)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            c = _count(CS, CP, base, nc, kr, pr, mid.to(tl.int32), 0, 0, INREG, CH)
            ok = c >= target
            lo = tl.where(ok, mid, lo)
            cge = tl.where(ok, c, cge)
            hi = tl.where(ok, tl.where(c == target, mid, hi), mid - 1)
        tk = lo.to(tl.int32)
        ngt = _count(CS, CP, base, nc, kr, pr, tk, 0, 1, INREG, CH)
        neq = cge - ngt
        need = target - ngt
        plo = nc * 0
        phi = tl.where(neq > need, L, 0)
        while plo < phi:
            pm = plo + (phi - plo) // 2
            c = _count(CS, CP, base, nc, kr, pr, tk, pm, 3, INREG, CH)
            ok = c >= need
            phi = tl.where(ok, pm, phi)
            plo = tl.where(ok, plo, pm + 1)
        alleq = neq <= need
        if INREG:
            sel = m & ((kr > tk) | ((kr == tk) & ((pr <= plo) | alleq)))
            si = sel.to(tl.int32)
            slot = tl.cumsum(si, 0) - 1
            tl.store(OUT_I + obase + slot, pr, mask=sel)
            tl.store(OUT_S + obase + slot, _unkey(kr), mask=sel)
        else:
            done = nc * 0
            for i in range(0, nc, CH):
                a2 = i + ar
                m2 = a2 < nc
                k = tl.where(m2, _key(tl.load(CS + base + a2, mask=m2, other=0.0)), -2147483648)
                p = tl.load(CP + base + a2, mask=m2, other=0)
                sel = m2 & ((k > tk) | ((k == tk) & ((p <= plo) | alleq)))
                si = sel.to(tl.int32)
                slot = done + tl.cumsum(si, 0) - 1
                tl.store(OUT_I + obase + slot, p, mask=sel)
                tl.store(OUT_S + obase + slot, _unkey(k), mask=sel)
                done += tl.sum(si, 0)

    @triton.jit
    def _gm_count(GM, gbase, ng, gk, thr, NGB: tl.constexpr):
        # number of the row's ng group maxima with key >= thr (gk: the first NGB of them, in registers)
        if ng <= NGB:
            c = tl.sum((gk >= thr).to(tl.int32), 0)
        else:
            c = ng * 0
            for i in range(0, ng, NGB):
                a = i + tl.arange(0, NGB)
                mm = a < ng
                kk = tl.where(mm, _key(tl.load(GM + gbase + a, mask=mm, other=0.0)), -2147483648)
                c += tl.sum((kk >= thr).to(tl.int32), 0)
        return c

    @triton.jit
    def _cand_kernel(SC, GM, CS, CP, CNT, ROW_LEN, cap, ngcap, chunk, topk, G: tl.constexpr, NGB: tl.constexpr,
                     BLK: tl.constexpr):
        # Threshold T = (top 16 bits of) the keff-th largest group max: at least keff scores are >= T, so every
        # top-keff score is a candidate. Each program recomputes T (same data, same result) and appends the
        # candidates of its slice of the row (atomic slot counter per row).
        r = tl.program_id(0)
        s = tl.program_id(1)
        L = tl.load(ROW_LEN + r)
        keff = tl.minimum(L, topk)
        p0 = s * chunk
        p1 = tl.minimum(p0 + chunk, L)
        cbase = r.to(tl.int64) * cap
        pos = p0 + tl.arange(0, BLK)  # the slice's first block is loaded before the search: its latency overlaps
        valid = pos < p1
        x = tl.load(SC + cbase + pos, mask=valid, other=0.0)
        ng = tl.cdiv(L, G)
        gbase = r.to(tl.int64) * ngcap
        ga = tl.arange(0, NGB)
        gm_in = ga < ng
        gk = tl.where(gm_in, _key(tl.load(GM + gbase + ga, mask=gm_in, other=0.0)), -2147483648)
        lo = L * 0 - 32768
        hi = tl.where(ng >= keff, 32767, -32768)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            c = _gm_count(GM, gbase, ng, gk, mid << 16, NGB)
            ok = c >= keff
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        T = lo << 16
        _append(CS, CP, CNT, r, cbase, x, pos, valid & (_key(x) >= T))
        for b0 in range(p0 + BLK, p1, BLK):
            pos = b0 + tl.arange(0, BLK)
            valid = pos < p1
            x = tl.load(SC + cbase + pos, mask=valid, other=0.0)
            _append(CS, CP, CNT, r, cbase, x, pos, valid & (_key(x) >= T))

    @triton.jit
    def _append(CS, CP, CNT, r, cbase, x, pos, mk):
        # append the scores x at positions pos where mk to the row's candidates (atomic slot counter)
        mi = mk.to(tl.int32)
        base = tl.atomic_add(CNT + r, tl.sum(mi, 0), sem="relaxed")
        slot = base + tl.cumsum(mi, 0) - 1
        tl.store(CS + cbase + slot, x, mask=mk)
        tl.store(CP + cbase + slot, pos, mask=mk)

    @triton.jit
    def _final_kernel(CS, CP, CNT, ROW_LEN, OUT_I, OUT_S, cap, topk, CH: tl.constexpr, KP2: tl.constexpr):
        # one program per row: exact selection among the candidates; resets the counter
        r = tl.program_id(0)
        L = tl.load(ROW_LEN + r)
        keff = tl.minimum(L, topk)
        obase = r.to(tl.int64) * topk
        kk = tl.arange(0, KP2)
        pm = (kk >= keff) & (kk < topk)
        tl.store(OUT_I + obase + kk, tl.full([KP2], -1, tl.int32), mask=pm)
        tl.store(OUT_S + obase + kk, tl.full([KP2], float("-inf"), tl.float32), mask=pm)
        base = r.to(tl.int64) * cap
        ar = tl.arange(0, CH)  # the first CH candidate slots, loaded while the counter is read
        xr = tl.load(CS + base + ar, mask=ar < cap, other=0.0)
        pr = tl.load(CP + base + ar, mask=ar < cap, other=0)
        nc = tl.atomic_xchg(CNT + r, 0)  # read and reset (the workspace cleans itself)
        target = tl.minimum(keff, nc)
        if nc <= CH:
            _select_body(CS, CP, base, nc, target, L, xr, pr, OUT_I, OUT_S, obase, True, CH)
        else:
            _select_body(CS, CP, base, nc, target, L, xr, pr, OUT_I, OUT_S, obase, False, CH)

    # ------------------------------------------------------------------ v3: paged TMA/pipelined score
    @triton.jit
    def _score3_kernel(Q, W, KC, KD, KS, BT, ROW_SEQ, ROW_LEN, SC, GM, stride_bt, cap, ngcap, ppp,
                       BS: tl.constexpr, H: tl.constexpr, G: tl.constexpr, NS: tl.constexpr, TMA: tl.constexpr,
                       PPB: tl.constexpr, PAIR: tl.constexpr):
        # One tile = one cache page (BS keys). The page's four 32-column code groups arrive by TMA (KD, a
        # [rows, 128] fp8 descriptor with a [BS, 32] box) or by plain loads (KC), software-pipelined NS deep by
        # tl.range; codes -> fp16 pre-scaled by 2^(e_g - e_max) (exact), four chained fp16 tensor-core dots
        # against q^T (scaled by a power of two into fp16 range: exact for bf16 q), relu, head weights, head sum,
        # times 2^(e_max - 127). Writes the scores and the max of every group of G positions.
        r = tl.program_id(0)
        s = tl.program_id(1)
        L = tl.load(ROW_LEN + r)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        h = tl.arange(0, H)
        d = tl.arange(0, 32)
        n = tl.arange(0, BS)
        q0, q1, q2, q3, wv = _q_fp16(Q, W, r, h, d, H)
        p0 = s * ppp
        p1 = tl.minimum(p0 + ppp, tl.cdiv(L, BS))
        obase = r.to(tl.int64) * cap
        if PPB > 0:  # the program's block-table entries in one load, picked per page from registers
            pa = tl.arange(0, PPB)
            btv = tl.load(BT + seq * stride_bt + p0 + pa, mask=pa < p1 - p0, other=0)
        for pg0 in tl.range(p0, p1, PAIR, num_stages=NS):
            for j in tl.static_range(PAIR):  # PAIR pages per iteration: independent dot chains for the scheduler
                pg = pg0 + j
                live = pg < p1
                if PPB > 0:
                    blk = tl.sum(tl.where(pa == pg - p0, btv, 0), 0)
                else:
                    blk = tl.load(BT + seq * stride_bt + pg, mask=live, other=0)
                sc, emax = _page_scores(KC, KD, KS, blk, n, d, q0, q1, q2, q3, BS, TMA)
                sc = tl.sum(tl.maximum(sc, 0.0) * wv[None, :], 1) * _pow2(emax - 127)
                pos = pg * BS + n
                valid = (pos < L) & live
                tl.store(SC + obase + pos, sc, mask=valid)
                gm = tl.max(tl.reshape(tl.where(valid, sc, float("-inf")), [BS // G, G]), 1)
                tl.store(GM + r.to(tl.int64) * ngcap + pg * (BS // G) + tl.arange(0, BS // G), gm,
                         mask=live & (tl.arange(0, BS // G) >= 0))

    @triton.jit
    def _page_scores(KC, KD, KS, blk, n, d, q0, q1, q2, q3, BS: tl.constexpr, TMA: tl.constexpr):
        # one cache page: [BS, H] logits (fp32, before relu / weights / the 2^(emax-127) factor) and emax [BS]
        row0 = blk * BS
        if TMA:
            c0 = KD.load([row0, 0])
            c1 = KD.load([row0, 32])
            c2 = KD.load([row0, 64])
            c3 = KD.load([row0, 96])
        else:
            cp = KC + (row0.to(tl.int64) + n)[:, None] * 128 + d[None, :]
            c0 = tl.load(cp).to(tl.float8e4nv, bitcast=True)
            c1 = tl.load(cp + 32).to(tl.float8e4nv, bitcast=True)
            c2 = tl.load(cp + 64).to(tl.float8e4nv, bitcast=True)
            c3 = tl.load(cp + 96).to(tl.float8e4nv, bitcast=True)
        ev = tl.load(KS + row0.to(tl.int64) + n)  # the row's four E8M0 bytes as one int32
        e0 = ev & 255
        e1 = (ev >> 8) & 255
        e2 = (ev >> 16) & 255
        e3 = (ev >> 24) & 255
        emax = tl.maximum(tl.maximum(e0, e1), tl.maximum(e2, e3))
        a0 = c0.to(tl.float16) * _pow2(e0 - emax).to(tl.float16)[:, None]
        a1 = c1.to(tl.float16) * _pow2(e1 - emax).to(tl.float16)[:, None]
        a2 = c2.to(tl.float16) * _pow2(e2 - emax).to(tl.float16)[:, None]
        a3 = c3.to(tl.float16) * _pow2(e3 - emax).to(tl.float16)[:, None]
        acc = tl.dot(a0, q0)
        acc = tl.dot(a1, q1, acc)
        acc = tl.dot(a2, q2, acc)
        acc = tl.dot(a3, q3, acc)
        return acc, emax


_WS: dict = {}
_AR: dict = {}


def _workspace(device, R: int, cap: int):
    key = (str(device), R, cap)
    ws = _WS.get(key)
    if ws is None:
        ws = (torch.empty(R, cap, dtype=torch.float32, device=device),
              torch.zeros(R, _HIST_W, dtype=torch.int32, device=device),
              torch.zeros(R, 8, dtype=torch.int32, device=device))
        _WS[key] = ws
    return ws


def _arange(n: int, device):
    key = (str(device), n)
    if key not in _AR:
        _AR[key] = torch.arange(n, dtype=torch.int32, device=device)
    return _AR[key]


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _indexer_topk(q, weights, k_codes, k_scales, block_table, row_seq, row_len, cap: int, topk: int,
                  bn: int | None = None, num_warps: int = 4, progs_per_sm: int | None = None, out=None,
                  impl: str = "v4", num_stages: int | None = None, tma: bool | None = None, **v3):
    if triton is None:
        raise RuntimeError("indexer_topk Triton kernels need triton and a CUDA GPU")
    if impl not in ("v1", "v2", "v3", "v4"):
        raise ValueError(f"indexer_topk: impl must be 'v1', 'v2', 'v3' or 'v4', got {impl!r}")
    if impl == "v4" and set(v3) - _V4_KW:
        raise ValueError(f"indexer_topk v4: unknown keyword(s) {sorted(set(v3) - _V4_KW)}; known: {sorted(_V4_KW)}")
    if impl not in ("v3", "v4") and set(v3) - {"score_only"}:
        raise ValueError(f"indexer_topk {impl}: unknown keyword(s) {sorted(set(v3) - {'score_only'})} (v3 only)")
    R, H, D = q.shape
    if D != 128 or k_codes.shape[-1] != 128 or k_scales.shape[-1] != 4:
        raise ValueError(f"indexer_topk: index head dim must be 128 (q {tuple(q.shape)}, k_codes "
                         f"{tuple(k_codes.shape)}, k_scales {tuple(k_scales.shape)} with 4 E8M0 scales per row)")
    for name, t, want in (("q", q, torch.bfloat16), ("k_codes", k_codes, torch.uint8),
                          ("k_scales", k_scales, torch.uint8)):
        if t.dtype != want:
            raise ValueError(f"indexer_topk: {name} must be {want}, got {t.dtype}")
    bs = k_codes.shape[1]
    if impl == "v4" and not _v4_ok(k_codes, H):
        impl = "v3"  # v4 needs Gluon, TMA (Hopper+) and 64-key pages with 64 index heads
        v3 = {k: v for k, v in v3.items() if k not in ("kperm", "scale_tma")}
    if impl == "v3" and not (bs & (bs - 1) == 0 and 16 <= bs <= 256):
        impl = "v2"  # v3 tiles by cache page: power-of-two pages only
    if impl == "v4":
        return _indexer_topk_v4(q, weights, k_codes, k_scales, block_table, row_seq, row_len, cap, topk,
                                progs_per_sm or 4, out, num_stages or 2, **v3)
    if impl == "v3":
        return _indexer_topk_v3(q, weights, k_codes, k_scales, block_table, row_seq, row_len, cap, topk, num_warps,
                                progs_per_sm or 4, out, num_stages or 3, tma, **v3)
    num_stages = num_stages or 2
    if impl == "v2":
        return _indexer_topk_v2(q, weights, k_codes, k_scales, block_table, row_seq, row_len, cap, topk,
                                bn or 128, num_warps, progs_per_sm or 2, out, num_stages,
                                score_only=v3.get("score_only", False))
    bn = bn or 64
    progs_per_sm = progs_per_sm or 4
    score_k, select_k = _score_kernel, _select_kernel
    bs = k_codes.shape[1]
    q = q.contiguous()
    weights = weights.float().contiguous()
    sc, hist, st = _workspace(q.device, R, cap)
    if out is None:
        out = (torch.empty(R, topk, dtype=torch.int32, device=q.device),
               torch.empty(R, topk, dtype=torch.float32, device=q.device))
    out_i, out_s = out
    ntiles = triton.cdiv(cap, bn)
    want = max(1, (progs_per_sm * _num_sms(q.device)) // max(R, 1))
    tpp = max(1, triton.cdiv(ntiles, want))
    splits = triton.cdiv(ntiles, tpp)
    grid = (R, splits)
    score_k[grid](q, weights, k_codes, k_scales, block_table, row_seq, row_len, sc, hist,
                  block_table.stride(0), cap, tpp, BS=bs, H=H, D=D, BN=bn, HIST_ON=True, num_warps=num_warps,
                  num_stages=2)
    blk = 1024
    sel_progs = max(1, (2 * _num_sms(q.device)) // max(R, 1))
    chunk = triton.cdiv(triton.cdiv(cap, sel_progs), blk) * blk
    sgrid = (R, triton.cdiv(cap, chunk))
    kp2 = triton.next_power_of_2(topk)
    for p in (2, 3, 4, 5):
        select_k[sgrid](sc, hist, st, out_i, out_s, row_len, cap, chunk, topk, PASS=p, BLK=blk, KP2=kp2,
                        num_warps=4)
    return out_i, out_s


_WS2: dict = {}


def _group_size(cap: int, topk: int, bn: int) -> int:
    """Positions per group for the threshold: about 2*topk groups per row (>= topk needed for a bound)."""
    g = max(16, triton.next_power_of_2(triton.cdiv(cap, 2 * max(topk, 1))))
    return min(g, bn)


def _threshold_workspace(dev, R: int, cap: int, ngcap: int):
    """(scores, group maxima, candidate scores, candidate positions, candidate counters), cached per shape; the
    counters reset themselves, so a workspace must not serve two calls in flight on different streams."""
    key = (str(dev), R, cap, ngcap)
    ws = _WS2.get(key)
    if ws is None:
        f32 = dict(dtype=torch.float32, device=dev)
        ws = (torch.empty(R, cap, **f32), torch.empty(R, ngcap, **f32), torch.empty(R, cap, **f32),
              torch.empty(R, cap, dtype=torch.int32, device=dev), torch.zeros(R, dtype=torch.int32, device=dev))
        _WS2[key] = ws
    return ws


def _outputs(R: int, topk: int, dev, out):
    if out is None:
        out = (torch.empty(R, topk, dtype=torch.int32, device=dev),
               torch.empty(R, topk, dtype=torch.float32, device=dev))
    return out


def _threshold_select(ws, row_len, out_i, out_s, cap, ngcap, topk, G, nsm, cand_warps=4, final_warps=8, cand_pps=2):
    """`_cand_kernel` (threshold from the group maxima + candidate compaction) then `_final_kernel` (exact
    selection among the candidates, typically ~1.2-1.5 x topk of them)."""
    sc, gm, cs, cp, cnt = ws
    R = row_len.shape[0]
    blk = 2048
    s2 = max(1, min(triton.cdiv(cap, blk), (cand_pps * nsm) // max(R, 1)))  # ~cand_pps candidate programs per SM
    chunk = triton.cdiv(triton.cdiv(cap, s2), blk) * blk
    ngb = min(triton.next_power_of_2(max(ngcap, 16)), 4096)
    _cand_kernel[(R, triton.cdiv(cap, chunk))](sc, gm, cs, cp, cnt, row_len, cap, ngcap, chunk, topk, G=G,
                                                NGB=ngb, BLK=blk, num_warps=cand_warps)
    _final_kernel[(R,)](cs, cp, cnt, row_len, out_i, out_s, cap, topk, CH=4096,
                        KP2=triton.next_power_of_2(topk), num_warps=final_warps)
    return out_i, out_s


def _indexer_topk_v2(q, weights, k_codes, k_scales, block_table, row_seq, row_len, cap, topk, bn, num_warps,
                     progs_per_sm, out, num_stages, score_only=False):
    """Three launches: score (+ group maxima), threshold + candidate compaction, exact selection among the
    candidates. No histograms."""
    R, H, D = q.shape
    bs = k_codes.shape[1]
    q = q.contiguous()
    weights = weights.float().contiguous()
    G = _group_size(cap, topk, bn)
    ntiles = triton.cdiv(cap, bn)
    ngcap = ntiles * (bn // G)
    ws = _threshold_workspace(q.device, R, cap, ngcap)
    out_i, out_s = _outputs(R, topk, q.device, out)
    nsm = _num_sms(q.device)
    want = max(1, (progs_per_sm * nsm) // max(R, 1))
    tpp = max(1, triton.cdiv(ntiles, want))
    splits = triton.cdiv(ntiles, tpp)
    _score2_kernel[(R, splits)](q, weights, k_codes, k_scales, block_table, row_seq, row_len, ws[0], ws[1],
                                block_table.stride(0), cap, ngcap, tpp, BS=bs, H=H, D=D, BN=bn, G=G,
                                num_warps=num_warps, num_stages=num_stages)
    if score_only:  # stage timing in the bench: scores + group maxima in the workspace, no selection
        return ws[0], ws[1]
    return _threshold_select(ws, row_len, out_i, out_s, cap, ngcap, topk, G, nsm)


def _tma_ok(k_codes: torch.Tensor) -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return k_codes.is_cuda and torch.cuda.get_device_capability(k_codes.device)[0] >= 9 and k_codes.data_ptr() % 16 == 0


def _page_plan(q, weights, bs: int, cap: int, topk: int, progs_per_sm: int, out):
    """Shared set-up of the page-tiled score kernels (v3, v4): contiguous q / fp32 weights, the group size and
    count for the threshold, the workspace, the outputs, the SM count and the pages per program (about
    progs_per_sm programs per SM over all rows)."""
    R = q.shape[0]
    G = _group_size(cap, topk, bs)
    npages = triton.cdiv(cap, bs)
    ngcap = npages * (bs // G)
    ws = _threshold_workspace(q.device, R, cap, ngcap)
    out_i, out_s = _outputs(R, topk, q.device, out)
    nsm = _num_sms(q.device)
    want = max(1, (progs_per_sm * nsm) // max(R, 1))
    ppp = max(1, triton.cdiv(npages, want))
    return q.contiguous(), weights.float().contiguous(), G, npages, ngcap, ws, out_i, out_s, nsm, ppp


def _indexer_topk_v3(q, weights, k_codes, k_scales, block_table, row_seq, row_len, cap, topk, num_warps,
                     progs_per_sm, out, num_stages, tma, prefetch_bt=True, cand_warps=4, final_warps=8, pair=1,
                     score_only=False, cand_pps=2, maxnreg=None):
    """`_score3_kernel` (one page per tile, TMA or plain loads pipelined num_stages deep), then v2's
    `_cand_kernel` + `_final_kernel`."""
    R, H, D = q.shape
    bs = k_codes.shape[1]
    if bs & (bs - 1) or not 16 <= bs <= 256:
        raise ValueError(f"indexer v3 needs a power-of-two cache block size in [16, 256], got {bs}")
    q, weights, G, npages, ngcap, ws, out_i, out_s, nsm, ppp = _page_plan(q, weights, bs, cap, topk, progs_per_sm, out)
    kd = None
    if tma is None:
        tma = _tma_ok(k_codes)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        kd = TensorDescriptor.from_tensor(k_codes.view(-1, D).view(torch.float8_e4m3fn), [bs, 32])
    ppb = triton.next_power_of_2(ppp) if prefetch_bt and ppp <= 64 else 0
    _score3_kernel[(R, triton.cdiv(npages, ppp))](
        q, weights, k_codes, kd, k_scales.view(torch.int32), block_table, row_seq, row_len, ws[0], ws[1],
        block_table.stride(0), cap, ngcap, ppp, BS=bs, H=H, G=G, NS=num_stages, TMA=bool(tma), PPB=ppb, PAIR=pair,
        num_warps=num_warps, maxnreg=maxnreg)
    if score_only:  # stage timing in the bench: scores + group maxima in the workspace, no selection
        return ws[0], ws[1]
    return _threshold_select(ws, row_len, out_i, out_s, cap, ngcap, topk, G, nsm, cand_warps, final_warps, cand_pps)


_V4_KW = frozenset({"maxnreg", "kperm", "scale_tma", "cand_warps", "final_warps", "cand_pps", "score_only"})


def _v4_ok(k_codes: torch.Tensor, heads: int = 64) -> bool:
    from . import gluon as g
    return g.gluon is not None and k_codes.shape[1] == 64 and heads == 64 and _tma_ok(k_codes)


def _indexer_topk_v4(q, weights, k_codes, k_scales, block_table, row_seq, row_len, cap, topk, progs_per_sm, out,
                     num_stages, maxnreg=None, kperm=True, scale_tma=True, cand_warps=4, final_warps=8, cand_pps=2,
                     score_only=False):
    """Gluon score kernel (plugins/indexer_topk/gluon.py: one TMA + one mbarrier wait + two thread barriers per
    page), then v2's `_cand_kernel` + `_final_kernel`."""
    from . import gluon as g
    R, H, _ = q.shape
    if not 2 <= num_stages <= 4:
        raise ValueError(f"indexer_topk v4: num_stages must be 2..4, got {num_stages}")
    bs = k_codes.shape[1]
    q, weights, G, npages, ngcap, ws, out_i, out_s, nsm, ppp = _page_plan(q, weights, bs, cap, topk, progs_per_sm, out)
    kd, sd = g.descriptors(k_codes, k_scales)
    g._score4_kernel[(R, triton.cdiv(npages, ppp))](
        q, weights, kd, sd, k_scales.view(torch.int32), block_table, row_seq, row_len,
        ws[0], ws[1], block_table.stride(0), cap, ngcap, ppp, BS=bs, H=H, G=G, NS=num_stages, KPERM=bool(kperm),
        STMA=bool(scale_tma), num_warps=4, maxnreg=maxnreg)
    if score_only:
        return ws[0], ws[1]
    return _threshold_select(ws, row_len, out_i, out_s, cap, ngcap, topk, G, nsm, cand_warps, final_warps, cand_pps)


def indexer_topk_decode(q: torch.Tensor, weights: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                        block_table: torch.Tensor, context_lens: torch.Tensor, topk: int = 2048, *,
                        bn: int | None = None, num_warps: int = 4, out=None, impl: str = "v4",
                        num_stages: int | None = None, progs_per_sm: int | None = None,
                        tma: bool | None = None, **v3) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, 128] bf16, weights [B, H] f32, k_codes [NB, BS, 128] u8, k_scales [NB, BS, 4] u8,
    block_table [B, MB] i32, context_lens [B] i32 -> (indices [B, topk] i32 (-1 pad), scores [B, topk] f32).
    impl "v3" keywords: prefetch_bt (a program's block-table entries loaded once, default), pair (pages per loop
    iteration; default 1; num_stages defaults to 3 for v3), cand_warps / final_warps (warps of the two select kernels),
    cand_pps (candidate-kernel programs per SM, default 2). impl "v4" (default; falls back to v3 where it does not
    apply) keywords: num_stages (ring slots, 2..4, default 2), kperm / scale_tma (default on), maxnreg, cand_warps,
    final_warps, cand_pps."""
    B = q.shape[0]
    cap = block_table.shape[1] * k_codes.shape[1]
    return _indexer_topk(q, weights, k_codes, k_scales, block_table, _arange(B, q.device),
                         context_lens.to(torch.int32), cap, topk, bn=bn, num_warps=num_warps, out=out, impl=impl,
                         num_stages=num_stages, progs_per_sm=progs_per_sm, tma=tma, **v3)


def indexer_topk_prefill(q: torch.Tensor, weights: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                         block_table_row: torch.Tensor, start_pos: int, topk: int = 2048, *,
                         bn: int | None = None, num_warps: int = 4, impl: str = "v4",
                         tma: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prefill of one sequence: q [T, H, 128] bf16, weights [T, H]; query t sees positions
    s <= start_pos + t (its keys already written to the cache) -> (indices [T, topk], scores [T, topk])."""
    T = q.shape[0]
    row_len = torch.arange(start_pos + 1, start_pos + T + 1, dtype=torch.int32, device=q.device)
    row_seq = torch.zeros(T, dtype=torch.int32, device=q.device)
    return _indexer_topk(q, weights, k_codes, k_scales, block_table_row.reshape(1, -1), row_seq, row_len,
                         start_pos + T, topk, bn=bn, num_warps=num_warps, impl=impl, tma=tma)


def indexer_topk_decode_onnx_contract(q: torch.Tensor, w: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                                      block_table: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor,
                                      topk: int = 2048, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi.IndexerTopK's contract (plugins/indexer_topk/__init__.py) on the MXFP8 cache: q [B,T,H,128] (or
    [B,H,128] for T=1), w [B,T,H], start/lengths [B] -> indices [B,T,topk] int64 sorted by score desc then position
    asc, -1 where fewer positions are visible; scores [B,T,topk] fp32, -1e30 where invalid. Query (b, t) sees
    s <= start[b] + t and s < start[b] + lengths[b]."""
    squeeze = q.dim() == 3
    if squeeze:
        q, w = q[:, None], w[:, None]
    B, T, H, D = q.shape
    dev = q.device
    st = start.to(device=dev, dtype=torch.int64)
    ln = lengths.to(device=dev, dtype=torch.int64)
    t = torch.arange(T, device=dev, dtype=torch.int64)
    row_len = torch.minimum(st[:, None] + t[None, :] + 1, (st + ln)[:, None]).clamp_min(0).to(torch.int32).reshape(-1)
    row_seq = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(T)
    bt = block_table.to(torch.int32).contiguous()
    cap = bt.shape[1] * k_codes.shape[1]
    idx, sc = _indexer_topk(q.reshape(B * T, H, D).to(torch.bfloat16), w.reshape(B * T, H), k_codes, k_scales, bt,
                            row_seq, row_len, cap, topk, **kw)
    pos = idx.long()
    valid = pos >= 0
    s = torch.where(valid, sc, torch.full_like(sc, float("-inf")))
    o1 = torch.argsort(torch.where(valid, pos, torch.full_like(pos, 1 << 62)), dim=-1, stable=True)
    o2 = torch.argsort(s.gather(-1, o1), dim=-1, descending=True, stable=True)
    order = o1.gather(-1, o2)
    pos, s, valid = pos.gather(-1, order), s.gather(-1, order), valid.gather(-1, order)
    s = torch.where(valid, s, torch.full_like(s, -1e30))
    pos = torch.where(valid, pos, torch.full_like(pos, -1))
    shape = (B, topk) if squeeze else (B, T, topk)
    return pos.reshape(shape), s.reshape(shape)
