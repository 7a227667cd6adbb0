"""The MoE's Triton kernels (plugins/moe/triton.py: SiTU activation, router selection, row layout, the small-batch
experts, sum over k with the RMSNorm)
against the torch forms they replace on the GPU (plugins/moe/cuda.py), on fresh random inputs, outputs poisoned by
construction (torch.empty). The router's expert ids must equal the torch form's exactly, ties included.

Kernel tests run on a CUDA GPU, or on CPU tensors under TRITON_INTERPRET=1, and skip cleanly otherwise. Tolerances:
float32 relative error (norm) < 1e-6 and every element within 4e-6 relative + 1e-7 absolute; bfloat16 / float16
outputs within one ulp of the fp32 torch form (the interpreter truncates casts). The refusal test runs everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from kimi_compile.plugins.moe import cuda as mcuda
from kimi_compile.plugins.moe import triton as mtk

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
kernels = pytest.mark.skipif(mtk.triton is None or not (INTERPRET or torch.cuda.is_available()),
                             reason="the Triton kernel needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _inputs(shape, dtype, gen, scale=3.0):
    u = (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEV)
    g = (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEV)
    # the small-|x| branch of tanh and both signs, exactly
    u.view(-1)[:4] = torch.tensor([0.0, 1e-4, -3e-2, 0.0625], dtype=dtype)
    g.view(-1)[:4] = torch.tensor([-1e-5, 0.05, -0.0624, 40.0], dtype=dtype)
    return u, g


@kernels
@pytest.mark.parametrize("linear_beta", [25.0, 0.0])
@pytest.mark.parametrize("shape", [(3, 5), (1, 2048), (37, 1536)])
def test_situ_float32_matches_the_torch_form(shape, linear_beta):
    gen = torch.Generator().manual_seed(hash((shape, linear_beta)) % 2**31)
    u, g = _inputs(shape, torch.float32, gen)
    got = mtk.situ(u, g, 4.0, linear_beta, torch.float32).cpu().double()
    want = mcuda._act(u.cpu().double(), g.cpu().double(), 4.0, linear_beta)
    assert float((got - want).norm() / want.norm()) < 1e-6
    assert bool(((got - want).abs() <= 4e-6 * want.abs() + 1e-7).all())


@kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_situ_low_precision_within_one_ulp(dtype):
    gen = torch.Generator().manual_seed(7)
    u, g = _inputs((64, 96), dtype, gen)
    got = mtk.situ(u, g, 4.0, 25.0, dtype).cpu().float()
    assert got.dtype == torch.float32 and mtk.situ(u, g, 4.0, 25.0, dtype).dtype == dtype
    want = mcuda._act(u.cpu().float(), g.cpu().float(), 4.0, 25.0)
    assert bool(((got - want).abs() <= want.abs() * ULP[dtype] * 1.001 + 1e-6).all())


@pytest.mark.skipif(not torch.cuda.is_available() or mtk.triton is None, reason="needs CUDA and triton")
def test_moe_kernel_on_the_gpu_matches_its_torch_activation(monkeypatch):
    """The cuda backend's MoE kernel with the Triton kernels (activation, router, layout, sum and norm) equals the same
    kernel with the torch forms (bf16)."""
    gen = torch.Generator().manual_seed(3)
    N, H, E, L, F, k = 9, 64, 8, 32, 48, 3
    r = lambda *s: (torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(torch.bfloat16).cuda()  # noqa: E731
    x = [r(N, H), r(E, H).float(), torch.zeros(E).cuda(), r(L, H), r(E, F, L), r(E, F, L), r(E, L, F),
         torch.ones(L).cuda(), r(H, L), r(F, H), r(F, H), r(H, F)]
    attrs = dict(top_k=k, renormalize=1, scaling=1.5, situ_beta=4.0, situ_linear_beta=25.0, eps=1e-5)
    (got,) = mcuda.moe(x, attrs)
    monkeypatch.setattr(mcuda, "_situ", lambda u, g, a, dt: mcuda._act(u.float(), g.float(), a["situ_beta"],
                                                                        a["situ_linear_beta"]).to(dt))
    monkeypatch.setattr(mcuda, "_route", lambda *args: None)
    monkeypatch.setattr(mtk, "sum_norm", lambda *args: None)
    monkeypatch.setattr(mtk, "layout", lambda *args: None)
    monkeypatch.setattr(mtk, "experts", lambda *args: None)  # the grouped GEMMs (27 rows take the experts kernels)
    (want,) = mcuda.moe(x, attrs)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


@kernels
@pytest.mark.parametrize(("N", "k", "E"), [(1, 8, 64), (32, 8, 64), (3, 2, 10), (150, 6, 384), (5, 1, 1),
                                           (128, 8, 1024), (1, 1, 3)])
def test_layout_equals_the_torch_sort(N, k, E):
    """The grouped GEMMs' row layout (order, expert, token, offs) equals the torch form's exactly: a stable sort, so
    rows of one expert keep token order; experts nobody picked get empty groups; row counts that are not powers of
    two, the 1024-row cap, 1024 experts and expert counts that are not powers of two."""
    gen = torch.Generator().manual_seed(N * 31 + E)
    flat = torch.randint(0, E, (N * k,), generator=gen)
    if E > 2:
        flat[flat == 1] = 2  # expert 1 empty, expert 2 crowded
    got = mtk.layout(flat.to(DEV), k, E)
    want = mcuda._layout(flat, k, E)  # CPU tensors: the torch form
    assert got is not None
    for name, g_, w_ in zip(("order", "expert", "token", "offs"), got, want):
        assert g_.dtype == w_.dtype and torch.equal(g_.cpu(), w_), name


def test_layout_declines_what_it_does_not_take():
    flat = torch.zeros(8, dtype=torch.int64)
    assert mtk.layout(flat.float(), 2, 4) is None
    assert mtk.layout(torch.zeros(mtk.MAX_LAYOUT_ROWS + 1, dtype=torch.int64), 1, 4) is None
    assert mtk.layout(flat, 2, mtk.MAX_EXPERTS + 1) is None
    if not INTERPRET:
        assert mtk.layout(flat, 2, 4) is None  # CPU tensors outside the interpreter: the torch form


def test_refusals_name_the_field():
    u = torch.zeros(4, 4)
    why = mtk.unsupported(u, u)
    if mtk.triton is None:
        assert why == "triton is not installed"
        return
    if not INTERPRET:
        assert "CUDA device" in why
        return
    assert "one shape" in mtk.unsupported(u, torch.zeros(4, 5))
    assert "u must be" in mtk.unsupported(u.to(torch.int32), u)
    assert "g must be contiguous" in mtk.unsupported(u, u.t())
    with pytest.raises(ValueError, match="beta must be positive"):
        mtk.situ(u, u, 0.0, 1.0, torch.float32)


def _route_torch(s, bias, k, renorm, scaling):
    idx = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    wk = s.gather(-1, idx)
    if renorm:
        wk = wk / wk.sum(-1, keepdim=True)
    return idx, wk * scaling


@kernels
@pytest.mark.parametrize("E,k,renorm", [(64, 8, True), (384, 8, True), (10, 3, False), (64, 1, True)])
def test_route_picks_the_torch_forms_experts_ties_included(E, k, renorm):
    gen = torch.Generator().manual_seed(E * 10 + k)
    N = 37
    s = torch.sigmoid(torch.randn(N, E, generator=gen) * 2)
    bias = (torch.randn(E, generator=gen) * 0.1).to(torch.bfloat16)
    s[0] = 0.5  # a row of ties: the lower experts win
    s[1, : E // 2] = s[1, E // 2:]  # pairs of equal choices where the bias is equal too
    bias[: E // 2] = bias[E // 2: 2 * (E // 2)]
    got = mtk.route(s.to(DEV), bias.to(DEV), k, renorm, 2.5)
    assert got is not None
    want = _route_torch(s, bias, k, renorm, 2.5)
    assert torch.equal(got[0].cpu(), want[0])
    assert float((got[1].cpu() - want[1]).abs().max()) <= 1e-6 * float(want[1].abs().max())


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,L", [(8, 1024), (3, 200)])
def test_sum_norm_matches_the_torch_form(dtype, k, L):
    gen = torch.Generator().manual_seed(k * L)
    N = 5
    r = torch.randn(N * k, L, generator=gen)
    w = (1 + 0.1 * torch.randn(L, generator=gen)).to(dtype)
    got = mtk.sum_norm(r.to(DEV), k, w.to(DEV), 1e-5, dtype)
    assert got is not None and got.dtype == dtype and got.shape == (N, L)
    want = mcuda._norm(r.reshape(N, k, L).sum(1), w, 1e-5)
    if dtype == torch.float32:
        assert float((got.cpu() - want).norm() / want.norm()) < 1e-6
    else:
        g = got.cpu().float()
        assert bool(((g - want).abs() <= want.abs() * ULP[dtype] * 1.001 + 1e-6 * want.abs().max()).all())


@kernels
def test_route_never_returns_an_expert_out_of_range():
    """Rows the torch sort still orders: all NaN (NaN first, lower expert first) and a -inf bias on all but two
    experts (the finite ones first, then the lowest -inf ones): k distinct ids in [0, E), as the torch form picks."""
    for E in (6, 8):
        s = torch.rand(3, E)
        s[0] = float("nan")
        bias = torch.zeros(E)
        got = mtk.route(s.to(DEV), bias.to(DEV), 3, False, 1.0)
        assert got is not None
        assert torch.equal(got[0].cpu()[0], torch.tensor([0, 1, 2]))
        bias[:] = float("-inf")
        bias[E - 1] = bias[2] = 0.0
        got = mtk.route(s.to(DEV), bias.to(DEV), 3, False, 1.0)
        want = _route_torch(s, bias, 3, False, 1.0)
        assert torch.equal(got[0].cpu()[1:], want[0][1:])
        assert bool((got[0].cpu() < E).all()) and bool((got[0].cpu() >= 0).all())


def test_route_and_sum_norm_decline_what_they_do_not_take():
    s = torch.rand(4, 8)
    assert mtk.route(s.double(), torch.zeros(8), 2, True, 1.0) is None
    assert mtk.route(s, torch.zeros(7), 2, True, 1.0) is None
    assert mtk.route(s, torch.zeros(8), 9, True, 1.0) is None
    assert mtk.sum_norm(torch.rand(7, 4), 2, torch.ones(4), 1e-5, torch.float32) is None  # 7 rows, k = 2
    assert mtk.sum_norm(torch.rand(8, 4), 2, torch.ones(5), 1e-5, torch.float32) is None


def _experts_case(N, k, E, L, I, dtype, seed, held=None, linear_beta=25.0):
    """Random routing of N tokens to k of E experts (some experts crowded, some empty), its torch layout, and the
    float64 result of the formula from the same (rounded) values: r [N * k, L] token-major."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=gen).to(dtype)
    w1, w3 = ((torch.randn(E, I, L, generator=gen) / L ** 0.5).to(dtype) for _ in range(2))
    w2 = (torch.randn(E, L, I, generator=gen) / I ** 0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    if E > 2:
        idx[idx == 1] = 0 if k == 1 else idx[idx == 1]  # expert 1 empty where k == 1
    wk = torch.rand(N, k, generator=gen)
    if held is not None:  # expert parallelism: experts held elsewhere weigh 0 (their index clamped to 0)
        wk = torch.where(idx < held, wk, 0.0)
        idx = torch.where(idx < held, idx, 0)
    order, expert, token, _ = mcuda._layout(idx.reshape(-1), k, E)
    z64, w164, w364, w264 = (t.double() for t in (z, w1, w3, w2))
    want = torch.empty(N * k, L, dtype=torch.float64)
    for j in range(N * k):
        e, t, dst = int(expert[j]), int(token[j]), int(order[j])
        act = mcuda._act(w364[e] @ z64[t], w164[e] @ z64[t], 4.0, linear_beta)
        want[dst] = float(wk.reshape(-1)[dst]) * (w264[e] @ act)
    return (z, token, expert, order, wk.reshape(-1).float(), w1, w3, w2), want


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("N", "k", "E", "L", "I", "held", "linear_beta"),
                         [(1, 8, 64, 1024, 768, None, 25.0), (8, 8, 64, 64, 48, None, 25.0),
                          (3, 2, 10, 200, 37, None, 0.0), (5, 3, 12, 96, 300, 8, 25.0), (2, 1, 3, 17, 16, None, 0.0)])
def test_experts_match_the_formula(N, k, E, L, I, held, linear_beta, dtype):
    """The small-batch experts kernels against the formula in float64 from the same values: products and the
    activation in fp32 (relative error < 1e-5 in either input dtype), every row at its token-major place, rows of
    experts held elsewhere zero; sizes that are not multiples of the blocks, the 64-row cap, one row per expert,
    crowded experts, the linear SiTU branch and the plain one (linear_beta 0), z with a row stride above its width."""
    args, want = _experts_case(N, k, E, L, I, dtype, seed=N * 1000 + E * 10 + L + I, held=held,
                               linear_beta=linear_beta)
    args = [t.to(DEV) for t in args]
    if N > 1:  # z as the columns of a wider matrix (rows of unit stride, a row stride of L + 8)
        args[0] = torch.cat([args[0], torch.full_like(args[0][:, :8], float("nan"))], 1)[:, :L]
    got = mtk.experts(*args, 4.0, linear_beta)
    assert got is not None and got.dtype == torch.float32 and got.shape == (N * k, L)
    got = got.cpu().double()
    assert float((got - want).norm() / want.norm()) < 1e-5
    if held is not None:
        zero = (args[4] == 0).cpu()  # wk on the device, got back on the host
        assert bool(zero.any()) and bool((got[zero] == 0).all())


def test_experts_decline_what_they_do_not_take():
    dev = DEV if mtk.triton is not None and (INTERPRET or torch.cuda.is_available()) else "cpu"
    args, _ = _experts_case(9, 8, 64, 32, 16, torch.float32, seed=1)  # 72 rows: over the cap
    assert mtk.experts(*(t.to(dev) for t in args), 4.0, 25.0) is None
    args, _ = _experts_case(4, 2, 4, 32, 16, torch.float32, seed=2)
    z, token, expert, order, wk, w1, w3, w2 = (t.to(dev) for t in args)
    if dev != "cpu" or INTERPRET:
        assert mtk.experts(z, token, expert, order, wk, w1, w3, w2, 4.0, 25.0) is not None  # the case it takes
    else:
        assert mtk.experts(z, token, expert, order, wk, w1, w3, w2, 4.0, 25.0) is None  # CPU tensors: torch form
    assert mtk.experts(z, token, expert, order, wk, w1, w3, w2.to(torch.bfloat16), 4.0, 25.0) is None  # dtypes
    assert mtk.experts(z, token, expert, order, wk, w1, w3, w2.transpose(1, 2).contiguous(), 4.0, 25.0) is None
    assert mtk.experts(z, token, expert, order, wk, w1, w3,
                       w2.transpose(1, 2).contiguous().transpose(1, 2), 4.0, 25.0) is None  # not contiguous
    strided = torch.stack([token, token], 1)[:, 0]  # int64 of the right length, every other element
    assert mtk.experts(z, strided, expert, order, wk, w1, w3, w2, 4.0, 25.0) is None
    assert mtk.experts(z, token, expert, order, wk.double(), w1, w3, w2, 4.0, 25.0) is None  # routing weights
    assert mtk.experts(z, token, expert, order, wk, w1, w3, w2, 0.0, 25.0) is None  # beta

