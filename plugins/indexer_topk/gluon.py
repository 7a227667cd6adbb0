"""Gluon (Triton's explicit-layout dialect) score kernel of the fused lightning indexer: strategy "gluon".

Stage 1 of plugins/indexer_topk/triton.py (same inputs, same workspace, same numbers as its Triton `_score_kernel`;
the candidate and final select kernels are shared). Applies where `applies()` says so: Gluon importable, a Hopper GPU
(TMA, wgmma: Blackwell has no wgmma), 64-key cache pages, 64 index heads, head dim 128, a 16-byte-aligned code pool.

Grid (rows, programs per row); program (r, s) scores pages [s * ppr, s * ppr + ppr) of row r's sequence, clipped to
the row's length L = ROW_LEN[r] (read on the device), ppr = the row's pages over the row's programs (at most ppp, which
the host sizes from the capacity). Per page:
- one TMA brings the page's codes ([64, 128] E4M3, the physical block from the block table) and a second one its
  E8M0 scale words ([1, 64] int32, four bytes per key) into a ring slot, both on the slot's mbarrier; a ring of
  `RING` = 2 slots keeps the next page in flight while this one computes;
- each thread reads 8 consecutive code bytes per row (64-bit shared loads): the 32 positions of every code group are
  permuted by a fixed permutation (`_kperm`), and q's columns by the same one, so the dot products are unchanged;
- codes -> fp16 pre-scaled by 2^(e_g - e_max) (exact above fp16's range floor) in the wgmma A-operand layout, four
  chained async wgmmas against q^T (fp16 in shared memory, scaled into range by a power of two: exact for bf16 q);
- score = sum_h w[h] * relu(acc[:, h]) * 2^(e_max - 127), stored for positions < L, and the max of every group of G
  positions and of every GC (-inf for positions >= L) stored for the threshold select.
Two thread barriers per page: ours guarding the refill of the slot read by the previous page, and one the compiler
places between the barrier's expect and the TMA.
"""

from __future__ import annotations

try:  # gluon ships with triton >= 3.5; optional like triton itself
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                 warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover
    gluon = None

RING = 2  # ring slots (pages in flight per program)
PAGE = 64  # keys per cache page the kernel is written for
HEADS = 64  # index heads the kernel is written for

if gluon is not None:

    @gluon.jit
    def _pow2(e):  # 2^e as fp32 for integer e (clamped to the normal range; below it flushes to 0)
        return (gl.minimum(gl.maximum(e + 127, 0), 254) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _issue(KD, SD, BT, bt_row, blk, bar, cbuf, sbuf, j, n, BS: gl.constexpr):
        # TMA of page j (physical block blk): its codes (all four groups, one [BS, 128] box) into cbuf and its
        # E8M0 scales (one int32 per row, a [1, BS] box) into sbuf, both on bar; returns the block of page j + 1
        # (a scalar load in flight until the next issue)
        live = j < n
        mbarrier.expect(bar, KD.block_type.nbytes + SD.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(KD, [blk * BS, 0], bar, cbuf, pred=live)
        tma.async_copy_global_to_shared(SD, [blk, 0], bar, sbuf, pred=live)
        return gl.load(BT + bt_row + j + 1, mask=j + 1 < n, other=0)

    @gluon.jit
    def _emax(ev):
        return gl.maximum(gl.maximum(ev & 255, (ev >> 8) & 255), gl.maximum((ev >> 16) & 255, (ev >> 24) & 255))

    @gluon.jit
    def _kperm(x, R: gl.constexpr):
        # [R, 32] tile, column p = 8t + 4s + 2j + e  ->  column k' = 16s + 8j + 2t + e (a fixed permutation of the
        # 32 dot-product positions of a code group; q's columns get the same one, so the dot is unchanged). It makes
        # the 8 codes a thread holds per row in the wgmma A-operand layout 8 consecutive bytes in shared memory.
        return gl.reshape(gl.permute(gl.reshape(x, [R, 4, 2, 2, 2]), (0, 2, 3, 1, 4)), [R, 32])

    @gluon.jit
    def _group(cbuf, g: gl.constexpr, ev, emax, aop: gl.constexpr):
        # code group g of the page in the wgmma A-operand registers: fp16, pre-scaled by 2^(e_g - e_max) (exact).
        # 8 consecutive bytes per thread and row (two 64-bit shared loads per group), then register renaming only:
        # the physical-order layout, the permutation, the A layout
        ld: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
        phys: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [8, 0], [0, 2], [0, 4]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
        c = gl.convert_layout(cbuf.slice(32 * g, 32, dim=1).load(ld), phys).to(gl.float16)
        c = gl.convert_layout(_kperm(c, 64), aop, assert_trivial=True)
        return c * _pow2(((ev >> (8 * g)) & 255) - emax).to(gl.float16)[:, None]

    @gluon.jit
    def _page(cbuf, sbuf, bar, phase, qbuf, wv, SC, GM, obase, gbase, nfine, pg, L,
              BS: gl.constexpr, H: gl.constexpr, G: gl.constexpr, GC: gl.constexpr, mma: gl.constexpr,
              aop: gl.constexpr):
        # one page from its ring slot: the rows' four E8M0 bytes in the two layouts they are used in (A rows,
        # accumulator rows), the four chained wgmmas, the epilogue and the stores
        row_c: gl.constexpr = gl.SliceLayout(1, mma)
        mbarrier.wait(bar, phase)
        s1 = sbuf._reinterpret(gl.int32, [BS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ev_a = s1.load(gl.SliceLayout(1, aop))
        ev_c = s1.load(row_c)
        emax_a = _emax(ev_a)
        a0 = _group(cbuf, 0, ev_a, emax_a, aop)
        a1 = _group(cbuf, 1, ev_a, emax_a, aop)
        a2 = _group(cbuf, 2, ev_a, emax_a, aop)
        a3 = _group(cbuf, 3, ev_a, emax_a, aop)
        acc = gl.zeros([BS, H], gl.float32, layout=mma)
        acc = warpgroup_mma(a0, qbuf.index(0).permute((1, 0)), acc, use_acc=False, is_async=True)
        acc = warpgroup_mma(a1, qbuf.index(1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a2, qbuf.index(2).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a3, qbuf.index(3).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1, a2, a3))[0]
        sc = gl.sum(gl.maximum(acc, 0.0) * wv[None, :], axis=1) * _pow2(_emax(ev_c) - 127)
        pos = pg * BS + gl.arange(0, BS, layout=row_c)
        valid = pos < L
        gl.store(SC + obase + pos, sc, mask=valid)
        sv = gl.where(valid, sc, float("-inf"))
        gm = gl.max(gl.reshape(sv, [BS // G, G]), axis=1)
        gl.store(GM + gbase + pg * (BS // G) + gl.arange(0, BS // G, layout=gm.type.layout), gm)
        gc = gl.max(gl.reshape(sv, [BS // GC, GC]), axis=1)
        gl.store(GM + gbase + nfine + pg * (BS // GC) + gl.arange(0, BS // GC, layout=gc.type.layout), gc)

    @gluon.jit
    def _score_kernel(Q, W, KD, SD, BT, ROW_SEQ, ROW_LEN, SC, GM, stride_bt, cap, gstride, nfine, ppp,
                      BS: gl.constexpr, H: gl.constexpr, G: gl.constexpr, GC: gl.constexpr, NS: gl.constexpr):
        gl.static_assert(gl.num_warps() == 4, "one warpgroup")
        gl.static_assert(NS == 2, "two ring slots")
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 16])
        aop: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        col_c: gl.constexpr = gl.SliceLayout(0, mma)
        qld: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, 32], gl.float16)

        r = gl.program_id(0)
        s = gl.program_id(1)
        L = gl.load(ROW_LEN + r)
        seq = gl.load(ROW_SEQ + r).to(gl.int64)
        # the row's own pages split evenly over the row's programs (a short row in a long cache keeps every program
        # busy); ppp, sized from the capacity, bounds it
        npr = gl.num_programs(1)
        ppr = gl.minimum(ppp, ((L + BS - 1) // BS + npr - 1) // npr)
        p0 = s * ppr
        n = gl.minimum(ppr, (L + BS - 1) // BS - p0)  # pages of this program (may be <= 0)
        bt_row = seq * stride_bt + p0

        # q^T group tiles -> fp16 in shared memory (B operands), scaled by a power of two into fp16 range, columns
        # permuted like the codes'
        hq = gl.arange(0, H, layout=gl.SliceLayout(1, qld))
        dq = gl.arange(0, 32, layout=gl.SliceLayout(0, qld))
        qb = Q + r.to(gl.int64) * H * 128 + hq[:, None] * 128 + dq[None, :]
        q0 = gl.load(qb).to(gl.float32)
        q1 = gl.load(qb + 32).to(gl.float32)
        q2 = gl.load(qb + 64).to(gl.float32)
        q3 = gl.load(qb + 96).to(gl.float32)
        qa = gl.maximum(gl.maximum(gl.abs(q0), gl.abs(q1)), gl.maximum(gl.abs(q2), gl.abs(q3)))
        qmax = gl.max(gl.max(qa, 1), 0)
        qe = ((qmax.to(gl.int32, bitcast=True) >> 23) & 255) - 127
        shift = gl.minimum(gl.maximum(gl.where(qmax > 0, 8 - qe, 0), -120), 120)
        qs = _pow2(shift)
        qbuf = gl.allocate_shared_memory(gl.float16, [4, H, 32], q_sl)
        q0 = (q0 * qs).to(gl.float16)
        q1 = (q1 * qs).to(gl.float16)
        q2 = (q2 * qs).to(gl.float16)
        q3 = (q3 * qs).to(gl.float16)
        qbuf.index(0).store(_kperm(q0, H))
        qbuf.index(1).store(_kperm(q1, H))
        qbuf.index(2).store(_kperm(q2, H))
        qbuf.index(3).store(_kperm(q3, H))
        wv = gl.load(W + r * H + gl.arange(0, H, layout=col_c)).to(gl.float32) * _pow2(-shift)

        # one code buffer, one scale buffer and one mbarrier per ring slot, separate allocations indexed statically
        # (the page loop is unrolled NS times), so the only thread barrier per page is the one guarding the refill
        cb = (gl.allocate_shared_memory(gl.float8e4nv, [BS, 128], KD.layout),
              gl.allocate_shared_memory(gl.float8e4nv, [BS, 128], KD.layout))
        sb = (gl.allocate_shared_memory(gl.int32, [1, BS], SD.layout),
              gl.allocate_shared_memory(gl.int32, [1, BS], SD.layout))
        bars = (gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout()))
        for k in gl.static_range(NS):
            mbarrier.init(bars[k], count=1)
        fence_async_shared()
        gl.thread_barrier()

        blk = gl.load(BT + bt_row, mask=n > 0, other=0)
        for k in gl.static_range(NS - 1):  # prologue: pages 0 .. NS-2 in flight
            blk = _issue(KD, SD, BT, bt_row, blk, bars[k], cb[k], sb[k], k, n, BS)

        obase = r.to(gl.int64) * cap
        gbase = r.to(gl.int64) * gstride
        for i0 in range(0, n, NS):
            for k in gl.static_range(NS):
                i = i0 + k
                if i < n:
                    gl.thread_barrier()  # every warp has read the slot refilled below (page i - 1)
                    kk: gl.constexpr = (k + NS - 1) % NS
                    blk = _issue(KD, SD, BT, bt_row, blk, bars[kk], cb[kk], sb[kk], i + NS - 1, n, BS)
                    _page(cb[k], sb[k], bars[k], (i // NS) & 1, qbuf, wv, SC, GM, obase, gbase, nfine, p0 + i, L, BS,
                          H, G, GC, mma, aop)

        for k in gl.static_range(NS):
            mbarrier.invalidate(bars[k])


def applies(k_codes, heads: int) -> str | None:
    """None when the Gluon score kernel can run on this pool with this many index heads, else the reason (the
    caller also needs a Hopper GPU (wgmma: `kimi_compile.plugins.wgmma_reason`) with TMA and a 16-byte-aligned pool:
    `triton._tma_ok`)."""
    if gluon is None:
        return "Gluon (triton >= 3.5) is not importable"
    if k_codes.shape[1] != PAGE:
        return f"the Gluon score kernel needs {PAGE}-key cache pages, got {k_codes.shape[1]}"
    if heads != HEADS:
        return f"the Gluon score kernel needs {HEADS} index heads, got {heads}"
    return None


def launch_scores(q, weights, k_codes, k_scales, block_table, row_seq, row_len, ws, cap: int, ngcap: int, G: int,
                  GC: int, ppp: int) -> None:
    """Stage 1 with `_score_kernel`: scores and group maxima of every row into the workspace ws = (scores [R, cap],
    maxima [R, ngcap + cap / GC]: ngcap of G positions, then those of GC positions, ...); q [R, 64, 128] bf16
    contiguous, weights [R, 64] fp32 contiguous, block_table int32 [S, MB]."""
    import triton

    R, H, _ = q.shape
    bs = k_codes.shape[1]
    kd, sd = descriptors(k_codes, k_scales)
    _score_kernel[(R, triton.cdiv(triton.cdiv(cap, bs), ppp))](
        q, weights, kd, sd, block_table, row_seq, row_len, ws[0], ws[1], block_table.stride(0), cap, ws[1].shape[1],
        ngcap, ppp, BS=bs, H=H, G=G, GC=GC, NS=RING, num_warps=4)


def descriptors(k_codes, k_scales):
    """Gluon TMA descriptors of one cache page: the [NB * BS, 128] E4M3 codes with a [BS, 128] box and the
    [NB, BS] int32 scale words (four E8M0 bytes per row) with a [1, BS] box."""
    import torch
    nb, bs = k_codes.shape[:2]
    codes = k_codes.view(-1, 128).view(torch.float8_e4m3fn)
    scales = k_scales.view(torch.int32).view(nb, bs)
    return (TensorDescriptor.from_tensor(codes, [bs, 128], gl.NVMMASharedLayout.get_default_for([bs, 128],
                                                                                                gl.float8e4nv)),
            TensorDescriptor.from_tensor(scales, [1, bs], gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                                               element_bitwidth=32)))
