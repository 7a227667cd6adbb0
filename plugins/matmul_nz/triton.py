"""Triton kernel of kimi.MatMulNZ: y = x @ W with W stored in the NZ blocked layout, read block by block (no
relayout at run time). Semantics: plugins/matmul_nz/reference.py (`matmul_nz`).

W [K, N] -> NZ [N1, K', n0] (n0 = 16 for 16-bit types): element (k, n) at [n // n0, k, n % n0], so each program's
[BK, BN] weight tile is BN / n0 fractal columns, each a contiguous run of BK * n0 elements. Grid: one program per
[BM, BN] output tile, grouped by GROUP row tiles for L2 reuse; fp32 accumulation over K in steps of BK, output in
x's dtype. Tiles by the number of rows M (`tiles`): decode-sized M <= 64 and prefill-sized M > 64.
History (what was measured): docs/kernels/matmul_nz.md.
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
    def _matmul_nz_kernel(X, W, Y, M, N, K, KP, stride_xm, stride_ym,
                          N0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          GROUP: tl.constexpr):
        pid = tl.program_id(0)
        n_m = tl.cdiv(M, BM)
        n_n = tl.cdiv(N, BN)
        group = pid // (GROUP * n_n)
        first_m = group * GROUP
        size_m = tl.minimum(n_m - first_m, GROUP)
        pid_m = first_m + (pid % size_m)
        pid_n = (pid % (GROUP * n_n)) // size_m
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        # NZ address of (k, n): (n // N0) * KP * N0 + k * N0 + n % N0
        col = (offs_n // N0) * (KP * N0) + (offs_n % N0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + offs_k
            a = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :],
                        mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(W + kk[:, None] * N0 + col[None, :], mask=(kk[:, None] < KP) & (offs_n[None, :] < N),
                        other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_DECODE = dict(bm=16, bn=128, bk=128, num_warps=4, num_stages=4)  # M <= 64
_PREFILL = dict(bm=128, bn=128, bk=64, num_warps=8, num_stages=3)  # M > 64


def tiles(M: int) -> dict:
    """The tile configuration for M rows (decode-sized or prefill-sized)."""
    return _DECODE if M <= 64 else _PREFILL


def matmul_nz(x: torch.Tensor, w_nz: torch.Tensor, K: int, N: int, *, out: torch.Tensor | None = None,
              **unknown) -> torch.Tensor:
    """x [..., K] (unit last stride, else copied) @ W [K, N] given as w_nz = nd_to_nz(W) [N1, K', n0] (K' >= K,
    N1 * n0 >= N; rows past K and columns past N are ignored) -> [..., N] in x's dtype. out: optional [M, N]
    (M = rows of x) with unit last stride, written in place."""
    if unknown:
        raise ValueError(f"matmul_nz: unknown keyword(s) {sorted(unknown)} (known: out)")
    if triton is None:
        raise RuntimeError("matmul_nz needs triton and a CUDA GPU")
    N1, KP, N0 = w_nz.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    cfg = tiles(M)
    if KP < K or N1 * N0 < N or cfg["bn"] % N0:
        raise ValueError(f"matmul_nz: w_nz shape {tuple(w_nz.shape)} does not hold a [{K}, {N}] weight in "
                         f"{cfg['bn']}-column tiles")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = out if out is not None else torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, cfg["bm"]) * triton.cdiv(N, cfg["bn"]),)
    _matmul_nz_kernel[grid](x2, w_nz, y, M, N, K, KP, x2.stride(0), y.stride(0), N0=N0, BM=cfg["bm"], BN=cfg["bn"],
                            BK=cfg["bk"], GROUP=8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.reshape(*lead, N)
