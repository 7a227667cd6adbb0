"""Triton kernels: sparse MLA attention (absorbed / MQA, 576-wide keys, 512-wide values) over the FP8 tile-128 latent
cache at the selected positions. Semantics: plugins/sparse_mla/torch_ref.py.

v1: one program = (query row, block of BH=64 heads, split of the top-k list[, value-dim part]). Per tile of BN selected
positions it gathers the 656-byte rows through the block table, converts the E4M3 codes to bf16 (exact) and, instead
of dequantizing, folds the per-tile fp32 scale into the math: S = q_pe.k_pe + sum_t s_t (q_t . c_t) and
acc_t += (P * s_t) @ c_t, so the tensor cores see raw codes. Online softmax in base 2 (fp32). With one split the
program writes bf16 output directly; otherwise partial (out, lse) go to a workspace and `_combine_kernel` merges them.
Prefill is the same kernel with one row per query token (each its own selected set) and one block-table row.

impl "v5" is the default: two passes. Pass 1 (`_mla_scores_kernel`, grid rows x key tiles x head blocks) scores one
tile of TN selected keys for BH heads as one chained GEMM over the 576 dims (each 128-wide value tile dequantized to
bf16, exact for the ue8m0 scales) and writes, per head and tile, m = ceil(max S), l = sum exp2(S - m) and
p = exp2(S - m) in bf16, plus the cache row of every key. Pass 2 (`_mla_pv_kernel`, grid rows x 4 value tiles x head
blocks [x key splits]) reads the (m, l) pairs, forms the global max M and sum L, and runs out = sum_k w p v / L as a
GEMM loop with w = exp2(m - M): a power of two, so p is rounded to bf16 once, as in v1. Why: v1 keeps S, P, four fp32
value accumulators and q in one 8-warp program; at 255 registers it spills every iteration (ncu: 212 MB of local
loads at B=32) and its gathers are never overlapped. Split in two, each pass is a plain GEMM loop at <= 8 warps
without spills. H200 (bench/results/gpu_kernels_2026-12-02_v11.json): B=32 106.0 us vs v1 185.0, B=1 21.9 vs 21.6,
prefill T=1024 2987 vs 4862 us. Both passes are still latency bound (8 warps per SM, DRAM ~20% busy; ncu:
bench/results/ncu_sparse_mla_v5_2026-12-02.json): Triton's pipeliner single-buffers gathered tiles and loads the
index list synchronously, so the defaults prefetch the next step's operands into registers by hand (ns1 = -1,
num_stages = 0) for small batches, and cap pass 1 at 128 registers (two programs per SM) for large ones. Tried and
dropped (same file's notes): pass 1 looping over key tiles with q resident in shared memory (spills), the tile scale
folded into p, 64-wide value blocks, 16-warp pass 1, key splits at B=32.

v1 was the default before. v2/v3 (tile dequantized to bf16, single wide dots) and v4 (v1's math with 16/32/64 heads
per program, 1/2/4 value tiles per program, tl.range pipelining, per-tile q reload, optional merge in the last
program) are kept for the bench; all measured slower than v1 on the H200 (bench/results/gpu_kernels_2026-12-02_v3.json):
the 8-warp programs sit at 255 registers with spills (ncu: bench/results/ncu_indexer_mla_2026-12-02.json), and a merge
done by one program reads every split's partial alone (94 us at B=1). The split merge (`_combine_kernel`) is shared by
v1 (one program per row and head) and v4 (per 128 value dims for small batches). Tried in the fifth pass and dropped
(bench/results/gpu_kernels_2026-12-02_v6.json): programmatic dependent launch of the merge (B=1 28.5 vs 22.8 us, B=32
no change) and bf16 split partials (B=32 201 vs 186 us; more error).
"""

from __future__ import annotations

import torch

try:  # triton is optional: importing this module on a CPU machine without it must work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _q_tiles(qrow, d, de):
        # q of BH heads: four [BH, 128] latent tiles and the [BH, 64] rope part
        return (tl.load(qrow + d[None, :]), tl.load(qrow + 128 + d[None, :]), tl.load(qrow + 256 + d[None, :]),
                tl.load(qrow + 384 + d[None, :]), tl.load(qrow + 512 + de[None, :]))

    @triton.jit
    def _gather_tile(KV8, KV32, KV16, BT, IDX, seq, stride_bt, ibase, n0, end, d, de, BS: tl.constexpr,
                     BN: tl.constexpr):
        # BN selected rows: validity, the four E4M3 code tiles as bf16 (exact), their fp32 tile scales, rope part
        nn = n0 + tl.arange(0, BN)
        ids = tl.load(IDX + ibase + nn, mask=nn < end, other=-1)
        valid = ids >= 0
        blk = tl.load(BT + seq * stride_bt + ids // BS, mask=valid, other=0).to(tl.int64)
        row = blk * BS + ids % BS
        cp = KV8 + row[:, None] * 656 + d[None, :]
        c0 = tl.load(cp, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        c1 = tl.load(cp + 128, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        c2 = tl.load(cp + 256, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        c3 = tl.load(cp + 384, mask=valid[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        sp32 = KV32 + row * 164 + 128
        s0 = tl.load(sp32, mask=valid, other=0.0)
        s1 = tl.load(sp32 + 1, mask=valid, other=0.0)
        s2 = tl.load(sp32 + 2, mask=valid, other=0.0)
        s3 = tl.load(sp32 + 3, mask=valid, other=0.0)
        kpe = tl.load(KV16 + row[:, None] * 328 + 264 + de[None, :], mask=valid[:, None], other=0.0)
        return valid, c0, c1, c2, c3, s0, s1, s2, s3, kpe

    @triton.jit
    def _softmax_step(q0, q1, q2, q3, qe, c0, c1, c2, c3, s0, s1, s2, s3, kpe, valid, m_i, l_i, qk_scale_log2):
        # S = q_pe.k_pe + sum_t s_t (q_t . c_t) on the raw codes; one online-softmax step in base 2
        s = tl.dot(qe, tl.trans(kpe))
        s += tl.dot(q0, tl.trans(c0)) * s0[None, :]
        s += tl.dot(q1, tl.trans(c1)) * s1[None, :]
        s += tl.dot(q2, tl.trans(c2)) * s2[None, :]
        s += tl.dot(q3, tl.trans(c3)) * s3[None, :]
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _store_tiles(ptr, acc0, acc1, acc2, acc3, inv, NACC: tl.constexpr, BF16: tl.constexpr):
        # NACC [BH, 128] value tiles times 1/l at ptr, ptr + 128, ...
        if BF16:
            tl.store(ptr, (acc0 * inv[:, None]).to(tl.bfloat16))
            if NACC >= 2:
                tl.store(ptr + 128, (acc1 * inv[:, None]).to(tl.bfloat16))
            if NACC == 4:
                tl.store(ptr + 256, (acc2 * inv[:, None]).to(tl.bfloat16))
                tl.store(ptr + 384, (acc3 * inv[:, None]).to(tl.bfloat16))
        else:
            tl.store(ptr, acc0 * inv[:, None])
            if NACC >= 2:
                tl.store(ptr + 128, acc1 * inv[:, None])
            if NACC == 4:
                tl.store(ptr + 256, acc2 * inv[:, None])
                tl.store(ptr + 384, acc3 * inv[:, None])

    @triton.jit
    def _sparse_mla_kernel(Q, KV8, KV32, KV16, BT, ROW_SEQ, IDX, O, OPART, LSE, qk_scale_log2,
                           stride_bt, topk, per_split,
                           BS: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                           NACC: tl.constexpr, NSPLIT: tl.constexpr):
        r = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2) // (4 // NACC)
        pdv = tl.program_id(2) % (4 // NACC)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        hh = hb * BH + tl.arange(0, BH)
        d = tl.arange(0, 128)
        de = tl.arange(0, 64)
        qrow = Q + (r.to(tl.int64) * H + hh[:, None]) * 576
        q0, q1, q2, q3, qe = _q_tiles(qrow, d, de)
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc0 = tl.zeros([BH, 128], tl.float32)
        acc1 = tl.zeros([BH, 128], tl.float32)  # value tiles past NACC stay unused (dead, never loop-carried)
        acc2 = tl.zeros([BH, 128], tl.float32)
        acc3 = tl.zeros([BH, 128], tl.float32)
        start = sp * per_split
        end = tl.minimum(start + per_split, topk)
        for n0 in range(start, end, BN):
            valid, c0, c1, c2, c3, s0, s1, s2, s3, kpe = _gather_tile(KV8, KV32, KV16, BT, IDX, seq, stride_bt,
                                                                      r.to(tl.int64) * topk, n0, end, d, de, BS, BN)
            p, alpha, m_i, l_i = _softmax_step(q0, q1, q2, q3, qe, c0, c1, c2, c3, s0, s1, s2, s3, kpe, valid, m_i,
                                               l_i, qk_scale_log2)
            if NACC == 4:
                acc0 = acc0 * alpha[:, None] + tl.dot((p * s0[None, :]).to(tl.bfloat16), c0)
                acc1 = acc1 * alpha[:, None] + tl.dot((p * s1[None, :]).to(tl.bfloat16), c1)
                acc2 = acc2 * alpha[:, None] + tl.dot((p * s2[None, :]).to(tl.bfloat16), c2)
                acc3 = acc3 * alpha[:, None] + tl.dot((p * s3[None, :]).to(tl.bfloat16), c3)
            elif NACC == 2:
                if pdv == 0:
                    acc0 = acc0 * alpha[:, None] + tl.dot((p * s0[None, :]).to(tl.bfloat16), c0)
                    acc1 = acc1 * alpha[:, None] + tl.dot((p * s1[None, :]).to(tl.bfloat16), c1)
                else:
                    acc0 = acc0 * alpha[:, None] + tl.dot((p * s2[None, :]).to(tl.bfloat16), c2)
                    acc1 = acc1 * alpha[:, None] + tl.dot((p * s3[None, :]).to(tl.bfloat16), c3)
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        if NSPLIT == 1:
            orow = O + (r.to(tl.int64) * H + hh[:, None]) * 512 + pdv * (128 * NACC) + d[None, :]
            _store_tiles(orow, acc0, acc1, acc2, acc3, inv, NACC, True)
        else:
            prow = OPART + ((r.to(tl.int64) * NSPLIT + sp) * H + hh[:, None]) * 512 + pdv * (128 * NACC) + d[None, :]
            _store_tiles(prow, acc0, acc1, acc2, acc3, inv, NACC, False)
            if pdv == 0:
                lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
                tl.store(LSE + (r.to(tl.int64) * NSPLIT + sp) * H + hh, lse)

    @triton.jit
    def _sparse_mla_v2_kernel(Q, KV8, KV32, KV16, BT, ROW_SEQ, IDX, O, OPART, LSE, qk_scale_log2,
                              stride_bt, topk, per_split,
                              BS: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                              NSPLIT: tl.constexpr):
        # v2: dequantize the tile to bf16 in registers (code * 2^k is exact in bf16), then one [BH,512]x[512,BN]
        # dot, one [BH,64]x[64,BN] dot and one [BH,BN]x[BN,512] dot per tile.
        r = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        hh = hb * BH + tl.arange(0, BH)
        d = tl.arange(0, 512)
        de = tl.arange(0, 64)
        qrow = Q + (r.to(tl.int64) * H + hh[:, None]) * 576
        qn = tl.load(qrow + d[None, :])
        qe = tl.load(qrow + 512 + de[None, :])
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, 512], tl.float32)
        start = sp * per_split
        end = tl.minimum(start + per_split, topk)
        for n0 in range(start, end, BN):
            nn = n0 + tl.arange(0, BN)
            ids = tl.load(IDX + r.to(tl.int64) * topk + nn, mask=nn < end, other=-1)
            valid = ids >= 0
            blk = tl.load(BT + seq * stride_bt + ids // BS, mask=valid, other=0).to(tl.int64)
            row = blk * BS + ids % BS
            c = tl.load(KV8 + row[:, None] * 656 + d[None, :], mask=valid[:, None], other=0)
            sc = tl.load(KV32 + row[:, None] * 164 + 128 + d[None, :] // 128, mask=valid[:, None], other=0.0)
            kv = (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(tl.bfloat16)
            kpe = tl.load(KV16 + row[:, None] * 328 + 264 + de[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(qn, tl.trans(kv))
            s = tl.dot(qe, tl.trans(kpe), s)
            s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            acc = tl.dot(p.to(tl.bfloat16), kv, acc * alpha[:, None])
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        if NSPLIT == 1:
            tl.store(O + (r.to(tl.int64) * H + hh[:, None]) * 512 + d[None, :], (acc * inv[:, None]).to(tl.bfloat16))
        else:
            tl.store(OPART + ((r.to(tl.int64) * NSPLIT + sp) * H + hh[:, None]) * 512 + d[None, :], acc * inv[:, None])
            lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
            tl.store(LSE + (r.to(tl.int64) * NSPLIT + sp) * H + hh, lse)

    @triton.jit
    def _mla_rows(IDX, BT, seq, stride_bt, ibase, n0, end, BS: tl.constexpr, BN: tl.constexpr):
        nn = n0 + tl.arange(0, BN)
        ids = tl.load(IDX + ibase + nn, mask=nn < end, other=-1)
        valid = ids >= 0
        blk = tl.load(BT + seq * stride_bt + ids // BS, mask=valid, other=0).to(tl.int64)
        return blk * BS + ids % BS, valid

    @triton.jit
    def _sparse_mla_v3_kernel(Q, KV8, KV32, KV16, BT, ROW_SEQ, IDX, O, OPART, LSE, qk_scale_log2,
                              stride_bt, topk, per_split,
                              BS: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                              NSPLIT: tl.constexpr):
        # v3 = v2's single wide dots, with (a) the four tile scales loaded once per row ([BN,4]) and applied
        # through a [BN,4,128] view in bf16 (power-of-two scales: exact), and (b) a manual software pipeline: the
        # 656-byte rows of tile t+1 are in flight and the block-table lookups of tile t+2 issued while tile t is
        # computed (the gather chain idx -> block table -> row is three dependent loads).
        r = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        ibase = r.to(tl.int64) * topk
        hh = hb * BH + tl.arange(0, BH)
        d = tl.arange(0, 512)
        de = tl.arange(0, 64)
        d4 = tl.arange(0, 4)
        qrow = Q + (r.to(tl.int64) * H + hh[:, None]) * 576
        qn = tl.load(qrow + d[None, :])
        qe = tl.load(qrow + 512 + de[None, :])
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, 512], tl.float32)
        start = sp * per_split
        end = tl.minimum(start + per_split, topk)
        row, valid = _mla_rows(IDX, BT, seq, stride_bt, ibase, start, end, BS, BN)
        c = tl.load(KV8 + row[:, None] * 656 + d[None, :], mask=valid[:, None], other=0)
        scl = tl.load(KV32 + row[:, None] * 164 + 128 + d4[None, :], mask=valid[:, None], other=0.0)
        kpe = tl.load(KV16 + row[:, None] * 328 + 264 + de[None, :], mask=valid[:, None], other=0.0)
        rown, validn = _mla_rows(IDX, BT, seq, stride_bt, ibase, start + BN, end, BS, BN)
        for n0 in range(start, end, BN):
            cn = tl.load(KV8 + rown[:, None] * 656 + d[None, :], mask=validn[:, None], other=0)
            scln = tl.load(KV32 + rown[:, None] * 164 + 128 + d4[None, :], mask=validn[:, None], other=0.0)
            kpen = tl.load(KV16 + rown[:, None] * 328 + 264 + de[None, :], mask=validn[:, None], other=0.0)
            rown2, validn2 = _mla_rows(IDX, BT, seq, stride_bt, ibase, n0 + 2 * BN, end, BS, BN)
            c3 = tl.reshape(c.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), [BN, 4, 128])
            kv = tl.reshape(c3 * scl.to(tl.bfloat16)[:, :, None], [BN, 512])
            s = tl.dot(qn, tl.trans(kv))
            s = tl.dot(qe, tl.trans(kpe), s)
            s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            acc = tl.dot(p.to(tl.bfloat16), kv, acc * alpha[:, None])
            c, scl, kpe, valid = cn, scln, kpen, validn
            rown, validn = rown2, validn2
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        if NSPLIT == 1:
            tl.store(O + (r.to(tl.int64) * H + hh[:, None]) * 512 + d[None, :], (acc * inv[:, None]).to(tl.bfloat16))
        else:
            tl.store(OPART + ((r.to(tl.int64) * NSPLIT + sp) * H + hh[:, None]) * 512 + d[None, :], acc * inv[:, None])
            lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
            tl.store(LSE + (r.to(tl.int64) * NSPLIT + sp) * H + hh, lse)

    # ------------------------------------------------------------------ v4: split-K, pipelined, fused combine
    @triton.jit
    def _sparse_mla_v4_kernel(Q, KV8, KV32, KV16, BT, ROW_SEQ, IDX, O, OPART, LSE, ARR, qk_scale_log2,
                              stride_bt, topk, per_split,
                              BS: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                              NACC: tl.constexpr, NSPLIT: tl.constexpr, NS: tl.constexpr, QLOOP: tl.constexpr,
                              FUSED: tl.constexpr, NSP2: tl.constexpr):
        # v1's math (raw E4M3 codes into the tensor cores, tile scales folded into S and P) with: BH in {16, 32,
        # 64} heads per program (mma.sync below 64), NACC value tiles of 128 per program (4 // NACC value parts
        # in the grid, each recomputing S), q held in registers or re-read per tile (QLOOP: fewer registers),
        # the gather loop software-pipelined by tl.range, and with FUSED the split merge done by the last
        # program of each (row, head block, value part) to arrive (acq_rel counter): no second launch.
        NDV: tl.constexpr = 4 // NACC
        r = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2) // NDV
        pdv = tl.program_id(2) % NDV
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        hh = hb * BH + tl.arange(0, BH)
        d = tl.arange(0, 128)
        de = tl.arange(0, 64)
        qrow = Q + (r.to(tl.int64) * H + hh[:, None]) * 576
        if not QLOOP:
            q0, q1, q2, q3, qe = _q_tiles(qrow, d, de)
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc0 = tl.zeros([BH, 128], tl.float32)
        acc1 = tl.zeros([BH, 128], tl.float32)  # value tiles past NACC stay unused (dead, never loop-carried)
        acc2 = tl.zeros([BH, 128], tl.float32)
        acc3 = tl.zeros([BH, 128], tl.float32)
        start = sp * per_split
        end = tl.minimum(start + per_split, topk)
        for n0 in tl.range(start, end, BN, num_stages=NS):
            valid, c0, c1, c2, c3, s0, s1, s2, s3, kpe = _gather_tile(KV8, KV32, KV16, BT, IDX, seq, stride_bt,
                                                                      r.to(tl.int64) * topk, n0, end, d, de, BS, BN)
            if QLOOP:
                q0, q1, q2, q3, qe = _q_tiles(qrow, d, de)
            p, alpha, m_i, l_i = _softmax_step(q0, q1, q2, q3, qe, c0, c1, c2, c3, s0, s1, s2, s3, kpe, valid, m_i,
                                               l_i, qk_scale_log2)
            if NACC == 4:
                acc0 = tl.dot((p * s0[None, :]).to(tl.bfloat16), c0, acc0 * alpha[:, None])
                acc1 = tl.dot((p * s1[None, :]).to(tl.bfloat16), c1, acc1 * alpha[:, None])
                acc2 = tl.dot((p * s2[None, :]).to(tl.bfloat16), c2, acc2 * alpha[:, None])
                acc3 = tl.dot((p * s3[None, :]).to(tl.bfloat16), c3, acc3 * alpha[:, None])
            elif NACC == 2:
                if pdv == 0:
                    va, sa, vb, sb = c0, s0, c1, s1
                else:
                    va, sa, vb, sb = c2, s2, c3, s3
                acc0 = tl.dot((p * sa[None, :]).to(tl.bfloat16), va, acc0 * alpha[:, None])
                acc1 = tl.dot((p * sb[None, :]).to(tl.bfloat16), vb, acc1 * alpha[:, None])
            else:
                if pdv == 0:
                    va, sa = c0, s0
                elif pdv == 1:
                    va, sa = c1, s1
                elif pdv == 2:
                    va, sa = c2, s2
                else:
                    va, sa = c3, s3
                acc0 = tl.dot((p * sa[None, :]).to(tl.bfloat16), va, acc0 * alpha[:, None])
        inv = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        dv0 = pdv * (128 * NACC)
        if NSPLIT == 1:
            orow = O + (r.to(tl.int64) * H + hh[:, None]) * 512 + dv0 + d[None, :]
            _store_tiles(orow, acc0, acc1, acc2, acc3, inv, NACC, True)
        else:
            prow = OPART + ((r.to(tl.int64) * NSPLIT + sp) * H + hh[:, None]) * 512 + dv0 + d[None, :]
            _store_tiles(prow, acc0, acc1, acc2, acc3, inv, NACC, False)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
            tl.store(LSE + ((r.to(tl.int64) * NSPLIT + sp) * NDV + pdv) * H + hh, lse)
            if FUSED:
                tl.debug_barrier()
                cidx = (r * (H // BH) + hb) * NDV + pdv
                old = tl.atomic_add(ARR + cidx, 1, sem="acq_rel")
                if old == NSPLIT - 1:
                    tl.store(ARR + cidx, 0)
                    sa_ = tl.arange(0, NSP2)
                    la = tl.load(LSE + ((r.to(tl.int64) * NSPLIT + sa_[:, None]) * NDV + pdv) * H + hh[None, :],
                                 mask=(sa_ < NSPLIT)[:, None], other=float("-inf"), cache_modifier=".cg")
                    mx = tl.max(la, 0)
                    mx = tl.where(mx == float("-inf"), 0.0, mx)
                    tot = tl.sum(tl.exp2(la - mx[None, :]), 0)
                    rt = tl.where(tot > 0, 1.0 / tot, 0.0)
                    for i in tl.static_range(NACC):
                        o = tl.zeros([BH, 128], tl.float32)
                        for s_ in range(NSPLIT):
                            ls = tl.load(LSE + ((r.to(tl.int64) * NSPLIT + s_) * NDV + pdv) * H + hh,
                                         cache_modifier=".cg")
                            wgt = tl.exp2(ls - mx) * rt
                            part = tl.load(OPART + ((r.to(tl.int64) * NSPLIT + s_) * H + hh[:, None]) * 512 + dv0
                                           + i * 128 + d[None, :], cache_modifier=".cg")
                            o += wgt[:, None] * part
                        tl.store(O + (r.to(tl.int64) * H + hh[:, None]) * 512 + dv0 + i * 128 + d[None, :],
                                 o.to(tl.bfloat16))

    @triton.jit
    def _combine_kernel(OPART, LSE, O, H: tl.constexpr, NSPLIT: tl.constexpr, NSP2: tl.constexpr,
                        NDV: tl.constexpr, DVB: tl.constexpr):
        # grid (rows, heads, 512 // DVB): one program merges DVB value dims of one head over the splits
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, NSP2)
        sm = s < NSPLIT
        d = tl.program_id(2) * DVB + tl.arange(0, DVB)
        if NDV == 1:  # one (max, sum) per split and head: 1-D weights
            lse = tl.load(LSE + (r.to(tl.int64) * NSPLIT + s) * H + h, mask=sm, other=float("-inf"))
            mx = tl.max(lse, 0)
            mx = tl.where(mx == float("-inf"), 0.0, mx)
            w1 = tl.exp2(lse - mx)
            tot = tl.sum(w1, 0)
            wgt = (w1 * tl.where(tot > 0, 1.0 / tot, 0.0))[:, None]
        else:  # v4: each value part has its own (max, sum)
            pdv = d // (512 // NDV)
            lse = tl.load(LSE + ((r.to(tl.int64) * NSPLIT + s[:, None]) * NDV + pdv[None, :]) * H + h,
                          mask=sm[:, None], other=float("-inf"))
            mx = tl.max(lse, 0)
            mx = tl.where(mx == float("-inf"), 0.0, mx)
            wgt = tl.exp2(lse - mx[None, :])
            tot = tl.sum(wgt, 0)
            wgt = wgt * tl.where(tot > 0, 1.0 / tot, 0.0)[None, :]
        o = tl.load(OPART + ((r.to(tl.int64) * NSPLIT + s[:, None]) * H + h) * 512 + d[None, :], mask=sm[:, None],
                    other=0.0)
        tl.store(O + (r.to(tl.int64) * H + h) * 512 + d, tl.sum(o * wgt, 0).to(tl.bfloat16))


    # ------------------------------------------------------------------ v5: two passes, plain GEMM loops
    @triton.jit
    def _dequant_tile(KV8, KV32, row, valid, t, d):
        # [BN, 128] value tile t of the gathered rows in bf16: code * 2^k is exact in bf16 (ue8m0 tile scales)
        c = tl.load(KV8 + row[:, None] * 656 + t * 128 + d[None, :], mask=valid[:, None], other=0)
        sc = tl.load(KV32 + row * 164 + 128 + t, mask=valid, other=0.0)
        return (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(tl.bfloat16)

    @triton.jit
    def _mla_scores_kernel(Q, KV8, KV32, KV16, BT, ROW_SEQ, IDX, P, MT, LT, ROWS, qk_scale_log2, stride_bt, topk,
                           tpad, BS: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                           NS1: tl.constexpr):
        # pass 1, grid (rows, key tiles of BN, head blocks of BH): S = q . kv^T over the 576 dims as one chained
        # GEMM (K = 4 x 128 dequantized value tiles + 64 rope dims), then per (head, tile) m = ceil(max S), the sum
        # l of p = exp2(S - m), and p itself (bf16) into the [rows, H, tpad] workspace; head block 0 also writes
        # the cache row of every key (-1: none) so that pass 2 gathers with one load instead of a chain of three.
        # NS1 = -1: the loads of value tile t + 1 (and its q tile) are issued before tile t is converted and
        # multiplied (more registers); 0: plain unrolled.
        r = tl.program_id(0)
        j = tl.program_id(1)
        hb = tl.program_id(2)
        seq = tl.load(ROW_SEQ + r).to(tl.int64)
        row, valid = _mla_rows(IDX, BT, seq, stride_bt, r.to(tl.int64) * topk, j * BN, topk, BS, BN)
        nn = j * BN + tl.arange(0, BN)
        if hb == 0:
            tl.store(ROWS + r.to(tl.int64) * tpad + nn, tl.where(valid, row, -1).to(tl.int32))
        hh = hb * BH + tl.arange(0, BH)
        d = tl.arange(0, 128)
        de = tl.arange(0, 64)
        qrow = Q + (r.to(tl.int64) * H + hh[:, None]) * 576
        if NS1 == -1:
            c_nx = tl.load(KV8 + row[:, None] * 656 + d[None, :], mask=valid[:, None], other=0)
            sc_nx = tl.load(KV32 + row * 164 + 128, mask=valid, other=0.0)
            q_nx = tl.load(qrow + d[None, :])
            kpe = tl.load(KV16 + row[:, None] * 328 + 264 + de[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(tl.load(qrow + 512 + de[None, :]), tl.trans(kpe))
            for t in tl.static_range(4):
                c, sc, qt = c_nx, sc_nx, q_nx
                if t < 3:
                    c_nx = tl.load(KV8 + row[:, None] * 656 + (t + 1) * 128 + d[None, :], mask=valid[:, None],
                                   other=0)
                    sc_nx = tl.load(KV32 + row * 164 + 129 + t, mask=valid, other=0.0)
                    q_nx = tl.load(qrow + (t + 1) * 128 + d[None, :])
                kv = (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(tl.bfloat16)
                s = tl.dot(qt, tl.trans(kv), s)
        else:
            kpe = tl.load(KV16 + row[:, None] * 328 + 264 + de[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(tl.load(qrow + 512 + de[None, :]), tl.trans(kpe))
            for t in tl.static_range(4):
                kv = _dequant_tile(KV8, KV32, row, valid, t, d)
                s = tl.dot(tl.load(qrow + t * 128 + d[None, :]), tl.trans(kv), s)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m = tl.ceil(tl.max(s, 1))  # an integer: pass 2's tile weights exp2(m - max) are powers of two (exact)
        p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
        tl.store(P + (r.to(tl.int64) * H + hh[:, None]) * tpad + nn[None, :], p.to(tl.bfloat16))
        mbase = (r.to(tl.int64) * tl.num_programs(1) + j) * H + hh
        tl.store(MT + mbase, m)
        tl.store(LT + mbase, tl.sum(p, 1))

    @triton.jit
    def _pv_operands(P, MT, KV8, KV32, ROWS, r, c0, hh, mx, k0, end, tpad, d, H: tl.constexpr, BK: tl.constexpr,
                     NT: tl.constexpr, TN: tl.constexpr):
        # step k0's operands: the value columns c0 + d of the BK keys' rows, their tile scale, p and the tile weight
        kk = k0 + tl.arange(0, BK)
        row = tl.load(ROWS + r.to(tl.int64) * tpad + kk, mask=kk < end, other=-1)
        valid = row >= 0
        row = row.to(tl.int64)
        c = tl.load(KV8 + row[:, None] * 656 + c0 + d[None, :], mask=valid[:, None], other=0)
        sc = tl.load(KV32 + row * 164 + 128 + c0 // 128, mask=valid, other=0.0)
        p = tl.load(P + (r.to(tl.int64) * H + hh[:, None]) * tpad + kk[None, :], mask=(kk < end)[None, :], other=0.0)
        if BK <= TN:  # one pass-1 tile: one weight per head
            wj = tl.exp2(tl.load(MT + (r.to(tl.int64) * NT + k0 // TN) * H + hh) - mx)
        else:  # BK // TN tiles: [BH, BK // TN] weights
            jw = tl.minimum(k0 // TN + tl.arange(0, BK // TN), NT - 1)
            wj = tl.exp2(tl.load(MT + (r.to(tl.int64) * NT + jw[None, :]) * H + hh[:, None]) - mx[:, None])
        return c, sc, p, wj

    @triton.jit
    def _weighted_p(p, wj, BH: tl.constexpr, BK: tl.constexpr, TN: tl.constexpr):
        # p * w (fp32): w per head, or per head and pass-1 tile when a step spans BK // TN tiles
        if BK <= TN:
            pw = p.to(tl.float32) * wj[:, None]
        else:
            pw = tl.reshape(tl.reshape(p.to(tl.float32), [BH, BK // TN, TN]) * wj[:, :, None], [BH, BK])
        return pw

    @triton.jit
    def _pv_step(acc, c, sc, p, wj, BH: tl.constexpr, BK: tl.constexpr, TN: tl.constexpr):
        v = (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(tl.bfloat16)
        return tl.dot(_weighted_p(p, wj, BH, BK, TN).to(tl.bfloat16), v, acc)

    @triton.jit
    def _mla_pv_kernel(P, MT, LT, ROWS, KV8, KV32, O, OPART, topk, tpad, per_split,
                       H: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, NT: tl.constexpr, NT2: tl.constexpr,
                       TN: tl.constexpr, NSPLIT: tl.constexpr, NS: tl.constexpr):
        # pass 2, grid (rows, 4 value tiles of 128, head blocks x splits): the global max M and sum L
        # per head from the NT tile pairs, then out[:, cols] = (sum_k w(k) p(k) v(k)) / L with w = exp2(m_tile - M),
        # one GEMM loop over the keys (BK per step, one or several of pass 1's TN-key tiles). The m are integers, so
        # w is a power of two and w * p (bf16) is exact: p is rounded once, as in v1. With splits the partial sums
        # (already divided by L) go to OPART and `_sum_kernel` adds them. NS = 0: the next step's operands are
        # loaded (into registers) before this step's product; NS > 0: Triton's pipeliner with NS stages.
        r = tl.program_id(0)
        c0 = tl.program_id(1) * 128
        hb = tl.program_id(2) // NSPLIT
        sp = tl.program_id(2) % NSPLIT
        hh = hb * BH + tl.arange(0, BH)
        d = tl.arange(0, 128)
        jt = tl.arange(0, NT2)
        mt = tl.load(MT + (r.to(tl.int64) * NT + jt[:, None]) * H + hh[None, :], mask=(jt < NT)[:, None],
                     other=float("-inf"))
        lt = tl.load(LT + (r.to(tl.int64) * NT + jt[:, None]) * H + hh[None, :], mask=(jt < NT)[:, None], other=0.0)
        mx = tl.max(mt, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        tot = tl.sum(tl.exp2(mt - mx[None, :]) * lt, 0)
        rt = tl.where(tot > 0, 1.0 / tot, 0.0)
        acc = tl.zeros([BH, 128], tl.float32)
        start = sp * per_split
        end = tl.minimum(start + per_split, topk)
        if NS == 0:
            c_nx, sc_nx, p_nx, w_nx = _pv_operands(P, MT, KV8, KV32, ROWS, r, c0, hh, mx, start, end, tpad, d, H, BK,
                                                   NT, TN)
            for k0 in range(start, end, BK):
                c, sc, p, wj = c_nx, sc_nx, p_nx, w_nx
                nxt = tl.where(k0 + BK < end, k0 + BK, k0)  # past the end: reload this step (in bounds, unused)
                c_nx, sc_nx, p_nx, w_nx = _pv_operands(P, MT, KV8, KV32, ROWS, r, c0, hh, mx, nxt, end, tpad, d, H,
                                                       BK, NT, TN)
                acc = _pv_step(acc, c, sc, p, wj, BH, BK, TN)
        else:
            for k0 in tl.range(start, end, BK, num_stages=NS):
                c, sc, p, wj = _pv_operands(P, MT, KV8, KV32, ROWS, r, c0, hh, mx, k0, end, tpad, d, H, BK, NT, TN)
                acc = _pv_step(acc, c, sc, p, wj, BH, BK, TN)
        acc = acc * rt[:, None]
        if NSPLIT == 1:
            tl.store(O + (r.to(tl.int64) * H + hh[:, None]) * 512 + c0 + d[None, :], acc.to(tl.bfloat16))
        else:
            tl.store(OPART + ((r.to(tl.int64) * NSPLIT + sp) * H + hh[:, None]) * 512 + c0 + d[None, :], acc)

    @triton.jit
    def _sum_kernel(OPART, O, H: tl.constexpr, NSPLIT: tl.constexpr, NSP2: tl.constexpr):
        # grid (rows, heads): out = sum of the normalised split partials
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, NSP2)
        d = tl.arange(0, 512)
        o = tl.load(OPART + ((r.to(tl.int64) * NSPLIT + s[:, None]) * H + h) * 512 + d[None, :],
                    mask=(s < NSPLIT)[:, None], other=0.0)
        tl.store(O + (r.to(tl.int64) * H + h) * 512 + d, tl.sum(o, 0).to(tl.bfloat16))


_WS: dict = {}
_AR: dict = {}


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _sparse_mla(q, kv_cache, block_table, row_seq, indices, sm_scale, nsplit=None, bn=None, nacc=None,
                num_warps=None, num_stages=None, out=None, impl="v5", **v4):
    if triton is None:
        raise RuntimeError("sparse_mla Triton kernels need triton and a CUDA GPU")
    R, H, Dq = q.shape
    if Dq != 576 or kv_cache.shape[-1] != 656 or kv_cache.dtype != torch.uint8:
        raise ValueError(f"sparse_mla: q must be [R, H, 576] and kv_cache uint8 [NB, BS, 656] (FP8 tile-128 rows), got "
                         f"q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    q = q.contiguous()  # once for every impl (v5's row chunks are then views, not copies)
    indices = indices.to(torch.int32).contiguous()
    if impl == "v5":  # bn / num_warps / num_stages: pass 2's key step, warps and pipeline depth
        if nacc not in (None, 4):
            raise ValueError(f"sparse_mla v5: every program covers all four value tiles, nacc must be 4, got {nacc}")
        bad = sorted(set(v4) - _V5_KW)
        if bad:
            raise ValueError(f"sparse_mla v5: unknown keyword(s) {bad} (v5 takes {sorted(_V5_KW)})")
        gen = {k: v for k, v in (("bk", bn), ("warps2", num_warps), ("num_stages", num_stages)) if v is not None}
        return _sparse_mla_v5(q, kv_cache, block_table, row_seq, indices, sm_scale, nsplit, out=out, **gen, **v4)
    bn = 64 if bn is None else bn
    nacc = 4 if nacc is None else nacc
    num_warps = 8 if num_warps is None else num_warps
    if impl == "v4":
        num_stages = 2 if num_stages is None else num_stages
        return _sparse_mla_v4(q, kv_cache, block_table, row_seq, indices, sm_scale, nsplit, bn, nacc,
                              num_warps=num_warps, num_stages=num_stages, out=out, **v4)
    if impl not in ("v1", "v2", "v3"):
        raise ValueError(f"sparse_mla: impl must be 'v1', 'v2', 'v3', 'v4' or 'v5', got {impl!r}")
    num_stages = 1 if num_stages is None else num_stages
    if v4:
        raise ValueError(f"sparse_mla {impl}: unknown keyword(s) {sorted(v4)} "
                         "(bh, qloop, fused, progs_per_sm are v4's)")
    if nacc not in (2, 4) or H % 64:
        raise ValueError(f"sparse_mla {impl}: nacc (value tiles of 128 per program) must be 4 or 2 and the head count "
                         f"a multiple of 64, got nacc={nacc}, H={H}")
    topk = indices.shape[1]
    bs = kv_cache.shape[1]
    flat = kv_cache.view(-1, 656)
    kv32 = flat.view(torch.float32)
    kv16 = flat.view(torch.bfloat16)
    BH = 64
    ndv = 4 // nacc if impl == "v1" else 1
    if nsplit is None and impl == "v3":  # ~1 program per SM (one 8-warp program fills an SM's registers)
        nsplit = max(1, min(triton.cdiv(topk, bn), _num_sms(q.device) // (R * (H // BH))))
    if nsplit is None:  # aim at ~2 programs per SM
        base = R * (H // BH) * ndv
        nsplit = max(1, min(triton.cdiv(topk, bn), (2 * _num_sms(q.device)) // base))
    per_split = triton.cdiv(triton.cdiv(topk, nsplit), bn) * bn
    nsplit = triton.cdiv(topk, per_split)
    if out is None:
        out = torch.empty(R, H, 512, dtype=torch.bfloat16, device=q.device)
    if nsplit > 1:
        key = (str(q.device), R, nsplit, H)
        if key not in _WS:
            _WS[key] = (torch.empty(R, nsplit, H, 512, dtype=torch.float32, device=q.device),
                        torch.empty(R, nsplit, H, dtype=torch.float32, device=q.device))
        opart, lse = _WS[key]
    else:
        opart, lse = out, out
    if impl == "v3":
        _sparse_mla_v3_kernel[(R, H // BH, nsplit)](q, flat, kv32, kv16, block_table, row_seq, indices, out, opart,
                                                    lse, sm_scale * 1.4426950408889634, block_table.stride(0), topk,
                                                    per_split, BS=bs, H=H, BH=BH, BN=bn, NSPLIT=nsplit,
                                                    num_warps=num_warps, num_stages=num_stages)
    elif impl == "v2":
        _sparse_mla_v2_kernel[(R, H // BH, nsplit)](q, flat, kv32, kv16, block_table, row_seq, indices, out, opart,
                                                    lse, sm_scale * 1.4426950408889634, block_table.stride(0), topk,
                                                    per_split, BS=bs, H=H, BH=BH, BN=bn, NSPLIT=nsplit,
                                                    num_warps=num_warps, num_stages=num_stages)
    else:
        _sparse_mla_kernel[(R, H // BH, nsplit * ndv)](q, flat, kv32, kv16, block_table, row_seq, indices, out,
                                                       opart, lse, sm_scale * 1.4426950408889634,
                                                       block_table.stride(0), topk, per_split, BS=bs, H=H, BH=BH,
                                                       BN=bn, NACC=nacc, NSPLIT=nsplit, num_warps=num_warps,
                                                       num_stages=num_stages)
    if nsplit > 1:
        _combine(opart, lse, out, R, H, nsplit, 1, 512)  # one program per head (value chunks: no gain at B=1)
    return out


def _combine(opart, lse, out, R, H, nsplit, ndv, dvb):
    _combine_kernel[(R, H, 512 // dvb)](opart, lse, out, H=H, NSPLIT=nsplit, NSP2=triton.next_power_of_2(nsplit),
                                        NDV=ndv, DVB=dvb, num_warps=4)


_WS4: dict = {}


def _sparse_mla_v4(q, kv_cache, block_table, row_seq, indices, sm_scale, nsplit=None, bn=64, nacc=4, bh=64,
                   num_warps=8, num_stages=2, qloop=False, fused=True, progs_per_sm=1, out=None):
    R, H, Dq = q.shape
    if nacc not in (1, 2, 4) or bh not in (16, 32, 64) or H % bh:
        raise ValueError(f"sparse_mla v4: nacc must be 1, 2 or 4 and bh 16, 32 or 64 dividing H={H}")
    topk = indices.shape[1]
    bs = kv_cache.shape[1]
    flat = kv_cache.view(-1, 656)
    ndv = 4 // nacc
    dev = q.device
    if nsplit is None:
        nsm = _num_sms(dev) if dev.type == "cuda" else 4
        base = R * (H // bh) * ndv
        nsplit = max(1, min(triton.cdiv(topk, bn), triton.cdiv(progs_per_sm * nsm, base)))
    per_split = triton.cdiv(triton.cdiv(topk, nsplit), bn) * bn
    nsplit = triton.cdiv(topk, per_split)
    if out is None:
        out = torch.empty(R, H, 512, dtype=torch.bfloat16, device=dev)
    key = (str(dev), R, nsplit, H, ndv, bh)
    if nsplit > 1 and key not in _WS4:
        _WS4[key] = (torch.empty(R, nsplit, H, 512, dtype=torch.float32, device=dev),
                     torch.empty(R, nsplit, ndv, H, dtype=torch.float32, device=dev),
                     torch.zeros(R * (H // bh) * ndv, dtype=torch.int32, device=dev))
    opart, lse, arr = _WS4[key] if nsplit > 1 else (out, out, out)
    nsp2 = triton.next_power_of_2(nsplit)
    _sparse_mla_v4_kernel[(R, H // bh, nsplit * ndv)](q, flat, flat.view(torch.float32), flat.view(torch.bfloat16),
                                                       block_table, row_seq, indices, out, opart, lse, arr,
                                                       sm_scale * 1.4426950408889634, block_table.stride(0), topk,
                                                       per_split, BS=bs, H=H, BH=bh, BN=bn, NACC=nacc, NSPLIT=nsplit,
                                                       NS=num_stages, QLOOP=qloop, FUSED=fused, NSP2=nsp2,
                                                       num_warps=num_warps)
    if nsplit > 1 and not fused:
        _combine(opart, lse, out, R, H, nsplit, ndv, 128 if R * H < 1024 else 512)  # small batches: more programs
    return out


_WS5: dict = {}


_V5_KW = {"tn", "bh", "warps1", "ns1", "maxnreg1", "bk", "bh2", "warps2", "maxnreg2", "rows_per_launch"}
_V5_SMALL = dict(tn=32, bh=64, warps1=4, ns1=-1, bk=32, num_stages=0)  # 1-2 rows: many small programs
_V5_MEDIUM = dict(tn=64, bh=64, warps1=4, ns1=-1, bk=64, num_stages=0)  # 3-4 rows
_V5_LARGE = dict(tn=64, bh=128, warps1=8, ns1=0, maxnreg1=128, bk=128, num_stages=3)  # 5+ rows, prefill


def _sparse_mla_v5(q, kv_cache, block_table, row_seq, indices, sm_scale, nsplit=None, out=None, rows_per_launch=256,
                   **kw):
    # two passes per launch of at most rows_per_launch rows (the p workspace is rows x H x topk bf16)
    R = q.shape[0]
    if out is None:
        out = torch.empty(R, q.shape[1], 512, dtype=torch.bfloat16, device=q.device)
    for r0 in range(0, R, rows_per_launch):
        r1 = min(R, r0 + rows_per_launch)
        _sparse_mla_v5_rows(q[r0:r1], kv_cache, block_table, row_seq[r0:r1], indices[r0:r1], sm_scale, nsplit,
                            out[r0:r1], **kw)
    return out


def _sparse_mla_v5_rows(q, kv_cache, block_table, row_seq, indices, sm_scale, nsplit, out, **opts):
    R, H, _ = q.shape
    c = dict(bh2=64, warps2=4, maxnreg1=None, maxnreg2=None)  # defaults: by batch size, then the caller's choices
    c.update(_V5_SMALL if R <= 2 else _V5_MEDIUM if R <= 4 else _V5_LARGE)
    c.update({k: v for k, v in opts.items() if v is not None})
    tn, bh, bk, bh2, ns1 = c["tn"], c["bh"], c["bk"], c["bh2"], c["ns1"]
    if tn not in (32, 64, 128) or bk not in (16, 32, 64, 128) or H % bh or H % bh2 or ns1 not in (0, -1):
        raise ValueError(f"sparse_mla v5: tn (pass-1 key tile) must be 32, 64 or 128, bk (pass-2 key step, `bn`) "
                         f"16..128, bh and bh2 must divide H={H}; got tn={tn}, bk={bk}, bh={bh}, "
                         f"bh2={bh2}, ns1={ns1} (0 or -1)")
    topk = indices.shape[1]
    bs = kv_cache.shape[1]
    flat = kv_cache.view(-1, 656)
    kv32 = flat.view(torch.float32)
    dev = q.device
    nt = triton.cdiv(topk, tn)
    tpad = nt * tn
    if nsplit is None:  # pass 2 has R * 4 * (H / bh2) programs; split the keys when that is under ~2 per SM
        base = R * 4 * (H // bh2)
        nsplit = max(1, min(nt, (2 * _num_sms(dev)) // base))
    per_split = triton.cdiv(nt, nsplit) * tn  # whole pass-1 tiles per split
    nsplit = triton.cdiv(tpad, per_split)
    key = (str(dev), R, H, nt, tn, nsplit)
    if key not in _WS5:
        _WS5[key] = (torch.empty(R, H, tpad, dtype=torch.bfloat16, device=dev),
                     torch.empty(R, nt, H, dtype=torch.float32, device=dev),
                     torch.empty(R, nt, H, dtype=torch.float32, device=dev),
                     torch.empty(R, nsplit, H, 512, dtype=torch.float32, device=dev) if nsplit > 1 else None,
                     torch.empty(R, tpad, dtype=torch.int32, device=dev))
    pbuf, mt, lt, opart, rows = _WS5[key]
    reg1 = {} if c["maxnreg1"] is None else {"maxnreg": c["maxnreg1"]}  # register caps: more programs per SM
    reg2 = {} if c["maxnreg2"] is None else {"maxnreg": c["maxnreg2"]}
    _mla_scores_kernel[(R, nt, H // bh)](q, flat, kv32, flat.view(torch.bfloat16), block_table, row_seq, indices,
                                         pbuf, mt, lt, rows, sm_scale * 1.4426950408889634, block_table.stride(0),
                                         topk, tpad, BS=bs, H=H, BH=bh, BN=tn, NS1=ns1, num_warps=c["warps1"],
                                         num_stages=1, **reg1)
    _mla_pv_kernel[(R, 4, (H // bh2) * nsplit)](pbuf, mt, lt, rows, flat, kv32, out, out if opart is None else opart,
                                                topk, tpad, per_split, H=H, BH=bh2, BK=bk, NT=nt,
                                                NT2=triton.next_power_of_2(nt), TN=tn, NSPLIT=nsplit,
                                                NS=c["num_stages"], num_warps=c["warps2"], **reg2)
    if nsplit > 1:
        _sum_kernel[(R, H)](opart, out, H=H, NSPLIT=nsplit, NSP2=triton.next_power_of_2(nsplit), num_warps=4)
    return out


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor,
                      sm_scale: float | None = None, *, nsplit: int | None = None, bn: int | None = None,
                      nacc: int | None = None, num_warps: int | None = None, num_stages: int | None = None, out=None,
                      impl: str = "v5", **v4) -> torch.Tensor:
    """q [B, H, 576] bf16, kv_cache [NB, BS, 656] u8, block_table [B, MB] i32, indices [B, topk] i32 (positions in
    sequence b, -1 = none) -> out [B, H, 512] bf16. sm_scale defaults to 576^-0.5. impl "v5" (default): two passes,
    scores + per-tile softmax statistics, then p @ v as a GEMM loop (keyword arguments tn, bh, warps1, ns1, maxnreg1
    for pass 1; bn = pass 2's key step, num_warps / num_stages its warps and pipeline depth, bh2, maxnreg2,
    rows_per_launch; defaults chosen by batch size); "v1": raw codes into the
    tensor cores, scales folded into S and P (4 value accumulators); "v2": tile dequantized to bf16, single wide dots;
    "v3": v2 with per-row scales and a manual prefetch pipeline (bn 32 recommended); "v4": v1's math with bh heads
    per program (bh=16/32/64), nacc value tiles per program, pipelined gathers, optional per-tile q reload
    (qloop=True) and the split merge fused into the last program (fused=True; keyword arguments bh, qloop, fused,
    progs_per_sm)."""
    B = q.shape[0]
    key = (str(q.device), B)
    if key not in _AR:
        _AR[key] = torch.arange(B, dtype=torch.int32, device=q.device)
    sm_scale = 576 ** -0.5 if sm_scale is None else sm_scale
    return _sparse_mla(q, kv_cache, block_table, _AR[key], indices, sm_scale, nsplit, bn, nacc, num_warps,
                       num_stages, out, impl, **v4)


def sparse_mla_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table_row: torch.Tensor, indices: torch.Tensor,
                       sm_scale: float | None = None, **kw) -> torch.Tensor:
    """One sequence, per query token its own selected set: q [T, H, 576], indices [T, topk] -> out [T, H, 512]."""
    T = q.shape[0]
    row_seq = torch.zeros(T, dtype=torch.int32, device=q.device)
    sm_scale = 576 ** -0.5 if sm_scale is None else sm_scale
    kw.setdefault("nsplit", 1)
    return _sparse_mla(q, kv_cache, block_table_row.reshape(1, -1), row_seq, indices, sm_scale, **kw)

