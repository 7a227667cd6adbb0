"""Triton kernels of Block Attention Residuals (semantics: plugins/attn_res/__init__.py; the torch forms they replace on
the GPU: plugins/attn_res/cuda.py `merge` and `stage1`).

- `attn_res_merge(o1, m1, l1, partial, query, norm_weight, slot, eps, norm_eps)`: kimi.AttnResMerge in one launch,
  one program per row (b, t):
      pass 1 over D:  sp = (p . q) / sqrt(mean(p^2) + eps)                         (p = partial[b, t])
                      m = max(m1[slot], sp), a = e^{m1 - m} / den, c = e^{sp - m} / den, den = l1 e^{m1 - m} + e^{sp - m}
      pass 2 over D:  ms = mean(mix^2), mix = o1[slot] a + p c                      (mix recomputed, not stored)
      pass 3 over D:  out = mix / sqrt(ms + norm_eps) * norm_weight, in partial's dtype
  where the torch form divides by den, the kernel multiplies by a = e^{m1 - m} / den (one rounding more; fp32 relative
  error about 1e-7).
- `attn_res_stage1(bank, queries, eps)`: kimi.AttnResStage1 in one launch, one program per (row (b, t), query l),
  the row's K sources as [K, BD] tiles:
      pass 1 over D:  s[k] = (bank_k . q_l) / sqrt(mean(bank_k^2) + eps) (products and squares accumulated
                      elementwise, reduced once); m1 = max_k s, e = e^{s - m1}, l1 = sum_k e
      pass 2 over D:  o1[l] = sum_k e[k] bank_k, in bank's dtype
Every sum in fp32 whatever the tensors' dtypes (float32, bfloat16, float16). D is any size (blocks of at most
BLOCK_D elements, the last one masked); the rows' tensors are read through their strides (unit stride on D).
No host synchronization; CUDA-graph capturable (the outputs are allocated with torch.empty).

`unsupported_merge(...)` / `unsupported_stage1(...)` return why a kernel does not apply to given tensors (None when
it does), naming the field; the entry points raise ValueError with that message.
"""

from __future__ import annotations

import os

import torch

try:  # triton is optional: importing this module on a CPU machine without it must work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BLOCK_D = 1024  # elements of a row per step of the passes over D (smaller D: the next power of two)
NUM_WARPS = 4
STAGE1_MAX_SOURCES = 16  # K of AttnResStage1 (a [K, BD] tile per program; larger banks run the torch form)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _merge_kernel(O1, M1, L1, P, Q, W, OUT, T, D, s_ob, s_ot, s_mb, s_mt, s_lb, s_lt, s_pb, s_pt, eps, norm_eps,
                      BD: tl.constexpr):
        r = tl.program_id(0)
        b, t = r // T, r % T
        o1 = O1 + b.to(tl.int64) * s_ob + t.to(tl.int64) * s_ot
        p = P + b.to(tl.int64) * s_pb + t.to(tl.int64) * s_pt
        cols = tl.arange(0, BD)
        ss = tl.zeros([BD], tl.float32)
        dot = tl.zeros([BD], tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + cols
            pv = tl.load(p + d, mask=d < D, other=0.0).to(tl.float32)
            qv = tl.load(Q + d, mask=d < D, other=0.0).to(tl.float32)
            ss += pv * pv
            dot += pv * qv
        sp = tl.sum(dot, 0) / tl.sqrt(tl.sum(ss, 0) / D + eps)
        m1 = tl.load(M1 + b * s_mb + t * s_mt)
        l1 = tl.load(L1 + b * s_lb + t * s_lt)
        m = tl.maximum(m1, sp)
        e1 = tl.exp(m1 - m)
        ep = tl.exp(sp - m)
        den = l1 * e1 + ep
        a = e1 / den
        c = ep / den
        sm = tl.zeros([BD], tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + cols
            ov = tl.load(o1 + d, mask=d < D, other=0.0).to(tl.float32)
            pv = tl.load(p + d, mask=d < D, other=0.0).to(tl.float32)
            mix = ov * a + pv * c
            sm += mix * mix
        inv = 1.0 / tl.sqrt(tl.sum(sm, 0) / D + norm_eps)
        out = OUT + r.to(tl.int64) * D
        for d0 in range(0, D, BD):
            d = d0 + cols
            ov = tl.load(o1 + d, mask=d < D, other=0.0).to(tl.float32)
            pv = tl.load(p + d, mask=d < D, other=0.0).to(tl.float32)
            wv = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)
            y = (ov * a + pv * c) * inv * wv
            tl.store(out + d, y.to(OUT.dtype.element_ty), mask=d < D)

    @triton.jit
    def _stage1_kernel(BANK, QS, O1, M1, L1, R, D, K, s_bk, s_bb, s_bt, s_q, T, eps, KP: tl.constexpr,
                       BD: tl.constexpr):
        # grid (rows, queries): program (r, j) computes query j of row r; o1 [L, R, D], m1 / l1 [L, R] contiguous.
        # Pass 1 accumulates the K sources' squares and products with q_j elementwise over D ([KP, BD] tiles) and
        # reduces once at the end; pass 2 writes o1[j, r] = sum_k e[k] bank_k
        r = tl.program_id(0)
        j = tl.program_id(1)
        b, t = r // T, r % T
        row = BANK + b.to(tl.int64) * s_bb + t.to(tl.int64) * s_bt
        ks = tl.arange(0, KP)
        cols = tl.arange(0, BD)
        kin = ks[:, None] < K
        ss = tl.zeros([KP, BD], tl.float32)
        dots = tl.zeros([KP, BD], tl.float32)
        for d0 in range(0, D, BD):
            d = d0 + cols
            bv = tl.load(row + ks[:, None].to(tl.int64) * s_bk + d[None, :], mask=kin & (d[None, :] < D),
                         other=0.0).to(tl.float32)
            qv = tl.load(QS + j * s_q + d, mask=d < D, other=0.0).to(tl.float32)
            ss += bv * bv
            dots += bv * qv[None, :]
        inv = 1.0 / tl.sqrt(tl.sum(ss, 1) / D + eps)  # [KP]
        sc = tl.where(ks < K, tl.sum(dots, 1) * inv, float("-inf"))
        m1 = tl.max(sc, 0)
        e = tl.where(ks < K, tl.exp(sc - m1), 0.0)
        tl.store(M1 + j.to(tl.int64) * R + r, m1)
        tl.store(L1 + j.to(tl.int64) * R + r, tl.sum(e, 0))
        out = O1 + (j.to(tl.int64) * R + r) * D
        for d0 in range(0, D, BD):
            d = d0 + cols
            bv = tl.load(row + ks[:, None].to(tl.int64) * s_bk + d[None, :], mask=kin & (d[None, :] < D),
                         other=0.0).to(tl.float32)
            o = tl.sum(bv * e[:, None], 0)  # [BD]
            tl.store(out + d, o.to(O1.dtype.element_ty), mask=d < D)


def _interpreting() -> bool:
    """Under TRITON_INTERPRET=1 the kernels run on CPU tensors (Triton's interpreter: correctness checks only)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block(D: int) -> int:
    return min(BLOCK_D, triton.next_power_of_2(D))


def _where(tensors) -> str | None:
    devs = {t.device for t in tensors}
    if len(devs) != 1 or not (next(iter(devs)).type == "cuda" or _interpreting()):
        return f"every tensor must be on one CUDA device, got {sorted(map(str, devs))}"
    if triton is None:
        return "triton is not installed"
    return None


def unsupported_merge(o1, m1, l1, partial, query, norm_weight, slot: int) -> str | None:
    """Why `attn_res_merge` cannot run these tensors (naming the field), or None when it can."""
    if partial.dim() != 3:
        return f"attn_res_merge: partial must be [B, T, D], got {tuple(partial.shape)}"
    B, T, D = partial.shape
    if o1.dim() != 4 or tuple(o1.shape[1:]) != (B, T, D):
        return f"attn_res_merge: o1 must be [L, B={B}, T={T}, D={D}], got {tuple(o1.shape)}"
    Lq = o1.shape[0]
    for name, t in (("m1", m1), ("l1", l1)):
        if tuple(t.shape) != (Lq, B, T) or t.dtype != torch.float32:
            return f"attn_res_merge: {name} must be float32 [L={Lq}, B={B}, T={T}], got {t.dtype} {tuple(t.shape)}"
    for name, t in (("query", query), ("norm_weight", norm_weight)):
        if tuple(t.shape) != (D,):
            return f"attn_res_merge: {name} must be [D={D}], got {tuple(t.shape)}"
    for name, t in (("o1", o1), ("partial", partial), ("query", query), ("norm_weight", norm_weight)):
        if t.dtype not in FLOATS:
            return f"attn_res_merge: {name} must be {' or '.join(map(str, FLOATS))}, got {t.dtype}"
        if D > 1 and t.stride(-1) != 1:
            return f"attn_res_merge: {name} must have a unit stride on D, got strides {t.stride()}"
    if not 0 <= slot < Lq:
        return f"attn_res_merge: slot must be in [0, {Lq}), got {slot}"
    why = _where((o1, m1, l1, partial, query, norm_weight))
    return None if why is None else f"attn_res_merge: {why}"


def _out(out, shape, dtype, like, name):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous() or out.device != like.device:
        raise ValueError(f"{name} must be a contiguous {dtype} {tuple(shape)} tensor on {like.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def attn_res_merge(o1, m1, l1, partial, query, norm_weight, slot: int, eps: float, norm_eps: float, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """o1 [L,B,T,D], m1 / l1 [L,B,T] float32, partial [B,T,D], query [D], norm_weight [D] -> RMSNorm(mix) [B,T,D]
    in partial's dtype (kimi.AttnResMerge with attributes slot, eps, norm_eps), written into `out` when given."""
    why = unsupported_merge(o1, m1, l1, partial, query, norm_weight, slot)
    if why is not None:
        raise ValueError(why)
    B, T, D = partial.shape
    out = _out(out, (B, T, D), partial.dtype, partial, "attn_res_merge: out")
    if B * T == 0 or D == 0:
        return out
    o, mm, ll = o1[slot], m1[slot], l1[slot]
    _merge_kernel[(B * T,)](o, mm, ll, partial, query, norm_weight, out, T, D, o.stride(0), o.stride(1),
                            mm.stride(0), mm.stride(1), ll.stride(0), ll.stride(1), partial.stride(0),
                            partial.stride(1), float(eps), float(norm_eps), BD=_block(D), num_warps=NUM_WARPS)
    return out


def unsupported_stage1(bank, queries) -> str | None:
    """Why `attn_res_stage1` cannot run these tensors (naming the field), or None when it can."""
    if bank.dim() != 4:
        return f"attn_res_stage1: bank must be [K, B, T, D], got {tuple(bank.shape)}"
    K, _B, _T, D = bank.shape
    if queries.dim() != 2 or queries.shape[1] != D:
        return f"attn_res_stage1: queries must be [L, D={D}], got {tuple(queries.shape)}"
    if not (1 <= K <= STAGE1_MAX_SOURCES and 1 <= queries.shape[0] <= 65535):
        return (f"attn_res_stage1: the kernel holds 1..{STAGE1_MAX_SOURCES} sources and 1..65535 queries, got K={K}, "
                f"L={queries.shape[0]}")
    for name, t in (("bank", bank), ("queries", queries)):
        if t.dtype not in FLOATS:
            return f"attn_res_stage1: {name} must be {' or '.join(map(str, FLOATS))}, got {t.dtype}"
        if D > 1 and t.stride(-1) != 1:
            return f"attn_res_stage1: {name} must have a unit stride on D, got strides {t.stride()}"
    why = _where((bank, queries))
    return None if why is None else f"attn_res_stage1: {why}"


def attn_res_stage1(bank, queries, eps: float, *, out: tuple | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bank [K,B,T,D], queries [L,D] -> o1 [L,B,T,D] in bank's dtype, m1 [L,B,T], l1 [L,B,T] float32
    (kimi.AttnResStage1 with attribute eps), written into `out` = (o1, m1, l1) when given."""
    why = unsupported_stage1(bank, queries)
    if why is not None:
        raise ValueError(why)
    K, B, T, D = bank.shape
    Lq = queries.shape[0]
    o1, m1, l1 = out if out is not None else (None, None, None)
    o1 = _out(o1, (Lq, B, T, D), bank.dtype, bank, "attn_res_stage1: out o1")
    m1 = _out(m1, (Lq, B, T), torch.float32, bank, "attn_res_stage1: out m1")
    l1 = _out(l1, (Lq, B, T), torch.float32, bank, "attn_res_stage1: out l1")
    R = B * T
    if R == 0 or D == 0:
        return o1, m1, l1
    kp = triton.next_power_of_2(K)
    bd = min(_block(D), max(128, 2048 // kp))  # the [K, BD] bank tile: at most 2048 fp32 values (no spills at sm_90)
    _stage1_kernel[(R, Lq)](bank, queries, o1, m1, l1, R, D, K, bank.stride(0), bank.stride(1), bank.stride(2),
                            queries.stride(0), T, float(eps), KP=kp, BD=bd, num_warps=NUM_WARPS)
    return o1, m1, l1
