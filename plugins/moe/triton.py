"""Triton kernel of the MoE's SiTU activation (kimi.MoE / kimi.MoEExperts on the cuda backend): the experts' and the
shared expert's

    act(u, g) = beta * tanh(g / beta) * sigmoid(g) * (linear_beta * tanh(u / linear_beta)  if linear_beta > 0 else u)

in one launch, read in the inputs' dtype, computed in fp32, written in the output dtype. The torch form
(plugins/moe/cuda.py `_act` with its casts) issues about a dozen elementwise kernels per call, two calls per MoE node;
in a CUDA-graph decode step each is a launch. tanh is computed from exp (|x| >= 2^-4) or its Taylor series to x^7
(below), within 2 fp32 ulps of torch.tanh over the range the tests cover.

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
