"""Triton kernels of kimi.MoE / kimi.MoEExperts on the cuda backend. The SiTU activation of the experts and the
shared expert,

    act(u, g) = beta * tanh(g / beta) * sigmoid(g) * (linear_beta * tanh(u / linear_beta)  if linear_beta > 0 else u)

in one launch, read in the inputs' dtype, computed in fp32, written in the output dtype. The torch form
(plugins/moe/cuda.py `_act` with its casts) issues about a dozen elementwise kernels per call, two calls per MoE node;
in a CUDA-graph decode step each is a launch. tanh is computed from exp (|x| >= 2^-4) or its Taylor series to x^7
(below), within 2 fp32 ulps of torch.tanh over the range the tests cover.

Also the router's selection after its sigmoid (`route`: top-k of s + bias with ties to the lower expert, the
weights gathered, renormalized and scaled; 7 torch operations) and the routed path's sum over the k experts with the
RMSNorm that follows it (`sum_norm`: 9 operations), and the grouped GEMMs' row layout (`layout`: the rows sorted by
expert, stable, with the per-expert row ends, 8 operations), one launch each; and for a few rows (decode at small
batches) the routed experts themselves in two launches (`experts`, in place of three grouped GEMMs, a gather, a
weighting and a scatter). All four return None where they do not apply.

`situ(u, g, beta, linear_beta, dtype)` refuses (ValueError naming the field) what the kernel does not take;
`unsupported(u, g)` says why without raising (None when it applies). Runs on CUDA tensors, or on CPU tensors under
TRITON_INTERPRET=1 (correctness checks only).
"""

from __future__ import annotations

import os

import torch

try:  # triton is optional: importing this module on a CPU machine without it must work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BLOCK = 1024
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _tanh(x):
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        big = (1.0 - e) / (1.0 + e)
        x2 = ax * ax
        small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        t = tl.where(ax < 0.0625, small, big)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _situ_kernel(U, G, OUT, n, beta, linear_beta, LINEAR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
        if LINEAR:
            u = linear_beta * _tanh(u / linear_beta)
        tl.store(OUT + offs, (a * u).to(OUT.dtype.element_ty), mask=m)


if triton is not None:

    @triton.jit
    def _route_kernel(S, BIAS, IDX, WK, E, scaling, K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        s = tl.load(S + row * E + e, mask=e < E, other=0.0)
        choice = s + tl.load(BIAS + e, mask=e < E, other=0.0).to(tl.float32)
        choice = tl.where(choice != choice, float("inf"), choice)  # NaN first, as the descending sort puts it
        taken = e >= E  # the padding lanes never win
        ks = tl.arange(0, KP)  # K slots padded to a power of two
        picked = tl.zeros([KP], dtype=tl.int32)
        weight = tl.zeros([KP], dtype=tl.float32)
        for j in tl.static_range(K):  # the largest untaken choice, ties to the lower expert (the stable sort's order)
            cand = tl.where(taken, float("-inf"), choice)
            m = tl.max(cand, axis=0)
            i = tl.minimum(tl.min(tl.where((cand == m) & ~taken, e, BLOCK_E), axis=0), E - 1)
            picked = tl.where(ks == j, i, picked)
            weight = tl.where(ks == j, tl.sum(tl.where(e == i, s, 0.0), axis=0), weight)
            taken = taken | (e == i)
        if RENORM:
            weight = weight / tl.sum(weight, axis=0)
        tl.store(IDX + row * K + ks, picked.to(tl.int64), mask=ks < K)
        tl.store(WK + row * K + ks, weight * scaling, mask=ks < K)

    @triton.jit
    def _norm_kernel(R, W, OUT, L, eps, K: tl.constexpr, BLOCK_L: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_L)
        m = d < L
        acc = tl.zeros([BLOCK_L], dtype=tl.float32)
        for j in tl.static_range(K):  # the k expert rows of the token, summed in a fixed order
            acc += tl.load(R + (row * K + j) * L + d, mask=m, other=0.0)
        inv = 1.0 / tl.sqrt(tl.sum(acc * acc, axis=0) / L + eps)
        w = tl.load(W + d, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + row * L + d, (acc * inv * w).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _layout_kernel(FLAT, ORDER, EXPERT, TOKEN, OFFS, M, K: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                       BN: tl.constexpr, SHIFT: tl.constexpr):
        # the M = N * k expert ids in one tile: a histogram's cumsum gives each expert's row end; a sort of the
        # unique keys (expert << SHIFT | row) gives the rows by expert, rows of one expert in row order (the order
        # torch.sort(stable=True) gives); padding rows sort last
        i = tl.arange(0, BN)
        m = i < M
        f = tl.load(FLAT + i, mask=m, other=0).to(tl.int32)
        e = tl.arange(0, BE)
        tl.store(OFFS + e, tl.cumsum(tl.histogram(f, BE, mask=m), 0), mask=e < E)
        key = tl.sort(tl.where(m, (f << SHIFT) | i, 0x7FFFFFFF))
        row = key & ((1 << SHIFT) - 1)
        tl.store(ORDER + i, row.to(tl.int64), mask=m)
        tl.store(EXPERT + i, (key >> SHIFT).to(tl.int64), mask=m)
        tl.store(TOKEN + i, (row // K).to(tl.int64), mask=m)

    @triton.jit
    def _experts_up_kernel(Z, TOKEN, EXPERT, W1, W3, ACT, L, I, stride_z, beta, linear_beta, LINEAR: tl.constexpr,
                           BI: tl.constexpr, BL: tl.constexpr):
        # one sorted row r (expert e, token t) x BI outputs: gate = z[t] . w1[e, i, :], up = z[t] . w3[e, i, :],
        # act = SiTU(up, gate) from the fp32 sums; rows of one expert are neighbours, so their weights hit in L2
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BI + tl.arange(0, BI)
        mi = i < I
        e = tl.load(EXPERT + r)
        zrow = Z + tl.load(TOKEN + r) * stride_z
        wrow = e * I * L + i.to(tl.int64)[:, None] * L
        g2 = tl.zeros([BI, BL], dtype=tl.float32)  # lane-wise partial sums, reduced once after the loop
        u2 = tl.zeros([BI, BL], dtype=tl.float32)
        for l0 in range(0, L, BL):
            d = l0 + tl.arange(0, BL)
            ml = d < L
            x = tl.load(zrow + d, mask=ml, other=0.0).to(tl.float32)[None, :]
            m = mi[:, None] & ml[None, :]
            g2 += tl.load(W1 + wrow + d[None, :], mask=m, other=0.0).to(tl.float32) * x
            u2 += tl.load(W3 + wrow + d[None, :], mask=m, other=0.0).to(tl.float32) * x
        g = tl.sum(g2, axis=1)
        u = tl.sum(u2, axis=1)
        a = beta * _tanh(g / beta) * tl.sigmoid(g)
        if LINEAR:
            u = linear_beta * _tanh(u / linear_beta)
        tl.store(ACT + r * I + i, a * u, mask=mi)

    @triton.jit
    def _experts_down_kernel(ACT, EXPERT, ORDER, WK, W2, R, L, I, BL: tl.constexpr, BI: tl.constexpr):
        # one sorted row r x BL latent outputs: act[r] . w2[e, d, :] times the row's routing weight, written at the
        # row's token-major place order[r] (each place written once: no atomics)
        r = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BL + tl.arange(0, BL)
        ml = d < L
        e = tl.load(EXPERT + r)
        dst = tl.load(ORDER + r)
        wrow = e * L * I + d.to(tl.int64)[:, None] * I
        acc = tl.zeros([BL, BI], dtype=tl.float32)  # lane-wise partial sums, reduced once after the loop
        for i0 in range(0, I, BI):
            i = i0 + tl.arange(0, BI)
            mi = i < I
            a = tl.load(ACT + r * I + i, mask=mi, other=0.0)[None, :]
            acc += tl.load(W2 + wrow + i[None, :], mask=ml[:, None] & mi[None, :], other=0.0).to(tl.float32) * a
        tl.store(R + dst * L + d, tl.sum(acc, axis=1) * tl.load(WK + dst), mask=ml)

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unsupported(u: torch.Tensor, g: torch.Tensor) -> str | None:
    """Why the kernel does not apply to (u, g), naming the field; None when it does."""
    if triton is None:
        return "triton is not installed"
    if u.device != g.device or not (u.device.type == "cuda" or _interpreting()):
        return f"situ: u and g must be on one CUDA device, got {u.device} and {g.device}"
    if u.shape != g.shape:
        return f"situ: u and g must have one shape, got {tuple(u.shape)} and {tuple(g.shape)}"
    for name, t in (("u", u), ("g", g)):
        if t.dtype not in FLOATS:
            return f"situ: {name} must be {' or '.join(map(str, FLOATS))}, got {t.dtype}"
        if not t.is_contiguous():
            return f"situ: {name} must be contiguous"
    return None


def situ(u: torch.Tensor, g: torch.Tensor, beta: float, linear_beta: float, dtype: torch.dtype) -> torch.Tensor:
    """act(u, g) in `dtype` (see the module docstring)."""
    why = unsupported(u, g)
    if why is not None:
        raise ValueError(why)
    if dtype not in FLOATS:
        raise ValueError(f"situ: dtype must be {' or '.join(map(str, FLOATS))}, got {dtype}")
    if not beta > 0:
        raise ValueError(f"situ: beta must be positive, got {beta}")
    out = torch.empty(u.shape, dtype=dtype, device=u.device)
    n = u.numel()
    if n:
        _situ_kernel[(triton.cdiv(n, BLOCK),)](u, g, out, n, float(beta), float(linear_beta),
                                               LINEAR=linear_beta > 0, BLOCK=BLOCK)
    return out


MAX_EXPERTS = 1024  # E of the router kernel (one row of choices per program)
MAX_LATENT = 8192  # L of the norm kernel (one latent row per program)


def route(s: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool, scaling: float
          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The router's selection from s = sigmoid(logits) [N, E] float32: (idx [N, k] int64, weights [N, k] float32)
    exactly as the torch form picks (top-k of s + bias, ties to the lower expert; weights s at idx, renormalized,
    scaled). None when the kernel does not apply (the caller runs the torch form)."""
    if triton is None or not (s.is_cuda or _interpreting()) or s.dim() != 2 or s.dtype != torch.float32 \
            or not s.is_contiguous() or bias.dim() != 1 or bias.shape[0] != s.shape[1] or not 1 <= k <= s.shape[1] \
            or s.shape[1] > MAX_EXPERTS or bias.dtype not in FLOATS or bias.device != s.device:
        return None
    N, E = s.shape
    idx = torch.empty(N, k, dtype=torch.int64, device=s.device)
    wk = torch.empty(N, k, dtype=torch.float32, device=s.device)
    if N:
        _route_kernel[(N,)](s, bias.contiguous(), idx, wk, E, float(scaling), K=k, KP=triton.next_power_of_2(k), RENORM=bool(renormalize),
                            BLOCK_E=triton.next_power_of_2(E))
    return idx, wk


MAX_LAYOUT_ROWS = 1024  # N * k of the layout kernel (one tile: decode and verification steps; prefill chunks sort
# in torch, where a multi-block sort is faster)


def layout(flat: torch.Tensor, k: int, E: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The grouped GEMMs' row layout of the expert ids flat [N * k] (int64, each in [0, E): the router's ids are;
    an id outside gives a wrong layout, where the torch form raises): (order [N * k] int64,
    the rows sorted by expert, stable; expert = flat[order]; token = order // k; offs [E] int32, the cumulative
    row ends per expert), equal to the torch form's sort / index_select / floor_divide / scatter_add_ / cumsum, in
    one launch. None when the kernel does not apply (more than MAX_LAYOUT_ROWS rows, more than MAX_EXPERTS experts)."""
    if triton is None or not (flat.is_cuda or _interpreting()) or flat.dim() != 1 or flat.dtype != torch.int64 \
            or not flat.is_contiguous() or not 0 < flat.numel() <= MAX_LAYOUT_ROWS or not 0 < E <= MAX_EXPERTS:
        return None
    M, dev = flat.numel(), flat.device
    order = torch.empty(M, dtype=torch.int64, device=dev)
    expert, token = torch.empty_like(order), torch.empty_like(order)
    offs = torch.empty(E, dtype=torch.int32, device=dev)
    BN = triton.next_power_of_2(M)
    _layout_kernel[(1,)](flat, order, expert, token, offs, M, K=k, E=E, BE=triton.next_power_of_2(E), BN=BN,
                         SHIFT=max(BN.bit_length() - 1, 1), num_warps=8 if BN >= 512 else 4)
    return order, expert, token, offs


def sum_norm(r: torch.Tensor, k: int, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor | None:
    """r [N * k, L] float32 (a token's k expert rows together) -> RMSNorm(sum over k) * weight in `dtype` [N, L];
    None when the kernel does not apply."""
    if triton is None or not (r.is_cuda or _interpreting()) or r.dim() != 2 or r.dtype != torch.float32 \
            or not r.is_contiguous() or r.shape[0] % k or r.shape[1] > MAX_LATENT or weight.shape != (r.shape[1],) \
            or weight.dtype not in FLOATS or weight.device != r.device or dtype not in FLOATS:
        return None
    N, L = r.shape[0] // k, r.shape[1]
    out = torch.empty(N, L, dtype=dtype, device=r.device)
    if N:
        _norm_kernel[(N,)](r, weight.contiguous(), out, L, float(eps), K=k, BLOCK_L=triton.next_power_of_2(L))
    return out


MAX_EXPERT_ROWS = 64  # N * k of the small-batch experts kernels (decode at B <= 8 with k = 8); more rows take the
# grouped GEMM. Measured against it up to this cap: docs/cuda_backend.md "The experts of a small batch"
EXPERT_BLOCKS = (16, 256)  # (outputs, reduction) of a program's tile in both kernels


def experts(z: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, order: torch.Tensor, wk: torch.Tensor,
            w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, beta: float, linear_beta: float
            ) -> torch.Tensor | None:
    """The routed experts of a few rows in two launches: r [N * k, L] float32 in token-major order (row
    order[j] = wk[order[j]] * w2[e] @ SiTU(w3[e] @ z[t], w1[e] @ z[t]) for sorted row j of expert e = expert[j] and
    token t = token[j]; plugins/moe/cuda.py `_layout` gives order, expert and token). z [N, L]; w1, w3 [E, I, L];
    w2 [E, L, I], all one float dtype, contiguous (z: rows of unit stride); token, expert, order int64 and wk
    float32, [N * k] contiguous; all on one device. Products and the activation in fp32 from the inputs'
    values (the grouped GEMM path rounds gate, up and act to the weights' dtype in between). None when the kernel
    does not apply (more than MAX_EXPERT_ROWS rows, other layouts or dtypes): the caller takes the grouped GEMMs."""
    M = order.numel()
    if triton is None or not (z.is_cuda or _interpreting()) or not 0 < M <= MAX_EXPERT_ROWS or beta <= 0 \
            or z.dim() != 2 or w1.dim() != 3 or w1.shape != w3.shape or w2.shape != (w1.shape[0], z.shape[1],
                                                                                     w1.shape[1]) \
            or w1.shape[2] != z.shape[1] or z.dtype not in FLOATS or z.stride(1) != 1 \
            or any(t.device != z.device for t in (token, expert, order, wk, w1, w3, w2)) \
            or any(t.dtype != z.dtype or not t.is_contiguous() for t in (w1, w3, w2)) \
            or any(t.dtype != torch.int64 or t.numel() != M or not t.is_contiguous() for t in (token, expert, order)) \
            or wk.dtype != torch.float32 or wk.numel() != M or not wk.is_contiguous():
        return None
    L, I = z.shape[1], w1.shape[1]
    out_block, red_block = EXPERT_BLOCKS
    act = torch.empty(M, I, dtype=torch.float32, device=z.device)
    _experts_up_kernel[(M, triton.cdiv(I, out_block))](z, token, expert, w1, w3, act, L, I, z.stride(0), float(beta),
                                                       float(linear_beta), LINEAR=linear_beta > 0, BI=out_block,
                                                       BL=red_block)
    r = torch.empty(M, L, dtype=torch.float32, device=z.device)
    _experts_down_kernel[(M, triton.cdiv(L, out_block))](act, expert, order, wk, w2, r, L, I,
                                                         BL=out_block, BI=red_block)
    return r

