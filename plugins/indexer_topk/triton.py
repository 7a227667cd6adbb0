"""Triton kernels: fused lightning indexer over the paged MXFP8 index-K cache (score + ReLU + weights + top-k).

Semantics: plugins/indexer_topk/torch_ref.py. Five launches, no host sync, CUDA-graph capturable:
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
                  bn: int = 64, num_warps: int = 4, progs_per_sm: int = 4, out=None):
    if triton is None:
        raise RuntimeError("indexer_topk Triton kernels need triton and a CUDA GPU")
    score_k, select_k = _score_kernel, _select_kernel
    R, H, D = q.shape
    assert D == 128 and k_codes.shape[-1] == D and k_scales.shape[-1] == D // 32, "index head dim must be 128"
    assert q.dtype == torch.bfloat16 and k_codes.dtype == torch.uint8 and k_scales.dtype == torch.uint8
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


def indexer_topk_decode(q: torch.Tensor, weights: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                        block_table: torch.Tensor, context_lens: torch.Tensor, topk: int = 2048, *,
                        bn: int = 64, num_warps: int = 4, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, 128] bf16, weights [B, H] f32, k_codes [NB, BS, 128] u8, k_scales [NB, BS, 4] u8,
    block_table [B, MB] i32, context_lens [B] i32 -> (indices [B, topk] i32 (-1 pad), scores [B, topk] f32)."""
    B = q.shape[0]
    cap = block_table.shape[1] * k_codes.shape[1]
    return _indexer_topk(q, weights, k_codes, k_scales, block_table, _arange(B, q.device),
                         context_lens.to(torch.int32), cap, topk, bn=bn, num_warps=num_warps, out=out)


def indexer_topk_prefill(q: torch.Tensor, weights: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                         block_table_row: torch.Tensor, start_pos: int, topk: int = 2048, *,
                         bn: int = 64, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal prefill of one sequence: q [T, H, 128] bf16, weights [T, H]; query t sees positions
    s <= start_pos + t (its keys already written to the cache) -> (indices [T, topk], scores [T, topk])."""
    T = q.shape[0]
    row_len = torch.arange(start_pos + 1, start_pos + T + 1, dtype=torch.int32, device=q.device)
    row_seq = torch.zeros(T, dtype=torch.int32, device=q.device)
    return _indexer_topk(q, weights, k_codes, k_scales, block_table_row.reshape(1, -1), row_seq, row_len,
                         start_pos + T, topk, bn=bn, num_warps=num_warps)
