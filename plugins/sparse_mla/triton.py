"""GPU kernels of kimi.SparseMLA's attention core: absorbed MLA (one 576-wide latent KV head shared by all query
heads) over the positions the indexer selected, read from the FP8 latent cache through the block table.

Entry point:

    sparse_mla(q_lat, kv_codes, kv_scales, kv_rope, block_table, indices, sm_scale, *, out=None) -> o_lat
        q_lat     [B, T, H, 576] bf16 (float32 is rounded to bf16): the absorbed query, q_nope . W_UK (512)
                  concatenated with q_pe (64)
        kv_codes  [NB, BS, 512] uint8 (or float8_e4m3fn): E4M3FN bit patterns of the normed latent c_kv
        kv_scales [NB, BS, 4] uint8: one E8M0 byte per 128-element tile of c_kv, value 2^(b - 127)
        kv_rope   [NB, BS, 64] bf16: k_pe, kept unquantized
        block_table [B, MB] int32 / int64: position s of sequence b is block block_table[b, s // BS], row s % BS
        indices   [B, T, k] int32 / int64: positions within sequence b selected for query t; -1 selects nothing
        sm_scale  float: the softmax scale ((dn + dr)^-0.5 in the op)
        -> o_lat [B, T, H, 512] bf16: sum_j p_j c_j with p = softmax_j((q_lat[:512] . c_j + q_lat[512:] . pe_j) *
           sm_scale) over the selected j (c_j = code * 2^(b - 127) per tile, exact in bf16); a query with no valid
           index outputs zeros. The caller applies W_UV.
    The pools are the quantize pass's latent_kv_cache pools (passes/quantize.py: fp8_tile, tile 128, scale_fmt
    ue8m0, latent_rope keep): `kv.i` (codes), `kv.i.scale` (E8M0 bytes) and `kv.i.rope` (keep_dtype bf16), i.e. the
    op's kv_pool / kv_scale_pool / kv_rope_pool with kv_format "mxfp8", elem "e4m3", tile 128, rope_format "float".
    All tensors on one CUDA device, pools contiguous. No host synchronization, CUDA-graph capturable: grids are
    sized from shapes (B * T rows, k selected keys, H heads).

`unsupported(...)` names the field when the kernels do not apply (None when they do; `supports` is its boolean);
`sparse_mla` raises ValueError with that message.

Two passes per launch of at most ROWS_PER_LAUNCH rows (rows r = b * T + t):
1. `_mla_scores_kernel` (grid rows x key tiles of TN x head blocks of BH): S = q . kv^T over the 576 dims as one
   chained GEMM (four 128-wide value tiles dequantized to bf16, then the 64 rope dims), in base 2 (times
   sm_scale * log2 e), -inf at invalid indices; per (head, tile) m = ceil(max S) (an integer), l = sum exp2(S - m),
   and p = exp2(S - m) rounded to bf16 into a [rows, H, k padded to TN] workspace; head block 0 also stores the
   cache row of every selected key (-1: none), so pass 2 gathers with one load instead of a chain of three.
2. `_mla_pv_kernel` (grid rows x 4 value tiles of 128 x head blocks [x key splits]): from the tile pairs (m, l) the
   global max M and sum L per head, then out[:, cols] = (sum_k w p v) / L with w = exp2(m_tile - M), one GEMM loop
   over the keys. The m are integers, so w is a power of two and w * p is exact: p is rounded to bf16 once. With
   key splits (small batches) the partial sums (already divided by L) go to a workspace and `_sum_kernel` adds them.
Configuration by the rows of a launch (`_config`): register prefetch of the next step's operands for 1-4 rows,
Triton's pipeliner and a 128-register cap on pass 1 from 5 rows on; key splits when pass 2 would have fewer than
about 2 programs per SM. Workspaces are cached per shape (allocated on the first call of a shape: warm up before
capturing a CUDA graph). History of these kernels (what was tried, what was measured): docs/kernels/sparse_mla.md.
"""

from __future__ import annotations

import os

import torch
from kimi_compile.plugins import num_sms

try:  # triton is optional: importing this module on a CPU machine without it must work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

D_LATENT, D_ROPE, TILE = 512, 64, 128
ROWS_PER_LAUNCH = 256  # bounds the p workspace (rows x H x k bf16)
# per-launch configuration by row count: pass-1 key tile tn, heads bh, warps, ns1 (-1: register prefetch of the next
# value tile; 0: plain), register cap; pass-2 key step bk, heads bh2, warps, num_stages (0: register prefetch)
_SMALL = dict(tn=32, bh=64, warps1=4, ns1=-1, maxnreg1=None, bk=32, bh2=64, warps2=4, num_stages=0)  # 1-2 rows
_MEDIUM = dict(tn=64, bh=64, warps1=4, ns1=-1, maxnreg1=None, bk=64, bh2=64, warps2=4, num_stages=0)  # 3-4 rows
_LARGE = dict(tn=64, bh=128, warps1=8, ns1=0, maxnreg1=128, bk=128, bh2=64, warps2=4, num_stages=3)  # 5+ rows
# key splits: pass 2 is split over the keys until it has about SPLIT_PROGS_PER_SM programs per SM; the splits'
# partial sums (fp32, already divided by the softmax sum) are added by `_sum_kernel`
SPLIT_PROGS_PER_SM = 2

if triton is not None:

    @triton.jit
    def _e8m0(b):  # E8M0 byte -> fp32 2^(b - 127), exactly (b = 0: the subnormal 2^-127; b = 255: NaN)
        b = b.to(tl.int32)
        bits = tl.where(b == 0, 0x400000, tl.where(b == 255, 0x7FC00000, b << 23))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _mla_rows(IDX, BT, seq, stride_bt, ibase, n0, end, BS: tl.constexpr, BN: tl.constexpr):
        # cache rows (and validity) of the BN selected keys n0 .. n0 + BN of one query row
        nn = n0 + tl.arange(0, BN)
        ids = tl.load(IDX + ibase + nn, mask=nn < end, other=-1)
        valid = ids >= 0
        blk = tl.load(BT + seq * stride_bt + ids // BS, mask=valid, other=0).to(tl.int64)
        return blk * BS + ids % BS, valid

    @triton.jit
    def _dequant_tile(KC, KS, row, valid, t, d):
        # [BN, 128] value tile t of the gathered rows in bf16: code * 2^k is exact in bf16 (E8M0 tile scales)
        c = tl.load(KC + row[:, None] * 512 + t * 128 + d[None, :], mask=valid[:, None], other=0)
        sc = _e8m0(tl.load(KS + row * 4 + t, mask=valid, other=0))
        return (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(tl.bfloat16)

    @triton.jit
    def _mla_scores_kernel(Q, KC, KS, KR, BT, ROW_SEQ, IDX, P, MT, LT, ROWS, qk_scale_log2, stride_bt, topk,
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
            c_nx = tl.load(KC + row[:, None] * 512 + d[None, :], mask=valid[:, None], other=0)
            sc_nx = _e8m0(tl.load(KS + row * 4, mask=valid, other=0))
            q_nx = tl.load(qrow + d[None, :])
            kpe = tl.load(KR + row[:, None] * 64 + de[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(tl.load(qrow + 512 + de[None, :]), tl.trans(kpe))
            for t in tl.static_range(4):
                c, sc, qt = c_nx, sc_nx, q_nx
                if t < 3:
                    c_nx = tl.load(KC + row[:, None] * 512 + (t + 1) * 128 + d[None, :], mask=valid[:, None],
                                   other=0)
                    sc_nx = _e8m0(tl.load(KS + row * 4 + 1 + t, mask=valid, other=0))
                    q_nx = tl.load(qrow + (t + 1) * 128 + d[None, :])
                kv = (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(tl.bfloat16)
                s = tl.dot(qt, tl.trans(kv), s)
        else:
            kpe = tl.load(KR + row[:, None] * 64 + de[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(tl.load(qrow + 512 + de[None, :]), tl.trans(kpe))
            for t in tl.static_range(4):
                kv = _dequant_tile(KC, KS, row, valid, t, d)
                s = tl.dot(tl.load(qrow + t * 128 + d[None, :]), tl.trans(kv), s)
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m = tl.ceil(tl.max(s, 1))  # an integer: pass 2's tile weights exp2(m - max) are powers of two (exact)
        p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
        tl.store(P + (r.to(tl.int64) * H + hh[:, None]) * tpad + nn[None, :], p.to(tl.bfloat16))
        mbase = (r.to(tl.int64) * tl.num_programs(1) + j) * H + hh
        tl.store(MT + mbase, m)
        tl.store(LT + mbase, tl.sum(p, 1))

    @triton.jit
    def _pv_operands(P, MT, KC, KS, ROWS, r, c0, hh, mx, k0, end, tpad, d, H: tl.constexpr, BK: tl.constexpr,
                     NT: tl.constexpr, TN: tl.constexpr):
        # step k0's operands: the value columns c0 + d of the BK keys' rows, their tile scale, p and the tile weight
        kk = k0 + tl.arange(0, BK)
        row = tl.load(ROWS + r.to(tl.int64) * tpad + kk, mask=kk < end, other=-1)
        valid = row >= 0
        row = row.to(tl.int64)
        c = tl.load(KC + row[:, None] * 512 + c0 + d[None, :], mask=valid[:, None], other=0)
        sc = _e8m0(tl.load(KS + row * 4 + c0 // 128, mask=valid, other=0))
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
    def _mla_pv_kernel(P, MT, LT, ROWS, KC, KS, O, OPART, topk, tpad, per_split,
                       H: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, NT: tl.constexpr, NT2: tl.constexpr,
                       TN: tl.constexpr, NSPLIT: tl.constexpr, NS: tl.constexpr):
        # pass 2, grid (rows, 4 value tiles of 128, head blocks x splits): the global max M and sum L
        # per head from the NT tile pairs, then out[:, cols] = (sum_k w(k) p(k) v(k)) / L with w = exp2(m_tile - M),
        # one GEMM loop over the keys (BK per step, one or several of pass 1's TN-key tiles). The m are integers, so
        # w is a power of two and w * p (bf16) is exact: p is rounded once. With splits the partial sums (already
        # divided by L) go to OPART and `_sum_kernel` adds them. NS = 0: the next step's operands are loaded (into
        # registers) before this step's product; NS > 0: Triton's pipeliner with NS stages.
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
            c_nx, sc_nx, p_nx, w_nx = _pv_operands(P, MT, KC, KS, ROWS, r, c0, hh, mx, start, end, tpad, d, H, BK,
                                                   NT, TN)
            for k0 in range(start, end, BK):
                c, sc, p, wj = c_nx, sc_nx, p_nx, w_nx
                nxt = tl.where(k0 + BK < end, k0 + BK, k0)  # past the end: reload this step (in bounds, unused)
                c_nx, sc_nx, p_nx, w_nx = _pv_operands(P, MT, KC, KS, ROWS, r, c0, hh, mx, nxt, end, tpad, d, H,
                                                       BK, NT, TN)
                acc = _pv_step(acc, c, sc, p, wj, BH, BK, TN)
        else:
            for k0 in tl.range(start, end, BK, num_stages=NS):
                c, sc, p, wj = _pv_operands(P, MT, KC, KS, ROWS, r, c0, hh, mx, k0, end, tpad, d, H, BK, NT, TN)
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
_ROW_SEQ: dict = {}


def _interpreting() -> bool:
    """Under TRITON_INTERPRET=1 the kernels run on CPU tensors (Triton's interpreter: correctness checks only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _config(rows: int, heads: int) -> dict:
    """The launch configuration for `rows` rows (bh and bh2 fall back to 64 heads where the head count is not a
    multiple of the configured block)."""
    c = dict(_SMALL if rows <= 2 else _MEDIUM if rows <= 4 else _LARGE)
    for k in ("bh", "bh2"):
        if heads % c[k]:
            c[k] = 64
    return c


def unsupported(q_lat, kv_codes, kv_scales, kv_rope, block_table, indices, sm_scale=None) -> str | None:
    """Why `sparse_mla` cannot run these tensors (naming the field), or None when it can."""
    if q_lat.dim() != 4 or q_lat.shape[-1] != D_LATENT + D_ROPE:
        return f"sparse_mla: q_lat must be [B, T, H, {D_LATENT + D_ROPE}], got {tuple(q_lat.shape)}"
    B, T, H, _ = q_lat.shape
    if H % 64:
        return f"sparse_mla: the head count must be a multiple of 64, got {H}"
    for name, t, ok in (("q_lat", q_lat, (torch.bfloat16, torch.float32)),
                        ("kv_codes", kv_codes, (torch.uint8, torch.float8_e4m3fn)),
                        ("kv_scales", kv_scales, (torch.uint8,)), ("kv_rope", kv_rope, (torch.bfloat16,)),
                        ("block_table", block_table, (torch.int32, torch.int64)),
                        ("indices", indices, (torch.int32, torch.int64))):
        if t.dtype not in ok:
            return f"sparse_mla: {name} must be {' or '.join(str(d) for d in ok)}, got {t.dtype}"
    if kv_codes.dim() != 3 or kv_codes.shape[-1] != D_LATENT:
        return f"sparse_mla: kv_codes must be [NB, BS, {D_LATENT}], got {tuple(kv_codes.shape)}"
    nbs = tuple(kv_codes.shape[:2])
    if tuple(kv_scales.shape) != (*nbs, D_LATENT // TILE):
        return (f"sparse_mla: kv_scales must be [NB, BS, {D_LATENT // TILE}] (one E8M0 byte per {TILE}-element "
                f"tile) = {(*nbs, D_LATENT // TILE)}, got {tuple(kv_scales.shape)}")
    if tuple(kv_rope.shape) != (*nbs, D_ROPE):
        return f"sparse_mla: kv_rope must be [NB, BS, {D_ROPE}] = {(*nbs, D_ROPE)}, got {tuple(kv_rope.shape)}"
    if not all(t.is_contiguous() for t in (kv_codes, kv_scales, kv_rope)):
        return "sparse_mla: kv_codes, kv_scales and kv_rope must be contiguous pools"
    if block_table.dim() != 2 or block_table.shape[0] != B:
        return f"sparse_mla: block_table must be [B={B}, MB], got {tuple(block_table.shape)}"
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, T) or indices.shape[2] < 1:
        return f"sparse_mla: indices must be [B={B}, T={T}, k >= 1], got {tuple(indices.shape)}"
    if sm_scale is not None and not isinstance(sm_scale, (int, float)):
        return f"sparse_mla: sm_scale must be a Python float, got {type(sm_scale).__name__}"
    devs = {t.device for t in (q_lat, kv_codes, kv_scales, kv_rope, block_table, indices)}
    if len(devs) != 1 or not (q_lat.is_cuda or _interpreting()):
        return f"sparse_mla: every tensor must be on one CUDA device, got {sorted(map(str, devs))}"
    if triton is None:
        return "sparse_mla: triton is not installed"
    return None


def supports(q_lat, kv_codes, kv_scales, kv_rope, block_table, indices, sm_scale=None) -> bool:
    """True when `sparse_mla` runs these tensors (`unsupported` gives the reason when it does not)."""
    return unsupported(q_lat, kv_codes, kv_scales, kv_rope, block_table, indices, sm_scale) is None


def _row_seq(B: int, T: int, device) -> torch.Tensor:
    """[B * T] int32: the sequence of each row, cached per shape (a constant of the launch)."""
    key = (str(device), B, T)
    if key not in _ROW_SEQ:
        _ROW_SEQ[key] = torch.arange(B * T, dtype=torch.int32, device=device) // T
    return _ROW_SEQ[key]


def _launch(q, kv_codes, kv_scales, kv_rope, block_table, row_seq, indices, sm_scale, out):
    """Both passes (and the split sum) for rows q [R, H, 576] bf16, indices [R, k] int32, out [R, H, 512] bf16."""
    R, H, _ = q.shape
    c = _config(R, H)
    tn, bh, bk, bh2 = c["tn"], c["bh"], c["bk"], c["bh2"]
    topk = indices.shape[1]
    bs = kv_codes.shape[1]
    dev = q.device
    nt = triton.cdiv(topk, tn)
    tpad = nt * tn
    base = R * 4 * (H // bh2)  # pass 2's programs; split the keys when that is under ~2 per SM
    nsplit = max(1, min(nt, (SPLIT_PROGS_PER_SM * num_sms(dev)) // base))
    per_split = triton.cdiv(nt, nsplit) * tn  # whole pass-1 tiles per split
    nsplit = triton.cdiv(tpad, per_split)
    key = (str(dev), R, H, nt, tn, nsplit)
    if key not in _WS:
        _WS[key] = (torch.empty(R, H, tpad, dtype=torch.bfloat16, device=dev),
                    torch.empty(R, nt, H, dtype=torch.float32, device=dev),
                    torch.empty(R, nt, H, dtype=torch.float32, device=dev),
                    torch.empty(R, nsplit, H, 512, dtype=torch.float32, device=dev) if nsplit > 1 else None,
                    torch.empty(R, tpad, dtype=torch.int32, device=dev))
    pbuf, mt, lt, opart, rows = _WS[key]
    reg1 = {} if c["maxnreg1"] is None else {"maxnreg": c["maxnreg1"]}  # register cap: more programs per SM
    _mla_scores_kernel[(R, nt, H // bh)](q, kv_codes, kv_scales, kv_rope, block_table, row_seq, indices, pbuf, mt, lt,
                                         rows, sm_scale * 1.4426950408889634, block_table.stride(0), topk, tpad,
                                         BS=bs, H=H, BH=bh, BN=tn, NS1=c["ns1"], num_warps=c["warps1"], num_stages=1,
                                         **reg1)
    _mla_pv_kernel[(R, 4, (H // bh2) * nsplit)](pbuf, mt, lt, rows, kv_codes, kv_scales, out,
                                                out if opart is None else opart, topk, tpad, per_split, H=H, BH=bh2,
                                                BK=bk, NT=nt, NT2=triton.next_power_of_2(nt), TN=tn, NSPLIT=nsplit,
                                                NS=c["num_stages"], num_warps=c["warps2"])
    if nsplit > 1:
        _sum_kernel[(R, H)](opart, out, H=H, NSPLIT=nsplit, NSP2=triton.next_power_of_2(nsplit), num_warps=4)


def sparse_mla(q_lat: torch.Tensor, kv_codes: torch.Tensor, kv_scales: torch.Tensor, kv_rope: torch.Tensor,
               block_table: torch.Tensor, indices: torch.Tensor, sm_scale: float, *, out: torch.Tensor | None = None,
               **unknown) -> torch.Tensor:
    """Sparse MLA over the three latent-cache pools (the contract in the module docstring): q_lat [B, T, H, 576],
    kv_codes [NB, BS, 512] u8, kv_scales [NB, BS, 4] u8 (E8M0), kv_rope [NB, BS, 64] bf16, block_table [B, MB],
    indices [B, T, k] (-1 = none), sm_scale -> o_lat [B, T, H, 512] bf16. out: optional preallocated contiguous
    [B, T, H, 512] bf16 output, written in place."""
    if unknown:
        raise ValueError(f"sparse_mla: unknown keyword(s) {sorted(unknown)} (known: out)")
    reason = unsupported(q_lat, kv_codes, kv_scales, kv_rope, block_table, indices, sm_scale)
    if reason is not None:
        raise ValueError(reason)
    B, T, H, _ = q_lat.shape
    R = B * T
    if out is None:
        out = torch.empty(B, T, H, D_LATENT, dtype=torch.bfloat16, device=q_lat.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (B, T, H, D_LATENT) or not out.is_contiguous():
        raise ValueError(f"sparse_mla: out must be a contiguous bf16 [B, T, H, {D_LATENT}] = {(B, T, H, D_LATENT)} "
                         f"tensor, got {out.dtype} {tuple(out.shape)}")
    q = q_lat.reshape(R, H, -1).to(torch.bfloat16).contiguous()
    idx = indices.reshape(R, -1).to(torch.int32).contiguous()
    seq = _row_seq(B, T, q.device)
    kv_codes = kv_codes.view(torch.uint8)  # float8_e4m3fn pools: the same bytes
    o = out.view(R, H, D_LATENT)
    for r0 in range(0, R, ROWS_PER_LAUNCH):
        r1 = min(R, r0 + ROWS_PER_LAUNCH)
        _launch(q[r0:r1], kv_codes, kv_scales, kv_rope, block_table, seq[r0:r1], idx[r0:r1], float(sm_scale),
                o[r0:r1])
    return out
