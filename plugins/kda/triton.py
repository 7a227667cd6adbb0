"""Triton kernels for KDA: the recurrent decode step (state updated in place), the fused prefill pre/post work and
the chunked core's sequential half around fla-core's gate and intra-chunk kernels (the chunked WY/UT core; fla is a
dependency of the CUDA backend). Semantics:
plugins/kda/reference.py (`kda_step_ref`, `kda_output_norm_ref`) and the cuda backend's torch form
(plugins/kda/cuda.py `prepare`), which the prepare kernels' tests hold them to.

- `kda_decode_step`: grid (B*H, V / BV); a program loads its [K, BV] fp32 slice of the state once, applies decay,
  delta correction, rank-1 update and readout in registers and writes the slice back in place. Optional in-kernel L2
  norm of q/k, safe gate (lower_bound * sigmoid(exp(A_log) * (f + dt_bias))) and beta sigmoid. BV = 32 below 1024
  (sequence, head) pairs, 64 from there (at most V).
- `kda_prefill_prepare`: T tokens' delta-rule inputs in one launch, grid (head blocks, spans of 32..512 tokens, B):
  a program walks its span token by token over 512 channels (4 heads of 128) of each of q / k / v, the conv's three
  previous rows carried in registers (each element of u loaded once), conv over [carried window | u] (the window
  advanced in place by the first span's program) + SiLU for q/k/v, L2 norm of q/k (q scaled), beta sigmoid, the gate
  input f set to -inf in place on padding rows (the gate itself is computed by fla's gate cumsum in `kda_chunk`).
- `kda_decode_prepare`: one decode token's delta-rule inputs in one launch: conv over the carried window (advanced in
  place) + SiLU for q/k/v, L2 norm of q/k (q scaled), safe gate and beta sigmoid, zeroed on padding rows.
- `kda_output_norm_gate`: per-head RMSNorm * weight * sigmoid(gate).
- `kda_chunk_state_out`: grid (V / BV, B*H); a program walks its row's 64-token chunks in order with its [K, BV] fp32
  slice of the state in registers: v_new = u - w @ S, o = qg @ S + tril(Aqk) @ v_new, S = S 2^g_last + kg^T v_new
  (fla's chunk_kda runs this as two kernels with every chunk's state written to memory between them).
- `kda_chunk`: fla's gate cumsum and intra-chunk kernels (w, u, qg, kg, Aqk) -> `kda_chunk_state_out`.
- `kda_prefill`: prepare -> `kda_chunk` (the state in place) -> output norm/gate.
History of these kernels (what was tried, what was measured): docs/kernels/kda.md.
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

if triton is not None:

    @triton.jit
    def _kda_decode_kernel(Q, K, V, G, BETA, S, O, A_LOG, DT_BIAS, scale, lower_bound,
                           H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                           L2NORM: tl.constexpr, GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        iv = tl.program_id(1)
        dk = tl.arange(0, DK)
        dv = iv * BV + tl.arange(0, BV)
        sp = S + bh * DK * DV + dk[:, None] * DV + dv[None, :]
        st = tl.load(sp)
        q = tl.load(Q + bh * DK + dk).to(tl.float32)
        k = tl.load(K + bh * DK + dk).to(tl.float32)
        g = tl.load(G + bh * DK + dk).to(tl.float32)
        v = tl.load(V + bh * DV + dv).to(tl.float32)
        b = tl.load(BETA + bh).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        if GATE:
            h = bh % H
            a = tl.exp(tl.load(A_LOG + h).to(tl.float32))
            g = lower_bound * tl.sigmoid(a * (g + tl.load(DT_BIAS + h * DK + dk).to(tl.float32)))
        if BETA_SIGMOID:
            b = tl.sigmoid(b)
        st = st * tl.exp(g)[:, None]
        u = (v - tl.sum(st * k[:, None], 0)) * b
        st = st + k[:, None] * u[None, :]
        o = tl.sum(st * q[:, None], 0)
        tl.store(sp, st)
        tl.store(O + bh * DV + dv, o.to(O.dtype.element_ty))

    @triton.jit
    def _concat_row(U, CS, bid, m, ch, cm, su_b, su_t, scs_b, scs_t):
        # row m of [carried window | u] over the channels ch (m < 3: the window, cast to u's dtype as the torch
        # form's cat does)
        fromw = (ch * 0 + m) < 3  # (a scalar & a tensor mask: int32 in Triton's interpreter, which refuses it)
        w = tl.load(CS + bid * scs_b + m * scs_t + ch, mask=cm & fromw, other=0.0)
        x = tl.load(U + bid * su_b + (m - 3) * su_t + ch, mask=cm & ~fromw, other=0.0)
        return tl.where(fromw, w.to(x.dtype), x)

    @triton.jit
    def _taps(CW, ch, cm, dt: tl.constexpr):
        # the four conv taps of the channels ch, rounded to u's dtype as the torch form's conv1d takes them
        w0 = tl.load(CW + ch * 4 + 0, mask=cm, other=0.0).to(dt).to(tl.float32)
        w1 = tl.load(CW + ch * 4 + 1, mask=cm, other=0.0).to(dt).to(tl.float32)
        w2 = tl.load(CW + ch * 4 + 2, mask=cm, other=0.0).to(dt).to(tl.float32)
        w3 = tl.load(CW + ch * 4 + 3, mask=cm, other=0.0).to(dt).to(tl.float32)
        return w0, w1, w2, w3

    @triton.jit
    def _conv_silu(a, b, c, x, w0, w1, w2, w3):
        # silu(w0 a + w1 b + w2 c + w3 x) for the rows t - 3 .. t of [window | u]: the four products accumulate in
        # fp32 in this order, the sum and the SiLU round to u's dtype (the torch form's conv1d and SiLU in it)
        acc = tl.zeros(x.shape, tl.float32)
        acc += a.to(tl.float32) * w0
        acc += b.to(tl.float32) * w1
        acc += c.to(tl.float32) * w2
        acc += x.to(tl.float32) * w3
        y = acc.to(x.dtype).to(tl.float32)
        return (y * tl.sigmoid(y)).to(x.dtype).to(tl.float32)

    @triton.jit
    def _kda_prefill_pre_kernel(U, CS, CW, FP, BP, LEN, OQ, OK, OV, OB, T, span, su_b, su_t, scs_b, scs_t, sf_b,
                                sf_t, sb_b, sb_t, scale, l2_eps, H: tl.constexpr, D: tl.constexpr, NH: tl.constexpr):
        # grid (head blocks of NH, spans of `span` tokens, sequences): a program walks its span one token at a time
        # over NH heads' channels of q, k and v, the conv's three previous rows carried in registers, so each element
        # of u is loaded once (plus three rows of warm-up per span)
        hb = tl.program_id(0)
        sp = tl.program_id(1)
        bid = tl.program_id(2).to(tl.int64)
        hh = hb * NH + tl.arange(0, NH)
        hm = hh < H
        ch = hh[:, None] * D + tl.arange(0, D)[None, :]  # [NH, D] channels of q (k: P + ch, v: 2 P + ch)
        cm = ch < H * D
        P = H * D
        dt = U.dtype.element_ty
        n = tl.minimum(tl.load(LEN + bid).to(tl.int32), T)
        t0 = sp * span
        t1 = tl.minimum(t0 + span, T)
        wq0, wq1, wq2, wq3 = _taps(CW, ch, cm, dt)
        wk0, wk1, wk2, wk3 = _taps(CW, P + ch, cm, dt)
        wv0, wv1, wv2, wv3 = _taps(CW, 2 * P + ch, cm, dt)
        # rows t0 - 3 .. t0 - 1 of u (of the carried window for the first span)
        aq = _concat_row(U, CS, bid, t0, ch, cm, su_b, su_t, scs_b, scs_t)
        bq = _concat_row(U, CS, bid, t0 + 1, ch, cm, su_b, su_t, scs_b, scs_t)
        cq = _concat_row(U, CS, bid, t0 + 2, ch, cm, su_b, su_t, scs_b, scs_t)
        ak = _concat_row(U, CS, bid, t0, P + ch, cm, su_b, su_t, scs_b, scs_t)
        bk = _concat_row(U, CS, bid, t0 + 1, P + ch, cm, su_b, su_t, scs_b, scs_t)
        ck = _concat_row(U, CS, bid, t0 + 2, P + ch, cm, su_b, su_t, scs_b, scs_t)
        av = _concat_row(U, CS, bid, t0, 2 * P + ch, cm, su_b, su_t, scs_b, scs_t)
        bv = _concat_row(U, CS, bid, t0 + 1, 2 * P + ch, cm, su_b, su_t, scs_b, scs_t)
        cv = _concat_row(U, CS, bid, t0 + 2, 2 * P + ch, cm, su_b, su_t, scs_b, scs_t)
        for t in range(t0, t1):
            ub = U + bid * su_b + t * su_t
            xq = tl.load(ub + ch, mask=cm, other=0.0)
            xk = tl.load(ub + P + ch, mask=cm, other=0.0)
            xv = tl.load(ub + 2 * P + ch, mask=cm, other=0.0)
            braw = tl.load(BP + bid * sb_b + t * sb_t + hh, mask=hm, other=0.0).to(tl.float32)
            orow = (bid * T + t) * P + ch
            q = _conv_silu(aq, bq, cq, xq, wq0, wq1, wq2, wq3)
            q = q * (tl.rsqrt(tl.sum(q * q, 1) + l2_eps) * scale)[:, None]
            tl.store(OQ + orow, q.to(OQ.dtype.element_ty), mask=cm)
            k = _conv_silu(ak, bk, ck, xk, wk0, wk1, wk2, wk3)
            k = k * tl.rsqrt(tl.sum(k * k, 1) + l2_eps)[:, None]
            tl.store(OK + orow, k.to(OK.dtype.element_ty), mask=cm)
            v = _conv_silu(av, bv, cv, xv, wv0, wv1, wv2, wv3)
            tl.store(OV + orow, v.to(OV.dtype.element_ty), mask=cm)
            # the gate's input set to -inf on padding rows, in place (valid rows are not touched, so a call without
            # padding moves no f bytes): fla's in-kernel safe gate lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
            # is then exactly 0 there, so the state does not decay
            tl.store(FP + bid * sf_b + t * sf_t + ch, tl.full([NH, D], float("-inf"), FP.dtype.element_ty),
                     mask=cm & ((ch * 0 + t) >= n))  # (scalar & tensor masks: int32 in Triton's interpreter)
            tl.store(OB + (bid * T + t) * H + hh, tl.sigmoid(braw) * (t < n).to(tl.float32), mask=hm)
            aq, bq, cq = bq, cq, xq
            ak, bk, ck = bk, ck, xk
            av, bv, cv = bv, cv, xv
        # the new window: rows n, n + 1, n + 2 of [window | u], written by the first span's program (the only one
        # that reads the old window), all three loaded before any is stored
        first = cm & ((ch * 0 + sp) == 0)
        wb = CS + bid * scs_b
        for o in tl.static_range(3):
            n0 = _concat_row(U, CS, bid, n, o * P + ch, first, su_b, su_t, scs_b, scs_t)
            n1 = _concat_row(U, CS, bid, n + 1, o * P + ch, first, su_b, su_t, scs_b, scs_t)
            n2 = _concat_row(U, CS, bid, n + 2, o * P + ch, first, su_b, su_t, scs_b, scs_t)
            tl.debug_barrier()
            tl.store(wb + o * P + ch, n0.to(CS.dtype.element_ty), mask=first)
            tl.store(wb + scs_t + o * P + ch, n1.to(CS.dtype.element_ty), mask=first)
            tl.store(wb + 2 * scs_t + o * P + ch, n2.to(CS.dtype.element_ty), mask=first)

    @triton.jit
    def _kda_post_kernel(O, GATE, W, OUT, n_rows, eps, H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # row = (b*T + t)*H + h
        rm = rows < n_rows
        dd = tl.arange(0, D)
        off = rows[:, None] * D + dd[None, :]
        o = tl.load(O + off, mask=rm[:, None], other=0.0).to(tl.float32)
        gt = tl.load(GATE + off, mask=rm[:, None], other=0.0).to(tl.float32)
        y = o * tl.rsqrt(tl.sum(o * o, 1) / D + eps)[:, None] * tl.load(W + dd).to(tl.float32)[None, :]
        tl.store(OUT + off, (y * tl.sigmoid(gt)).to(OUT.dtype.element_ty), mask=rm[:, None])

    @triton.jit
    def _conv_step(U, CS, CW, bid, col, su, scs_b, scs_t, valid):
        # one decode token of the kernel-4 depthwise conv over the carried window [w0, w1, w2], in the compute dtype
        # of u (the torch form casts the window and the weights to it, convolves and applies SiLU in it):
        # y = silu(c0 w0 + c1 w1 + c2 w2 + c3 u); on a valid row the window becomes [w1, w2, u]. Every value is
        # loaded before the barrier and stored after it, so threads holding the same channel (small head dims
        # replicate a [D] vector) cannot read a moved one.
        x = tl.load(U + bid * su + col)
        cs = CS + bid * scs_b + col
        w0 = tl.load(cs).to(x.dtype)
        w1 = tl.load(cs + scs_t).to(x.dtype)
        w2 = tl.load(cs + 2 * scs_t).to(x.dtype)
        acc = (w0.to(tl.float32) * tl.load(CW + col * 4).to(x.dtype).to(tl.float32)
               + w1.to(tl.float32) * tl.load(CW + col * 4 + 1).to(x.dtype).to(tl.float32)
               + w2.to(tl.float32) * tl.load(CW + col * 4 + 2).to(x.dtype).to(tl.float32)
               + x.to(tl.float32) * tl.load(CW + col * 4 + 3).to(x.dtype).to(tl.float32))
        tl.debug_barrier()
        # a padding row keeps its window (cast through u's dtype, as the torch form's gather of the cast window does)
        tl.store(cs, tl.where(valid, w1, w0).to(CS.dtype.element_ty))
        tl.store(cs + scs_t, tl.where(valid, w2, w1).to(CS.dtype.element_ty))
        tl.store(cs + 2 * scs_t, tl.where(valid, x, w2).to(CS.dtype.element_ty))
        y = acc.to(x.dtype).to(tl.float32)
        return (y * tl.sigmoid(y)).to(x.dtype).to(tl.float32)

    @triton.jit
    def _kda_decode_pre_kernel(U, CS, CW, FP, BP, A_LOG, DT_BIAS, LEN, OQ, OK, OV, OG, OB,
                               su, scs_b, scs_t, sf, sb, scale, l2_eps, lower_bound,
                               H: tl.constexpr, D: tl.constexpr):
        bid = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        dd = tl.arange(0, D)
        c = h * D + dd
        valid = tl.load(LEN + bid) > 0
        orow = (bid * H + h) * D + dd
        q = _conv_step(U, CS, CW, bid, c, su, scs_b, scs_t, valid)
        tl.store(OQ + orow, q * (tl.rsqrt(tl.sum(q * q, 0) + l2_eps) * scale))
        k = _conv_step(U, CS, CW, bid, H * D + c, su, scs_b, scs_t, valid)
        tl.store(OK + orow, k * tl.rsqrt(tl.sum(k * k, 0) + l2_eps))
        v = _conv_step(U, CS, CW, bid, 2 * H * D + c, su, scs_b, scs_t, valid)
        tl.store(OV + orow, v)
        m = valid.to(tl.float32)
        f = tl.load(FP + bid * sf + c).to(tl.float32) + tl.load(DT_BIAS + c).to(tl.float32)
        a = tl.exp(tl.load(A_LOG + h).to(tl.float32))
        tl.store(OG + orow, lower_bound * tl.sigmoid(a * f) * m)
        tl.store(OB + bid * H + h, tl.sigmoid(tl.load(BP + bid * sb + h).to(tl.float32)) * m)

    @triton.jit
    def _kda_chunk_state_out_kernel(QG, KG, W, U, G, A, S, O, T, NT, scale, H: tl.constexpr, K: tl.constexpr,
                                    V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
        # program (value slice, sequence x head): walks the row's chunks in order with its [K, BV] fp32 slice of the
        # state in registers; per chunk v_new = u - w @ S, o = scale qg @ S + tril(Aqk) @ v_new, then
        # S = S * 2^g_last + kg^T @ v_new. The state is read from S and written back to it (in place).
        iv = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b, h = bh // H, bh % H
        kk = tl.arange(0, K)
        vv = iv * BV + tl.arange(0, BV)
        rr = tl.arange(0, BT)
        s_ptr = S + bh * K * V + kk[:, None] * V + vv[None, :]
        st = tl.load(s_ptr)
        row0 = b * T
        tril = rr[:, None] >= rr[None, :]
        for c in range(0, NT):
            t = c * BT + rr
            mt = t < T
            tok = (row0 + t) * H + h  # [BT] token-head rows of qg, kg, w, u, Aqk, o
            w = tl.load(W + tok[:, None] * K + kk[None, :], mask=mt[:, None], other=0.0)
            qg = tl.load(QG + tok[:, None] * K + kk[None, :], mask=mt[:, None], other=0.0)
            u = tl.load(U + tok[:, None] * V + vv[None, :], mask=mt[:, None], other=0.0)
            a = tl.load(A + tok[:, None] * BT + rr[None, :], mask=mt[:, None], other=0.0)
            kg = tl.load(KG + tok[None, :] * K + kk[:, None], mask=mt[None, :], other=0.0)  # [K, BT]
            last = (row0 + tl.minimum(c * BT + BT, T) - 1) * H + h
            glast = tl.load(G + last * K + kk).to(tl.float32)
            sb = st.to(w.dtype)
            vn = (u.to(tl.float32) - tl.dot(w, sb)).to(w.dtype)  # v_new, rounded as fla stores it
            o = tl.dot(qg, sb) * scale
            o = tl.dot(tl.where(tril, a, 0.0).to(w.dtype), vn, o)
            tl.store(O + tok[:, None] * V + vv[None, :], o.to(O.dtype.element_ty), mask=mt[:, None])
            st = tl.dot(kg, vn, st * tl.exp2(glast)[:, None])
        tl.store(s_ptr, st)


def _need_triton():
    if triton is None:
        raise RuntimeError("KDA Triton kernels need triton and a CUDA GPU")


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _no_unknown(fn: str, unknown: dict) -> None:
    if unknown:
        raise ValueError(f"{fn}: unknown keyword(s) {sorted(unknown)}")


def kda_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, *, scale: float = 1.0, out: torch.Tensor | None = None,
                    A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                    lower_bound: float = -5.0, use_qk_l2norm: bool = False, use_beta_sigmoid: bool = False,
                    **unknown) -> torch.Tensor:
    """One gated delta-rule step per (sequence, head): S <- diag(exp(g)) S; S <- S + beta k (v - S^T k)^T;
    o = S^T (scale q).

    state [B, H, K, V] float32, contiguous: updated IN PLACE (the caller's tensor holds the new state).
    q, k, g [B, H, K] (or [B, 1, H, K]), v [B, H, V], beta [B, H]: any float dtype, computed in fp32.
    With A_log [H] and dt_bias [H*K] given, g is the raw gate input f and the safe gate
    lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) is computed in the kernel; use_qk_l2norm normalises q and k
    (eps 1e-6 inside the root) before q is scaled; use_beta_sigmoid applies sigmoid to beta.
    Returns o [B, H, V] in v's dtype (written into `out` when given: [B, H, V], contiguous)."""
    _need_triton()
    _no_unknown("kda_decode_step", unknown)
    _need(state.dim() == 4 and state.dtype == torch.float32 and state.is_contiguous(),
          f"kda_decode_step: state must be a contiguous float32 [B, H, K, V] tensor, got {state.dtype} "
          f"{tuple(state.shape)}")
    B, H, DK, DV = state.shape
    _need(DK & (DK - 1) == 0 and DV & (DV - 1) == 0 and DV >= 16,
          f"kda_decode_step: K and V must be powers of two (V >= 16), got state {tuple(state.shape)}")
    bv = min(64 if B * H >= 1024 else 32, DV)
    q, k, g, v = (x.reshape(B, H, -1).contiguous() for x in (q, k, g, v))
    _need(q.shape[-1] == DK and k.shape[-1] == DK and g.shape[-1] == DK and v.shape[-1] == DV,
          f"kda_decode_step: q, k, g must be [B, H, {DK}] and v [B, H, {DV}]")
    beta = beta.reshape(B, H).contiguous()
    if out is None:
        out = torch.empty(B, H, DV, dtype=v.dtype, device=v.device)
    _need(tuple(out.shape) == (B, H, DV) and out.is_contiguous(),
          f"kda_decode_step: out must be a contiguous [B, H, V] = {(B, H, DV)} tensor, got {tuple(out.shape)}")
    gate = A_log is not None
    _need(gate == (dt_bias is not None), "kda_decode_step: A_log and dt_bias come together (in-kernel safe gate)")
    _kda_decode_kernel[(B * H, DV // bv)](q, k, v, g, beta, state, out, A_log if gate else g,
                                          dt_bias if gate else g, scale, lower_bound, H=H, DK=DK, DV=DV, BV=bv,
                                          L2NORM=use_qk_l2norm, GATE=gate, BETA_SIGMOID=use_beta_sigmoid,
                                          num_warps=4)
    return out


def _prepare_unsupported(fn: str, u, conv_state, conv_w, f, b, lengths, H: int) -> str | None:
    """The checks both prepare kernels make (u [B, T, 3P], the window, kernel-4 conv weights, f, b, lengths, a
    power-of-two head dim), naming `fn` and the field; None when they pass."""
    if triton is None:
        return "triton is not installed"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if not (u.device.type == "cuda" or interp):
        return f"{fn}: u must be a CUDA tensor, got {u.device}"
    if u.dim() != 3:
        return f"{fn}: u must be [B, T, 3P], got {tuple(u.shape)}"
    B, T, P3 = u.shape
    if P3 % 3 or (P3 // 3) % H:
        return f"{fn}: u's width {P3} is not 3 x heads ({H}) x head dim"
    D = P3 // 3 // H
    if D & (D - 1) or D < 16:
        return f"{fn}: the head dim must be a power of two >= 16, got {D}"
    if conv_w.dim() != 2 or tuple(conv_w.shape) != (P3, 4):
        return f"{fn}: conv_w must be [{P3}, 4] (kernel size 4), got {tuple(conv_w.shape)}"
    if tuple(conv_state.shape) != (B, 3, P3) or conv_state.stride(-1) != 1:
        return f"{fn}: conv_state must be [{B}, 3, {P3}] with unit last stride, got {tuple(conv_state.shape)}"
    if tuple(f.shape) != (B, T, P3 // 3) or tuple(b.shape) != (B, T, H):
        return f"{fn}: f must be [{B}, {T}, {P3 // 3}] and b [{B}, {T}, {H}], got {tuple(f.shape)}, {tuple(b.shape)}"
    if lengths.numel() != B or lengths.dtype.is_floating_point:
        return f"{fn}: lengths must hold {B} integers, got {lengths.dtype} {tuple(lengths.shape)}"
    for name, t in (("u", u), ("f", f), ("b", b)):
        if t.stride(-1) != 1:
            return f"{fn}: {name} must have unit last stride"
    return None


def decode_prepare_unsupported(u, conv_state, conv_w, f, b, lengths, A_log, dt_bias) -> str | None:
    """Why `kda_decode_prepare` does not take these inputs, naming the field; None when it does."""
    if u.dim() == 3 and u.shape[1] != 1:
        return f"kda_decode_prepare: u must be [B, 1, 3P] (one decode token), got {tuple(u.shape)}"
    why = _prepare_unsupported("kda_decode_prepare", u, conv_state, conv_w, f, b, lengths, A_log.numel())
    if why is None and dt_bias.numel() != u.shape[-1] // 3:
        why = f"kda_decode_prepare: dt_bias must hold {u.shape[-1] // 3} values, got {dt_bias.numel()}"
    return why


def kda_decode_prepare(u, conv_state, conv_w, f, b, lengths, A_log, dt_bias, *, scale: float, l2_eps: float,
                       lower_bound: float):
    """The delta rule's inputs for one decode token of a KDA layer, in one launch (the torch form is
    plugins/kda/cuda.py `prepare` at T = 1): u = h @ [w_q | w_k | w_v] [B, 1, 3P], the carried conv window
    conv_state [B, 3, 3P] (advanced IN PLACE for rows with lengths > 0), depthwise conv weights conv_w [3P, 4],
    f = the gate's low-rank projection [B, 1, P], b = the beta projection [B, 1, H], lengths [B] (0 or 1),
    A_log [H], dt_bias [P]. The conv and its SiLU run in u's dtype, as the torch form's do.
    Returns q, k [B, H, D] fp32 (L2-normalised, q times scale), v [B, H, D] in u's dtype, g [B, H, D] fp32 (the safe
    gate), beta [B, H] fp32 (sigmoid); g and beta are zero on rows with lengths 0, so the state stays untouched."""
    why = decode_prepare_unsupported(u, conv_state, conv_w, f, b, lengths, A_log, dt_bias)
    if why is not None:
        raise ValueError(why)
    B, _, P3 = u.shape
    H = A_log.numel()
    D = P3 // 3 // H
    dev = u.device
    oq = torch.empty(B, H, D, dtype=torch.float32, device=dev)
    ok, og = torch.empty_like(oq), torch.empty_like(oq)
    ov = torch.empty(B, H, D, dtype=u.dtype, device=dev)
    ob = torch.empty(B, H, dtype=torch.float32, device=dev)
    A_log, dt_bias, lengths = A_log.contiguous(), dt_bias.reshape(-1).contiguous(), lengths.reshape(-1).contiguous()
    _kda_decode_pre_kernel[(B, H)](u, conv_state, conv_w.contiguous(), f, b, A_log, dt_bias, lengths, oq, ok, ov, og,
                                   ob, u.stride(0), conv_state.stride(0), conv_state.stride(1), f.stride(0),
                                   b.stride(0), scale, l2_eps, lower_bound, H=H, D=D, num_warps=4)
    return oq, ok, ov, og, ob


PRE_CHANNELS = 512  # channels of q (and of k, v) per pre-kernel program and token: NH = PRE_CHANNELS / D heads
PRE_PER_THREAD = 4  # of them per thread (the warps: PRE_CHANNELS / (32 PRE_PER_THREAD))
PRE_PROGS_PER_SM, PRE_SPAN_MIN, PRE_SPAN_MAX = 8, 32, 512  # tokens per program: the longest span in [MIN, MAX]
# (powers of two) that still gives PRE_PROGS_PER_SM programs per SM. The sweep that chose these (and one token a step
# over four tokens with their loads issued together, which was slower): bench/results/kda_pre_walk_2026-12-06_h100.json


def _pre_shape(B: int, T: int, H: int, D: int, nsm: int) -> tuple[int, int, int]:
    """(heads per program, tokens per program, warps) of `_kda_prefill_pre_kernel`."""
    nh = min(triton.next_power_of_2(H), max(1, PRE_CHANNELS // D))
    warps = max(1, min(8, nh * D // (32 * PRE_PER_THREAD)))
    span = PRE_SPAN_MAX
    while span > PRE_SPAN_MIN and B * triton.cdiv(H, nh) * triton.cdiv(T, span) < PRE_PROGS_PER_SM * nsm:
        span //= 2
    return nh, span, warps


def prefill_prepare_unsupported(u, conv_state, conv_w, f, b, lengths) -> str | None:
    """Why `kda_prefill_prepare` does not take these inputs, naming the field; None when it does."""
    if b.dim() != 3:
        return f"kda_prefill_prepare: b must be [B, T, H], got {tuple(b.shape)}"
    why = _prepare_unsupported("kda_prefill_prepare", u, conv_state, conv_w, f, b, lengths, b.shape[-1])
    if why is not None:
        return why
    B, T, _ = u.shape
    if B > 65535 or triton.cdiv(T, PRE_SPAN_MIN) > 65535:  # the grid's z (sequences) and y (spans) limits
        return (f"kda_prefill_prepare: at most 65535 sequences and 65535 * {PRE_SPAN_MIN} tokens, got u "
                f"{tuple(u.shape)}")
    if max(T * u.stride(1), T * f.stride(1), T * b.stride(1)) >= 2 ** 31:  # in-row offsets are int32 in the kernel
        return (f"kda_prefill_prepare: T x row stride must stay below 2^31 (int32 offsets), got T={T}, strides "
                f"u {u.stride(1)}, f {f.stride(1)}, b {b.stride(1)}")
    return None


def kda_prefill_prepare(u, conv_state, conv_w, f, b, lengths, *, scale: float, l2_eps: float):
    """The delta rule's inputs for T tokens of a KDA layer in one launch (the torch form is plugins/kda/cuda.py
    `prepare`, whose gate this leaves to fla's chunk_kda): u = h @ [w_q | w_k | w_v] [B, T, 3P], the carried conv
    window conv_state [B, 3, 3P] (advanced IN PLACE to the last three of each row's lengths[b] tokens), depthwise conv
    weights conv_w [3P, 4], the gate's input f [B, T, P], the beta projection b [B, T, H], lengths [B] (valid tokens
    per row, <= T). The conv and its SiLU run in u's dtype, as the torch form's do.
    Returns q, k, v [B, T, H, D] in u's dtype (q and k L2-normalised with l2_eps inside the root, q times scale),
    f viewed [B, T, H, D], its padding rows (t >= lengths[b]) set to -inf IN PLACE (fla's in-kernel safe gate is then
    0 there; valid rows are not written), beta [B, T, H] fp32 (sigmoid, 0 on padding rows). q, k, v and beta are new
    tensors."""
    why = prefill_prepare_unsupported(u, conv_state, conv_w, f, b, lengths)
    if why is not None:
        raise ValueError(why)
    B, T, P3 = u.shape
    H = b.shape[-1]
    D = P3 // 3 // H
    dev = u.device
    oq = torch.empty(B, T, H, D, dtype=u.dtype, device=dev)
    ok, ov = torch.empty_like(oq), torch.empty_like(oq)
    ob = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    nh, span, warps = _pre_shape(B, T, H, D, num_sms(dev))
    _kda_prefill_pre_kernel[(triton.cdiv(H, nh), triton.cdiv(T, span), B)](
        u, conv_state, conv_w.contiguous(), f, b, lengths.reshape(-1).contiguous(), oq, ok, ov, ob, T, span,
        u.stride(0), u.stride(1), conv_state.stride(0), conv_state.stride(1), f.stride(0), f.stride(1), b.stride(0),
        b.stride(1), scale, l2_eps, H=H, D=D, NH=nh, num_warps=warps)
    return oq, ok, ov, f.view(B, T, H, D), ob


def kda_output_norm_gate(o, gate, weight, eps: float = 1e-5, out_dtype=torch.bfloat16):
    """o [B, T, H, D], gate [B, T, H*D], weight [D] -> RMSNorm_D(o) * weight * sigmoid(gate) as a new
    [B, T, H*D] tensor of out_dtype (computed in fp32)."""
    _need_triton()
    B, T, H, D = o.shape
    o, gate = o.contiguous(), gate.contiguous()
    out = torch.empty(B, T, H * D, dtype=out_dtype, device=o.device)
    weight = weight.contiguous()
    n = B * T * H
    br = 16
    _kda_post_kernel[(triton.cdiv(n, br),)](o, gate, weight, out, n, eps, H=H, D=D, BR=br, num_warps=4)
    return out


CHUNK = 64  # tokens per chunk of the chunked delta rule (fla's intra kernels: 32 or 64)
# the chunk recurrence's program shapes: (value columns of the state, warps, pipeline stages, programs resident per SM
# at head dim 128 on sm_90, by registers and shared memory). Every program walks its whole row, so a launch wants all
# of them resident at once: the first shape whose programs fit the GPU in one wave, else the last (fewest programs).
# Chosen by a sweep on an H100 (docs/kernels/kda.md): two stages beat one everywhere.
STATE_SHAPES = ((32, 4, 2, 1), (64, 4, 2, 1), (128, 8, 2, 1))


def _state_shape(B: int, H: int, V: int, nsm: int) -> tuple[int, int, int]:
    fits = [s for s in STATE_SHAPES if V % s[0] == 0] or [(V, 4, 2, 1)]  # V = 16: the whole value dim
    for bv, warps, stages, per_sm in fits:
        if B * H * (V // bv) <= per_sm * nsm:
            return bv, warps, stages
    bv, warps, stages, _ = fits[-1]
    return bv, warps, stages


def kda_chunk_state_out(qg, kg, w, u, g, Aqk, state, *, scale: float):
    """The sequential half of chunked KDA, fused: per chunk of 64 tokens, v_new = u - w @ S, the output
    o = scale qg @ S + tril(Aqk) @ v_new and the state update S = S * 2^g_last + kg^T @ v_new, with S held in
    registers across the row's chunks (fla-core runs this as two kernels and writes every chunk's state between them).
    Inputs are fla's intermediates for one [B, T, H] batch without cu_seqlens: qg, kg, w [B, T, H, K] (qg = q * 2^g),
    u [B, T, H, V], g [B, T, H, K] fp32 (the gate's chunk-local cumsum, log2 units; only each chunk's last row is
    read), Aqk [B, T, H, 64]; state [B, H, K, V] fp32 is read as the initial state and overwritten IN PLACE with the
    final one. Returns o [B, T, H, V] in u's dtype."""
    B, T, H, K = qg.shape
    V = u.shape[-1]
    for name, x, want in (("kg", kg, qg.shape), ("w", w, qg.shape), ("g", g, qg.shape), ("u", u, (B, T, H, V))):
        _need(tuple(x.shape) == tuple(want), f"kda_chunk_state_out: {name} must be {list(want)}, got {list(x.shape)}")
    _need(state.shape == (B, H, K, V) and state.dtype == torch.float32,
          f"kda_chunk_state_out: state must be fp32 [B, H, K, V] = {[B, H, K, V]}, got {list(state.shape)} "
          f"{state.dtype}")
    _need(Aqk.shape == (B, T, H, CHUNK), f"kda_chunk_state_out: Aqk must be [B, T, H, {CHUNK}], got {list(Aqk.shape)}")
    _need(min(K, V) >= 16 and K & (K - 1) == 0 and V & (V - 1) == 0,
          f"kda_chunk_state_out: the key and value head dims must be powers of two >= 16, got K={K}, V={V}")
    _need_triton()
    bv, warps, stages = _state_shape(B, H, V, num_sms(state.device))
    qg, kg, w, u, g, Aqk = (x.contiguous() for x in (qg, kg, w, u, g, Aqk))
    s = state if state.is_contiguous() else state.contiguous()
    o = torch.empty_like(u)
    _kda_chunk_state_out_kernel[(V // bv, B * H)](qg, kg, w, u, g, Aqk, s, o, T, triton.cdiv(T, CHUNK), scale, H=H,
                                                   K=K, V=V, BT=CHUNK, BV=bv, num_warps=warps, num_stages=stages)
    if s is not state:
        state.copy_(s)
    return o


def kda_chunk(q, k, v, f, beta, A_log, dt_bias, state, *, scale: float, lower_bound: float):
    """The chunked KDA core from prepared inputs (`kda_prefill_prepare`'s q, k, v, f, beta): fla-core's gate cumsum
    (the safe gate lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), chunk-local, log2 units) and its intra-chunk
    kernels (Aqk, the WY factors w, u, kg), then `kda_chunk_state_out`. The state [B, H, K, V] fp32 is updated IN
    PLACE. Returns o [B, T, H, V] in v's dtype; the same work as fla's `chunk_kda(..., use_gate_in_kernel=True,
    safe_gate=True)` without writing the per-chunk states."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2

    g = kda_gate_chunk_cumsum(g=f, A_log=A_log, dt_bias=dt_bias, scale=RCP_LN2, chunk_size=CHUNK,
                              lower_bound=lower_bound)
    # disable_recompute: the w/u kernel also writes qg = q * 2^g (it has g loaded), so ours reads no q or g rows
    w, u, qg, kg, Aqk, _ = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g, beta=beta, scale=scale, chunk_size=CHUNK,
                                               safe_gate=True, disable_recompute=True)
    return kda_chunk_state_out(qg, kg, w, u, g, Aqk, state, scale=scale)


def kda_prefill(u, conv_state, conv_w, f, b, lengths, A_log, dt_bias, gate, o_weight, state, *, scale: float,
                l2_eps: float, lower_bound: float, eps: float):
    """T tokens of a KDA layer's core: `kda_prefill_prepare` -> `kda_chunk` (chunk 64, fla's fp32 safe gate from f,
    A_log [H], dt_bias [P]) from `state` [B, H, D, D] fp32, which is updated IN PLACE ->
    `kda_output_norm_gate` (gate [B, T, P], o_weight [D]). Inputs as in `kda_prefill_prepare`; the window advances in
    place. Returns the normed, gated output [B, T, P] in u's dtype (before the output projection)."""
    q, k, v, fm, beta = kda_prefill_prepare(u, conv_state, conv_w, f, b, lengths, scale=scale, l2_eps=l2_eps)
    o = kda_chunk(q, k, v, fm, beta, A_log, dt_bias, state, scale=1.0, lower_bound=lower_bound)
    return kda_output_norm_gate(o, gate, o_weight, eps, out_dtype=u.dtype)
