"""GPU kernels of kimi.IndexerTopK over the paged MXFP8 index-K cache: score, ReLU, head weights, visibility and
top-k without writing a [B, T, S] score tensor back to the caller.

Entry point (the op's ONNX contract, plugins/indexer_topk/__init__.py):

    indexer_topk(q, w, codes, scales, block_table, start, lengths, topk, *, strategy="auto", out=None, sort=True)
        q       [B, T, H, 128] bf16 (float32 is rounded to bf16)   index queries
        w       [B, T, H] float32 / bf16                             head weights (scales folded in)
        codes   [NB, BS, 128] uint8 (or float8_e4m3fn)               E4M3FN bit patterns of the index keys
        scales  [NB, BS, 4] uint8                                    E8M0 bytes, one per 32 dims: 2^(b - 127)
        block_table [B, MB] int32 / int64                            position s of sequence b: block
                                                                     block_table[b, s // BS], row s % BS
        start, lengths [B] integer                                   query t of sequence b sees the positions
                                                                     s <= start[b] + t and s < start[b] + lengths[b]
        -> indices [B, T, topk] int64: the visible positions with the highest scores, sorted by score (descending)
           then position (ascending), -1 where fewer than topk are visible (sort=False: the same positions in no
           particular order, then the -1s);
           scores [B, T, topk] float32: I = sum_h w[h] * relu(q[h] . k[s]), -1e30 where the index is -1.
    The pools are the quantize pass's index_k_cache pools (mxfp8, block 32, E4M3: `index_k.i` codes and
    `index_k.i.scale`), read as they are. All tensors on one CUDA device, pools contiguous. No host
    synchronization, CUDA-graph capturable: lengths are read on the device; grids are sized from shapes
    (B * T rows, MB * BS positions), never from tensor values.

`unsupported(...)` returns why the kernels do not apply to given tensors (None when they do; `supports` is its
boolean), naming the field; the entry points raise ValueError with that message. Strategies ("auto" picks the first
that applies, by `strategy_for`):
    "gluon"   stage 1 by the Gluon kernel (plugins/indexer_topk/gluon.py): Hopper (wgmma, TMA), 64-key pages, 64 heads;
    "triton"  stage 1 by `_score_kernel`: power-of-two pages of 16..256 keys, power-of-two head counts of 16..256,
              TMA loads on Hopper+ (16-byte-aligned pool) and plain loads elsewhere.
Both compute the same scores (up to fp32 summation order: the Gluon kernel permutes the dot positions within each
32-dim group); the selection stages are shared.

Stages (rows r = b * T + t; a row sees positions [0, L_r) with L_r = clamp(min(start + t + 1, start + lengths), 0)):
1. score (grid rows x programs, one cache page per step): per page, codes -> fp16 pre-scaled by 2^(e_g - e_max) (e_g
   the E8M0 exponent of each 32-dim group of a key, e_max the key's largest: exact above fp16's range floor), four fp16
   tensor-core dots [BS, 32] x [32, H] against q (scaled by a power of two into fp16 range: exact for bf16 q), ReLU,
   head weights, head sum, times 2^(e_max - 127). Writes fp32 scores [R, cap] and the max of every group of
   GROUP = 4 positions and of every COARSE = 16 into a workspace.
2. `_cand_kernel` (grid rows x slices): the row's group maxima (the coarse ones where ceil(L / COARSE) >= NGB)
   merged into min(their number, NGB) (~2 topk) groups of adjacent maxima, sizes differing by at most one, by the
   row's own length L; T = the top 16 key bits of the k-th largest of them (bisection in registers; k = min(topk,
   L)): at least k scores are >= T, so every top-k score is a candidate; each program appends its slice's
   candidates (atomic slot counter per row; typically 1.2-1.5 k of them where L >= 4 k).
3. `_final_kernel` (one program per row): exact selection among the candidates: bisection for the k-th key (stops
   once exactly k keys are >= mid; all candidates taken when there are at most k), ties to the lower position (a
   second bisection on position), slots by prefix sum; -1 / -inf past k; resets the counter.
`indexer_topk_rows` runs these three (indices int32 in no particular order). `indexer_topk` runs them between two
kernels of its own: `_rows_kernel` (each row's sequence and visible length from start / lengths) before, and
`_rank_kernel` after. There `_final_kernel` writes each selected slot's fp64 order key (`_dkey`: score and position
in one double, -inf past the selection) instead of the position / score pair; `_rank_kernel` (grid rows x blocks of
64 or 128 slots, `_rank_shape`) counts for each slot the row's keys greater than its own (one fp64 compare per pair,
the warps of a program splitting the row's keys), which is its rank in the contract's order (score descending, then
position ascending), and writes the position and score decoded from the key there: int64 positions, -1 / -1e30 past
the selection. With sort=False (the op's sorted=0, for a consumer that reads the selection as a set, as kimi.SparseMLA
does) there is no rank kernel: `_final_kernel` writes the op's int64 positions and scores itself, in its own order.

Invariants: the workspaces (scores, group maxima, candidates, counters; the rows and the selection's order keys
of `indexer_topk`) are cached per shape and allocated on the first call of a shape (warm up before capturing a CUDA
graph); the counters reset themselves, so one workspace must not serve two calls in flight on different streams.
Order keys: the order-preserving int32 image of the fp32 score (`_key`); `_dkey` the fp64 with the score's sign and
31 magnitude bits above 31 position bits (the same order, distinct per position, never inf / NaN).
History of these kernels (what was tried, what was measured): docs/kernels/indexer_topk.md.
"""

from __future__ import annotations

import os

import torch
from kimi_compile.plugins import num_sms

from kimi_compile.onnx_body import MASKED  # the op's score where the index is -1

try:  # triton is optional: importing this module on a CPU machine without it must work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

STRATEGIES = ("gluon", "triton")
HEAD_DIM = 128
SCORE_WARPS = 4  # the Triton score kernel
SCORE_STAGES = 3  # its software pipeline depth (tl.range): next page's loads in flight while this one computes
PROGS_PER_SM = 4  # score programs per SM over all rows
# registers a thread of the Triton score kernel may use so that PROGS_PER_SM of its programs fit on an SM at once
# (64K registers an SM: 128); the grid is sized for that many, and one fewer resident leaves a second wave
SCORE_MAXNREG = 65536 // (PROGS_PER_SM * SCORE_WARPS * 32)
GROUP = 4  # positions per group maximum (stage 1 writes them, stage 2 merges them by the row's length)
COARSE = 16  # positions per coarse maximum, the second level stage 1 writes (stage 2 reads it for long rows)
CAND_WARPS, CAND_PROGS_PER_SM, FINAL_WARPS = 4, 2, 8  # the two select kernels
RANK_CHK, RANK_STAGES = 128, 3  # the rank kernel: keys per step (CHK // W per warp), its pipeline depth (tl.range)
RANK_PROGS_PER_SM = 2  # from this many programs per SM: 128 slots and 2 warps per rank program, else 64 and 4
# (_rank_shape; H200 sweep of .gpu/rank_bench.py: 19.9 us at 32 rows, 7.7 / 9.8 us at 1 / 8 rows)

if triton is not None:

    @triton.jit
    def _key(x):  # order-preserving int32 image of an fp32 value
        i = x.to(tl.int32, bitcast=True)
        return tl.where(i < 0, i ^ 0x7FFFFFFF, i)

    @triton.jit
    def _unkey(k):
        return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)

    @triton.jit
    def _pow2(e):  # 2^e as fp32 for integer e (clamped to the normal range; below it flushes to 0)
        return (tl.minimum(tl.maximum(e + 127, 0), 254) << 23).to(tl.float32, bitcast=True)

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

    # ------------------------------------------------------------------ stage 1, strategy "triton"
    @triton.jit
    def _score_kernel(Q, W, KC, KD, KS, BT, ROW_SEQ, ROW_LEN, SC, GM, stride_bt, cap, gstride, nfine, ppp,
                      BS: tl.constexpr, H: tl.constexpr, G: tl.constexpr, GC: tl.constexpr, NS: tl.constexpr,
                      TMA: tl.constexpr, PPB: tl.constexpr):
        # Grid (rows, programs per row); program (r, s) scores pages [s * ppr, s * ppr + ppr) of row r, clipped to
        # its length L, ppr = the row's pages over the row's programs (at most ppp). One step = one cache page (BS
        # keys): the page's four 32-column code groups arrive by TMA
        # (KD, a [rows, 128] fp8 descriptor with a [BS, 32] box) or by plain loads (KC), software-pipelined NS deep
        # by tl.range; the four E8M0 scales load as one int32 per row (KS). PPB > 0: the program's block-table
        # entries load once, then are picked per page from registers. Writes scores for positions < L, the max of
        # every group of G positions (-inf past L) and of every GC positions (row r's maxima: GM[r * gstride + ..],
        # the coarse ones from nfine on).
        r = tl.program_id(0)
        s = tl.program_id(1)
        L = tl.load(ROW_LEN + r)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        h = tl.arange(0, H)
        d = tl.arange(0, 32)
        n = tl.arange(0, BS)
        q0, q1, q2, q3, wv = _q_fp16(Q, W, r, h, d, H)
        # the row's own pages split evenly over the row's programs (a short row in a long cache keeps every program
        # busy); ppp, sized from the capacity, bounds it (and the block-table prefetch width PPB)
        ppr = tl.minimum(ppp, tl.cdiv(tl.cdiv(L, BS), tl.num_programs(1)))
        p0 = s * ppr
        p1 = tl.minimum(p0 + ppr, tl.cdiv(L, BS))
        obase = r.to(tl.int64) * cap
        if PPB > 0:
            pa = tl.arange(0, PPB)
            btv = tl.load(BT + seq * stride_bt + p0 + pa, mask=pa < p1 - p0, other=0)
        for pg in tl.range(p0, p1, 1, num_stages=NS):
            if PPB > 0:
                blk = tl.sum(tl.where(pa == pg - p0, btv, 0), 0)
            else:
                blk = tl.load(BT + seq * stride_bt + pg)
            sc, emax = _page_scores(KC, KD, KS, blk, n, d, q0, q1, q2, q3, BS, TMA)
            sc = tl.sum(tl.maximum(sc, 0.0) * wv[None, :], 1) * _pow2(emax - 127)
            pos = pg * BS + n
            valid = pos < L
            tl.store(SC + obase + pos, sc, mask=valid)
            sv = tl.where(valid, sc, float("-inf"))
            gb = GM + r.to(tl.int64) * gstride
            tl.store(gb + pg * (BS // G) + tl.arange(0, BS // G), tl.max(tl.reshape(sv, [BS // G, G]), 1))
            tl.store(gb + nfine + pg * (BS // GC) + tl.arange(0, BS // GC), tl.max(tl.reshape(sv, [BS // GC, GC]), 1))

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

    # ------------------------------------------------------------------ stages 2 and 3: threshold select
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
                     CH: tl.constexpr, KEYS: tl.constexpr):
        # exact top-`target` of the nc candidates: the target-th largest key by bisection between the keys' min and
        # max, stopping as soon as exactly `target` keys are >= mid; ties to the lower position (a second bisection
        # on position, over [0, L)). target == nc: all of them, no search. xr / pr: the first CH candidate slots.
        # KEYS: one fp64 order key per slot (_dkey) into OUT_I instead of the position / score pair
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
            _put(OUT_I, OUT_S, obase + slot, pr, _unkey(kr), si != 0, KEYS)
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
                _put(OUT_I, OUT_S, obase + slot, p, _unkey(k), si != 0, KEYS)
                done += tl.sum(si, 0)

    @triton.jit
    def _put(OUT_I, OUT_S, off, p, x, m, KEYS: tl.constexpr):
        # one selected slot: position and score, or (KEYS) its fp64 order key
        if KEYS:
            tl.store(OUT_I + off, _dkey(x, p), mask=m)
        else:
            tl.store(OUT_I + off, p, mask=m)
            tl.store(OUT_S + off, x, mask=m)

    @triton.jit
    def _cand_kernel(SC, GM, CS, CP, CNT, ROW_LEN, cap, gstride, nfine, chunk, topk, G: tl.constexpr,
                     GC: tl.constexpr, NGB: tl.constexpr, BLK: tl.constexpr):
        # Threshold T = (top 16 bits of) the keff-th largest group max: at least keff scores are >= T, so every
        # top-keff score is a candidate. The score kernels write the max of every G positions and of every GC; a
        # row of at least NGB * GC positions reads the coarse ones (fewer passes), a shorter row the fine ones. The
        # row's ng maxima are merged into min(ng, NGB) groups (NGB about 2 topk) of adjacent maxima whose sizes
        # differ by at most one (the first ng % NGB groups hold one more), by the row's own length, so a short row
        # in a long cache still gets about 2 keff groups, and held in registers for the bisection, which starts
        # from the top 16 bits of their smallest and largest. (Merging a power-of-two F at a time left ceil(ng / F)
        # groups, barely above keff for rows just past a power of two: a 32769-position row had 2049 groups, its
        # threshold near the smallest group max, and a third of its positions as candidates.) Each program
        # recomputes T (same data, same result) and appends the candidates of its slice of the row (atomic slot
        # counter per row).
        r = tl.program_id(0)
        s = tl.program_id(1)
        L = tl.load(ROW_LEN + r)
        keff = tl.minimum(L, topk)
        # the row's own positions split evenly over the row's programs, in whole blocks (at most `chunk`, sized from
        # the capacity)
        rch = tl.minimum(chunk, tl.cdiv(tl.cdiv(L, tl.num_programs(1)), BLK) * BLK)
        p0 = s * rch
        p1 = tl.minimum(p0 + rch, L)
        cbase = r.to(tl.int64) * cap
        pos = p0 + tl.arange(0, BLK)  # the slice's first block is loaded before the search: its latency overlaps
        valid = pos < p1
        x = tl.load(SC + cbase + pos, mask=valid, other=0.0)
        coarse = tl.cdiv(L, GC) >= NGB
        ng = tl.where(coarse, tl.cdiv(L, GC), tl.cdiv(L, G))
        gq = ng // NGB
        grem = ng % NGB
        ngc = tl.minimum(ng, NGB)
        gbase = r.to(tl.int64) * gstride + tl.where(coarse, nfine, 0)
        ga = tl.arange(0, NGB)
        gk = tl.full([NGB], -2147483648, tl.int32)
        for f in range(0, gq + (grem > 0).to(tl.int32)):  # group g: maxima g gq + min(g, grem) + [0, gq + (g < grem))
            a = ga * gq + tl.minimum(ga, grem) + f
            m = f < gq + (ga < grem).to(tl.int32)
            gk = tl.maximum(gk, tl.where(m, _key(tl.load(GM + gbase + a, mask=m, other=0.0)), -2147483648))
        # the answer lies between the top 16 bits of the smallest merged maximum (every group is at or above it) and
        # of the largest (none above it); fewer groups than keff: T = INT_MIN, every position
        has = ngc >= keff
        lo = tl.where(has, tl.min(tl.where(ga < ngc, gk, 2147483647), 0) >> 16, -32768)
        hi = tl.where(has, tl.max(gk, 0) >> 16, -32768)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            ok = tl.sum((gk >= (mid << 16)).to(tl.int32), 0) >= keff
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
    def _dkey(x, p):
        # fp64 order key of (score x, position p >= 0): bits sign(x) | |x|'s 31 bits | t, t = 2^31 - 1 - p when x is
        # not negative, p when it is: as doubles, larger = earlier in the op's order (score descending as _key
        # orders it, -0 below +0, then position ascending); distinct per position; bit 62 is 0, so never inf or NaN
        # (one DSETP per comparison, on the FP64 pipe, where the int64 key took two integer compares)
        b = x.to(tl.int32, bitcast=True)
        t = p ^ (~(b >> 31) & 0x7FFFFFFF)
        hi = (b & -2147483648) | ((b >> 1) & 0x3FFFFFFF)
        lo = (b << 31) | t
        k = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        return k.to(tl.float64, bitcast=True)

    @triton.jit
    def _undkey(d):
        # (position, score) of a _dkey key
        k = d.to(tl.int64, bitcast=True)
        neg = k < 0
        t = (k & 0x7FFFFFFF).to(tl.int32)
        b = ((k >> 31) & 0x7FFFFFFF).to(tl.int32) | tl.where(neg, -2147483648, 0)
        return tl.where(neg, t, 0x7FFFFFFF - t), b.to(tl.float32, bitcast=True)

    @triton.jit
    def _rank_kernel(KEYS, OUT_I, OUT_S, topk, kp, pad_score, BLK: tl.constexpr, CHK: tl.constexpr,
                     W: tl.constexpr, NS: tl.constexpr):
        # grid (rows, slot blocks of BLK): each selected slot moves to its rank in the op's order, the number of the
        # row's keys (_dkey; -inf where none) greater than its own; unselected slots stay where they are (past the
        # last selected one) as -1 / pad_score. Lanes hold BLK // 32 slots each; the W warps split the row's kp keys
        # (kp: topk rounded up to CHK, -inf past topk), CHK // W contiguous keys each per step, and add their counts
        # once at the end. No masks in the loop.
        r = tl.program_id(0)
        kb = r.to(tl.int64) * kp
        NJ: tl.constexpr = BLK // 32
        S: tl.constexpr = CHK // W
        # [NJ, 32] slots: lane l holds slots l, 32 + l, ..; [S, W] keys: warp w takes keys w * S .. w * S + S - 1
        # (the layout Triton picks for [NJ, S, W, 32]: lanes on the last axis, warps on W, the rest in-thread)
        jj = tl.program_id(1) * BLK + tl.arange(0, NJ)[:, None] * 32 + tl.arange(0, 32)[None, :]
        mj = jj < topk
        kj = tl.load(KEYS + kb + jj, mask=mj, other=float("-inf"))
        iw = tl.arange(0, W)[None, :] * S + tl.arange(0, S)[:, None]
        acc = tl.zeros([NJ, W, 32], tl.int32)
        for c in tl.range(0, kp, CHK, num_stages=NS):
            ki = tl.load(KEYS + kb + c + iw)
            acc += tl.sum((ki[None, :, :, None] > kj[:, None, None, :]).to(tl.int32), 1)
        rank = tl.sum(acc, 1)
        sel = kj != float("-inf")
        pj, sj = _undkey(kj)
        dest = tl.where(sel, rank, jj)
        ob = r.to(tl.int64) * topk
        tl.store(OUT_I + ob + dest, tl.where(sel, pj, -1).to(tl.int64), mask=mj)
        tl.store(OUT_S + ob + dest, tl.where(sel, sj, pad_score), mask=mj)

    @triton.jit
    def _final_kernel(CS, CP, CNT, ROW_LEN, OUT_I, OUT_S, cap, topk, width, pad_score, CH: tl.constexpr,
                      KP2: tl.constexpr, KEYS: tl.constexpr):
        # one program per row: exact selection among the candidates; resets the counter. Output rows of `width`
        # slots: slots keff .. width - 1 get -1 and pad_score, or (KEYS) the key -inf
        r = tl.program_id(0)
        L = tl.load(ROW_LEN + r)
        keff = tl.minimum(L, topk)
        obase = r.to(tl.int64) * width
        kk = tl.arange(0, KP2)
        pm = (kk >= keff) & (kk < width)
        if KEYS:
            tl.store(OUT_I + obase + kk, tl.full([KP2], float("-inf"), tl.float64), mask=pm)
        else:
            tl.store(OUT_I + obase + kk, tl.full([KP2], -1, tl.int32), mask=pm)
            tl.store(OUT_S + obase + kk, tl.full([KP2], pad_score, tl.float32), mask=pm)
        base = r.to(tl.int64) * cap
        ar = tl.arange(0, CH)  # the first CH candidate slots, loaded while the counter is read
        xr = tl.load(CS + base + ar, mask=ar < cap, other=0.0)
        pr = tl.load(CP + base + ar, mask=ar < cap, other=0)
        nc = tl.atomic_xchg(CNT + r, 0)  # read and reset (the workspace cleans itself)
        target = tl.minimum(keff, nc)
        if nc <= CH:
            _select_body(CS, CP, base, nc, target, L, xr, pr, OUT_I, OUT_S, obase, True, CH, KEYS)
        else:
            _select_body(CS, CP, base, nc, target, L, xr, pr, OUT_I, OUT_S, obase, False, CH, KEYS)

    @triton.jit
    def _rows_kernel(START, LENGTHS, ROW_SEQ, ROW_LEN, R, T, BLK: tl.constexpr):
        # rows r = b * T + t: ROW_SEQ = b, ROW_LEN = clamp(min(start[b] + t + 1, start[b] + lengths[b]), 0)
        r = tl.program_id(0) * BLK + tl.arange(0, BLK)
        m = r < R
        b = r // T
        st = tl.load(START + b, mask=m, other=0).to(tl.int64)
        ln = tl.load(LENGTHS + b, mask=m, other=0).to(tl.int64)
        L = tl.maximum(tl.minimum(st + (r % T) + 1, st + ln), 0)
        tl.store(ROW_SEQ + r, b.to(tl.int32), mask=m)
        tl.store(ROW_LEN + r, L.to(tl.int32), mask=m)


_WS: dict = {}


def _interpreting() -> bool:
    """Under TRITON_INTERPRET=1 the kernels run on CPU tensors (Triton's interpreter: correctness checks only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tma_ok(k_codes: torch.Tensor) -> bool:
    """Hopper+ GPU, Triton's tensor descriptors and a 16-byte-aligned code pool."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return k_codes.is_cuda and torch.cuda.get_device_capability(k_codes.device)[0] >= 9 and k_codes.data_ptr() % 16 == 0


def _gluon_reason(k_codes: torch.Tensor, heads: int) -> str | None:
    from kimi_compile.plugins import wgmma_reason

    from . import gluon

    why = gluon.applies(k_codes, heads)
    if why is None and not _tma_ok(k_codes):
        why = "the Gluon score kernel needs a Hopper GPU with TMA and a 16-byte-aligned code pool"
    if why is None:  # Blackwell has TMA but no wgmma: the Triton score kernel runs there
        why = wgmma_reason(torch.cuda.get_device_capability(k_codes.device), "the Gluon score kernel")
    return why


def strategy_for(k_codes: torch.Tensor, heads: int, strategy: str = "auto") -> str:
    """The stage-1 strategy that runs: `strategy` itself when named, else "gluon" where it applies, else "triton"."""
    if strategy not in ("auto", *STRATEGIES):
        raise ValueError(f"indexer_topk: strategy must be 'auto' or one of {STRATEGIES}, got {strategy!r}")
    if strategy != "auto":
        return strategy
    return "gluon" if _gluon_reason(k_codes, heads) is None else "triton"


def _pow2_in(x: int, lo: int, hi: int) -> bool:
    return x & (x - 1) == 0 and lo <= x <= hi


def _unsupported(q, w, q_dtypes, codes, scales, block_table, topk: int, strategy: str) -> str | None:
    """Why the kernels do not apply (None when they do); q [..., H, D] and w [..., H] with the same leading dims."""
    H, D = q.shape[-2:]
    if D != HEAD_DIM:
        return f"indexer_topk: the index head dim (q's last) must be {HEAD_DIM}, got q {tuple(q.shape)}"
    if not _pow2_in(H, 16, 256):
        return f"indexer_topk: the index head count must be a power of two in [16, 256], got {H}"
    if tuple(w.shape) != tuple(q.shape[:-1]):
        return f"indexer_topk: w must be {tuple(q.shape[:-1])} (q's shape less the head dim), got {tuple(w.shape)}"
    for name, t, ok in (("q", q, q_dtypes), ("w", w, (torch.float32, torch.bfloat16)),
                        ("codes", codes, (torch.uint8, torch.float8_e4m3fn)), ("scales", scales, (torch.uint8,)),
                        ("block_table", block_table, (torch.int32, torch.int64))):
        if t.dtype not in ok:
            return f"indexer_topk: {name} must be {' or '.join(str(d) for d in ok)}, got {t.dtype}"
    if codes.dim() != 3 or codes.shape[-1] != HEAD_DIM:
        return f"indexer_topk: codes must be [NB, BS, {HEAD_DIM}], got {tuple(codes.shape)}"
    if tuple(scales.shape) != (*codes.shape[:2], HEAD_DIM // 32):
        return (f"indexer_topk: scales must be [NB, BS, {HEAD_DIM // 32}] (one E8M0 byte per 32 dims) = "
                f"{(*codes.shape[:2], HEAD_DIM // 32)}, got {tuple(scales.shape)}")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        return "indexer_topk: codes and scales must be contiguous pools"
    bs = codes.shape[1]
    if not _pow2_in(bs, 16, 256):
        return f"indexer_topk: the cache page (block_size) must be a power of two in [16, 256], got {bs}"
    if block_table.dim() != 2:
        return f"indexer_topk: block_table must be [B, MB], got {tuple(block_table.shape)}"
    if topk < 1:
        return f"indexer_topk: topk must be >= 1, got {topk}"
    if strategy not in ("auto", *STRATEGIES):
        return f"indexer_topk: strategy must be 'auto' or one of {STRATEGIES}, got {strategy!r}"
    devs = {t.device for t in (q, w, codes, scales, block_table)}
    if len(devs) != 1 or not (q.is_cuda or _interpreting()):
        return f"indexer_topk: every tensor must be on one CUDA device, got {sorted(map(str, devs))}"
    if triton is None:
        return "indexer_topk: triton is not installed"
    if strategy == "gluon":
        return _gluon_reason(codes, H)
    return None


def unsupported(q, w, codes, scales, block_table, start, lengths, topk: int, strategy: str = "auto") -> str | None:
    """Why `indexer_topk` cannot run these tensors (naming the field), or None when it can."""
    if q.dim() != 4:
        return f"indexer_topk: q must be [B, T, H, {HEAD_DIM}], got {tuple(q.shape)}"
    B = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != B:
        return f"indexer_topk: block_table must be [B={B}, MB], got {tuple(block_table.shape)}"
    for name, t in (("start", start), ("lengths", lengths)):
        if tuple(t.shape) != (B,) or t.dtype not in (torch.int32, torch.int64):
            return f"indexer_topk: {name} must be [B={B}] int32/int64, got {tuple(t.shape)} {t.dtype}"
        if t.device != q.device:
            return f"indexer_topk: {name} must be on {q.device}, got {t.device}"
    return _unsupported(q, w, (torch.bfloat16, torch.float32), codes, scales, block_table, topk, strategy)


def supports(q, w, codes, scales, block_table, start, lengths, topk: int, strategy: str = "auto") -> bool:
    """True when `indexer_topk` runs these tensors (`unsupported` gives the reason when it does not)."""
    return unsupported(q, w, codes, scales, block_table, start, lengths, topk, strategy) is None


def _group_size(bs: int) -> int:
    """Positions per group maximum written by the score kernels: GROUP (the candidate kernel merges them per row)."""
    return min(GROUP, bs)


def _gstride(cap: int, ngcap: int) -> int:
    """A row's maxima in the workspace: ngcap of G positions, then cap / COARSE of COARSE positions."""
    return ngcap + cap // COARSE


def _workspace(dev, R: int, cap: int, ngcap: int):
    """(scores, group maxima [R, _gstride], candidate scores, candidate positions, candidate counters), cached per
    shape; the counters reset themselves, so a workspace must not serve two calls in flight on different streams."""
    key = (str(dev), R, cap, ngcap)
    ws = _WS.get(key)
    if ws is None:
        f32 = dict(dtype=torch.float32, device=dev)
        ws = (torch.empty(R, cap, **f32), torch.empty(R, _gstride(cap, ngcap), **f32), torch.empty(R, cap, **f32),
              torch.empty(R, cap, dtype=torch.int32, device=dev), torch.zeros(R, dtype=torch.int32, device=dev))
        _WS[key] = ws
    return ws


def _scores(q, w, codes, scales, block_table, row_seq, row_len, topk: int, strategy: str):
    """Stage 1 into the workspace; returns (workspace, group size, group maxima per row, SM count)."""
    R, H, D = q.shape
    codes = codes.view(torch.uint8)  # float8_e4m3fn pools: the same bytes
    bs = codes.shape[1]
    cap = block_table.shape[1] * bs
    G = _group_size(bs)
    npages = triton.cdiv(cap, bs)
    ngcap = npages * (bs // G)
    ws = _workspace(q.device, R, cap, ngcap)
    nsm = num_sms(q.device)
    want = max(1, (PROGS_PER_SM * nsm) // max(R, 1))
    ppp = max(1, triton.cdiv(npages, want))  # pages per program: about PROGS_PER_SM programs per SM over all rows
    q, w = q.contiguous(), w.float().contiguous()
    if strategy_for(codes, H, strategy) == "gluon":
        from . import gluon

        gluon.launch_scores(q, w, codes, scales, block_table, row_seq, row_len, ws, cap, ngcap, G, COARSE, ppp)
        return ws, G, ngcap, nsm
    kd = None
    tma = _tma_ok(codes)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kd = TensorDescriptor.from_tensor(codes.view(-1, D).view(torch.float8_e4m3fn), [bs, 32])
    ppb = triton.next_power_of_2(ppp) if ppp <= 64 else 0
    _score_kernel[(R, triton.cdiv(npages, ppp))](
        q, w, codes, kd, scales.view(torch.int32), block_table, row_seq, row_len, ws[0], ws[1],
        block_table.stride(0), cap, _gstride(cap, ngcap), ngcap, ppp, BS=bs, H=H, G=G, GC=COARSE, NS=SCORE_STAGES,
        TMA=tma, PPB=ppb, num_warps=SCORE_WARPS, maxnreg=SCORE_MAXNREG)
    return ws, G, ngcap, nsm


def _candidates(ws, row_len, cap: int, ngcap: int, topk: int, G: int, nsm: int) -> None:
    """Stage 2: `_cand_kernel` appends each row's candidates to the workspace (ws[2], ws[3]) and counts them in
    ws[4] (which stage 3 reads and resets)."""
    sc, gm, cs, cp, cnt = ws
    R = row_len.shape[0]
    blk = 2048
    s2 = max(1, min(triton.cdiv(cap, blk), (CAND_PROGS_PER_SM * nsm) // max(R, 1)))
    chunk = triton.cdiv(triton.cdiv(cap, s2), blk) * blk
    ngb = min(triton.next_power_of_2(max(ngcap, 16)), max(4096, triton.next_power_of_2(2 * topk)))
    # the merged maxima live in registers: past 4096 of them (topk > 2048) twice the warps, or the kernel spills
    # (sm_90, NGB 16384: 640 bytes of stack a thread at 4 warps, none at 8)
    _cand_kernel[(R, triton.cdiv(cap, chunk))](sc, gm, cs, cp, cnt, row_len, cap, _gstride(cap, ngcap), ngcap, chunk,
                                                topk, G=G, GC=COARSE, NGB=ngb, BLK=blk,
                                                num_warps=CAND_WARPS if ngb <= 4096 else 2 * CAND_WARPS)


def _select(ws, row_len, out_i, out_s, cap: int, ngcap: int, topk: int, G: int, nsm: int, pad_score: float):
    """Stages 2 and 3: `_cand_kernel` (threshold from the group maxima + candidate compaction), then `_final_kernel`
    (exact selection among the candidates, in no particular order; slots past min(L, topk): -1 and pad_score).
    out_s None: out_i is a float64 [R, width] key workspace (width >= topk) and takes each selected slot's `_dkey`
    order key, -inf past the selection."""
    _candidates(ws, row_len, cap, ngcap, topk, G, nsm)
    cs, cp, cnt = ws[2:]
    R = row_len.shape[0]
    keys = out_s is None
    width = out_i.shape[1]
    _final_kernel[(R,)](cs, cp, cnt, row_len, out_i, out_i if keys else out_s, cap, topk, width, pad_score, CH=4096,
                        KP2=triton.next_power_of_2(width), KEYS=keys, num_warps=FINAL_WARPS)
    return out_i, out_s


def _rank_shape(R: int, topk: int, nsm: int) -> tuple[int, int]:
    """(slots, warps) per rank program: (128, 2) where that still gives RANK_PROGS_PER_SM programs per SM (4 slots
    per lane: one key load serves 4 comparisons), else (64, 4): few rows (decode at B=1) need more programs and
    more warps splitting each row's keys."""
    return (128, 2) if R * triton.cdiv(topk, 128) >= RANK_PROGS_PER_SM * nsm else (64, 4)


def _rank(keys: torch.Tensor, topk: int, out_i: torch.Tensor, out_s: torch.Tensor) -> None:
    """`_rank_kernel`: the key workspace keys [R, kp] float64 (kp = topk rounded up to RANK_CHK; `_select` with
    out_s None wrote it) -> out_i [R, topk] int64, out_s [R, topk] float32 contiguous, in the op's order, -1 / MASKED
    past the selection."""
    R, kp = keys.shape
    blk, w = _rank_shape(R, topk, num_sms(keys.device))
    _rank_kernel[(R, triton.cdiv(topk, blk))](keys, out_i, out_s, topk, kp, MASKED, BLK=blk, CHK=RANK_CHK, W=w,
                                              NS=RANK_STAGES, num_warps=w)


def _row_setup(start: torch.Tensor, lengths: torch.Tensor, B: int, T: int, dev):
    """(row_seq, row_len) [B * T] int32 of the op's rows r = b * T + t: the sequence b and the visible length
    clamp(min(start[b] + t + 1, start[b] + lengths[b]), 0), by one kernel (buffers cached per shape)."""
    key = ("rows", str(dev), B, T)
    if key not in _WS:
        _WS[key] = torch.empty(2, B * T, dtype=torch.int32, device=dev)
    rows = _WS[key]
    _rows_kernel[(triton.cdiv(B * T, 1024),)](start, lengths, rows[0], rows[1], B * T, T, BLK=1024, num_warps=4)
    return rows[0], rows[1]


def _check(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(reason)


def _no_unknown(fn: str, unknown: dict, known: str) -> None:
    if unknown:
        raise ValueError(f"{fn}: unknown keyword(s) {sorted(unknown)} (known: {known})")


def indexer_topk_rows(q: torch.Tensor, w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      block_table: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor, topk: int, *,
                      strategy: str = "auto", out: tuple[torch.Tensor, torch.Tensor] | None = None, **unknown):
    """The three stages on independent rows: q [R, H, 128] bf16, w [R, H], block_table int32 [S, MB] contiguous,
    row_seq [R] int32 (the sequence of each row), row_len [R] int32 (row r sees positions [0, row_len[r]) of its
    sequence) -> (indices [R, topk] int32, scores [R, topk] fp32): the min(topk, row_len) selected positions in no
    particular order, then -1 / -inf. out: optional preallocated (indices, scores), written in place."""
    _no_unknown("indexer_topk_rows", unknown, "strategy, out")
    if q.dim() != 3:
        raise ValueError(f"indexer_topk_rows: q must be [rows, H, {HEAD_DIM}], got {tuple(q.shape)}")
    _check(_unsupported(q, w, (torch.bfloat16,), codes, scales, block_table, topk, strategy))
    if block_table.dtype != torch.int32 or not block_table.is_contiguous():
        raise ValueError("indexer_topk_rows: block_table must be a contiguous int32 tensor")
    return _rows(q, w, codes, scales, block_table, row_seq, row_len, topk, strategy, out, float("-inf"))


def _rows(q, w, codes, scales, block_table, row_seq, row_len, topk: int, strategy: str, out, pad_score: float):
    ws, G, ngcap, nsm = _scores(q, w, codes, scales, block_table, row_seq, row_len, topk, strategy)
    R = q.shape[0]
    if out is None:
        out = (torch.empty(R, topk, dtype=torch.int32, device=q.device),
               torch.empty(R, topk, dtype=torch.float32, device=q.device))
    return _select(ws, row_len, out[0], out[1], ws[0].shape[1], ngcap, topk, G, nsm, pad_score)


def indexer_scores(q, w, codes, scales, block_table, row_seq, row_len, topk: int, *, strategy: str = "auto"):
    """Stage 1 alone (for stage timing): -> (scores [R, MB * BS], group maxima) workspace views; positions at or past
    a row's length hold stale values."""
    _check(_unsupported(q, w, (torch.bfloat16,), codes, scales, block_table, topk, strategy))
    ws, _, _, _ = _scores(q, w, codes, scales, block_table, row_seq, row_len, topk, strategy)
    return ws[0], ws[1]


def indexer_topk(q: torch.Tensor, w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 block_table: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, topk: int, *,
                 strategy: str = "auto", out: tuple[torch.Tensor, torch.Tensor] | None = None, sort: bool = True,
                 **unknown) -> tuple[torch.Tensor, torch.Tensor]:
    """kimi.IndexerTopK on the MXFP8 pools (the contract in the module docstring): q [B, T, H, 128], w [B, T, H],
    codes [NB, BS, 128] u8, scales [NB, BS, 4] u8, block_table [B, MB], start / lengths [B] ->
    (indices [B, T, topk] int64 sorted by score desc then position asc, -1 where none; scores [B, T, topk] fp32,
    -1e30 where none). out: optional preallocated (indices int64, scores fp32) [B, T, topk], written in place.
    sort False (the op's sorted=0): the same selection and scores in no particular order, the min(topk, L)
    selected slots first, then -1 / -1e30; the rank kernel and its key workspace are skipped."""
    _no_unknown("indexer_topk", unknown, "strategy, out, sort")
    if not isinstance(sort, bool):
        raise ValueError(f"indexer_topk: sort must be True or False, got {sort!r}")
    _check(unsupported(q, w, codes, scales, block_table, start, lengths, topk, strategy))
    B, T, H, D = q.shape
    R = B * T
    dev = q.device
    row_seq, row_len = _row_setup(start, lengths, B, T, dev)
    bt = block_table if block_table.dtype == torch.int32 and block_table.is_contiguous() else \
        block_table.to(torch.int32).contiguous()
    q2, w2 = q.reshape(R, H, D).to(torch.bfloat16), w.reshape(R, H)
    if out is None:
        out = (torch.empty(B, T, topk, dtype=torch.int64, device=dev),
               torch.empty(B, T, topk, dtype=torch.float32, device=dev))
    oi, os_ = out
    direct = all(o.is_contiguous() and tuple(o.shape) == (B, T, topk) for o in out) and \
        oi.dtype == torch.int64 and os_.dtype == torch.float32
    ti, ts = (oi, os_) if direct else (torch.empty(B, T, topk, dtype=torch.int64, device=dev),
                                      torch.empty(B, T, topk, dtype=torch.float32, device=dev))
    if sort:
        kp = triton.cdiv(topk, RANK_CHK) * RANK_CHK
        key = ("keys", str(dev), R, kp)
        if key not in _WS:  # the unordered selection as order keys, before the rank kernel puts it in the op's order
            _WS[key] = torch.empty(R, kp, dtype=torch.float64, device=dev)
        keys = _WS[key]
        _rows(q2, w2, codes, scales, bt, row_seq, row_len, topk, strategy, (keys, None), MASKED)
        _rank(keys, topk, ti.view(R, topk), ts.view(R, topk))
    else:  # the selection's own slots, int64 positions and -1 / MASKED past it (the stores widen the int32 values)
        _rows(q2, w2, codes, scales, bt, row_seq, row_len, topk, strategy, (ti.view(R, topk), ts.view(R, topk)),
              MASKED)
    if not direct:
        oi.copy_(ti)
        os_.copy_(ts)
    return out
