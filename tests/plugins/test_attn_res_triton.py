"""The Triton kernels of kimi.AttnResMerge / kimi.AttnResStage1 (plugins/attn_res/triton.py) against the cuda
backend's torch forms (plugins/attn_res/cuda.py `merge`, `stage1`) and the numpy oracle, on fresh random inputs.

The kernel tests run on a CUDA GPU, or on CPU tensors under TRITON_INTERPRET=1 (Triton's interpreter), and skip
cleanly otherwise. Outputs are poisoned (NaN) before each run. Tolerances: float32 relative error (norm) < 1e-5 vs
the torch form and the oracle; bfloat16 outputs: every element within one bf16 ulp (2^-7 relative) of the torch
form's fp32 result (the GPU rounds to nearest; Triton's interpreter truncates float -> bf16 casts, so the bound is
one ulp, not half), and relative error (norm) < 1e-2 vs the fp64 oracle.
The refusal test runs everywhere (CPU tensors; triton need not be installed).
"""

from __future__ import annotations

import os

import pytest
import torch
from kimi_compile.plugins.attn_res import cuda as acuda
from kimi_compile.plugins.attn_res import reference as aref
from kimi_compile.plugins.attn_res import triton as atk

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
kernels = pytest.mark.skipif(atk.triton is None or not (INTERPRET or torch.cuda.is_available()),
                             reason="the Triton kernels need triton and a CUDA GPU (or TRITON_INTERPRET=1)")


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def one_bf16_ulp(got, want32):
    """Every element of the bf16 `got` within one bf16 ulp of the fp32 `want32`, plus 1e-6 of the largest |want32|
    (fp32 summation order where a sum cancels to near zero; no NaN)."""
    g, w = got.cpu().float(), want32.cpu().float()
    return bool(((g - w).abs() <= w.abs() * 2.0**-7 * 1.001 + 1e-6 * w.abs().max()).all())


def _merge_inputs(L, B, T, D, dtype, gen):
    """Stage-1 outputs of a random bank (so l1 >= 1 and m1 is a real max) and a partial whose score beats m1[slot]
    on its first row and loses on its last (the rows between: random)."""
    K = 3
    bank = torch.randn(K, B, T, D, generator=gen) * (0.5 + torch.rand(K, B, T, 1, generator=gen))
    o1, m1, l1 = acuda.stage1([bank, torch.randn(L, D, generator=gen)], {"eps": 1e-5})
    partial = (torch.randn(B, T, D, generator=gen) * (0.5 + torch.rand(B, T, 1, generator=gen))).to(dtype)
    query = torch.randn(D, generator=gen)
    rows = partial.view(-1, D)
    if rows.shape[0] > 1:
        rows[0] = (rows[0].float() * 0.2 + query).to(dtype)
        rows[-1] = (rows[-1].float() * 0.2 - query).to(dtype)
    query = (query * 2).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    return o1.to(dtype), m1, l1, partial, query, norm_w


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D, B, T, L, slot", [(96, 2, 3, 3, 2), (64, 1, 1, 2, 1), (2048, 3, 1, 4, 3),
                                              (7168, 2, 2, 2, 1), (1000, 1, 5, 1, 0)])
def test_merge_matches_torch_form(dtype, D, B, T, L, slot):
    gen = torch.Generator().manual_seed(D + 7 * B + T + slot)
    x = _merge_inputs(L, B, T, D, dtype, gen)
    a = {"slot": slot, "eps": 1e-5, "norm_eps": 1e-6}
    want = acuda.merge(list(x), a)[0]
    want32 = acuda.merge([t.float() for t in x], a)[0]
    _o1, m1, _l1, p, q, _w = x
    sp = (p.float() @ q.float()) * torch.rsqrt(p.float().pow(2).mean(-1) + a["eps"])
    wins = int((sp > m1[slot]).sum())
    if B * T > 1:
        assert 0 < wins < B * T, "both branches of max(m1, s_p) should be taken"
    out = torch.full((B, T, D), float("nan"), dtype=dtype, device=DEV)
    got = atk.attn_res_merge(*(t.to(DEV) for t in x), slot, a["eps"], a["norm_eps"], out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    assert not bool(torch.isnan(got.cpu()).any())
    oracle = torch.from_numpy(aref.attn_res_merge(*(t.double().numpy() for t in x), **a))
    if dtype == torch.float32:
        assert rel(got, want) < 1e-5
        assert rel(got, oracle) < 1e-5
    else:
        assert one_bf16_ulp(got, want32)
        assert rel(got, oracle) < 1e-2


@kernels
def test_merge_strided_views():
    """partial and the stats as non-contiguous views over B, T (unit stride on D): read through their strides."""
    gen = torch.Generator().manual_seed(11)
    o1, m1, l1, p, q, w = _merge_inputs(2, 4, 3, 96, torch.float32, gen)
    big = torch.randn(3, 4, 2, 96, generator=gen)
    big[:, :, 1] = p.transpose(0, 1)
    pv = big[:, :, 1].transpose(0, 1)  # [B, T, D], strides (2*96, 4*2*96, 1)
    assert not pv.is_contiguous()
    a = {"slot": 1, "eps": 1e-5, "norm_eps": 1e-5}
    want = acuda.merge([o1, m1, l1, p, q, w], a)[0]
    got = atk.attn_res_merge(*(t.to(DEV) for t in (o1, m1, l1, pv, q, w)), 1, 1e-5, 1e-5)
    assert rel(got, want) < 1e-5


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K, L, D, B, T", [(1, 1, 96, 1, 1), (3, 2, 96, 2, 3), (5, 3, 2048, 1, 2),
                                           (9, 4, 7168, 1, 1), (4, 16, 200, 2, 1)])
def test_stage1_matches_torch_form(dtype, K, L, D, B, T):
    gen = torch.Generator().manual_seed(K * 100 + L * 10 + D)
    bank = (torch.randn(K, B, T, D, generator=gen) * (0.5 + torch.rand(K, B, T, 1, generator=gen))).to(dtype)
    queries = (torch.randn(L, D, generator=gen) * 0.5).to(dtype)
    want = acuda.stage1([bank, queries], {"eps": 1e-5})
    want32 = acuda.stage1([bank.float(), queries.float()], {"eps": 1e-5})
    outs = (torch.full((L, B, T, D), float("nan"), dtype=dtype, device=DEV),
            torch.full((L, B, T), float("nan"), device=DEV), torch.full((L, B, T), float("nan"), device=DEV))
    got = atk.attn_res_stage1(bank.to(DEV), queries.to(DEV), 1e-5, out=outs)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, outs))
    oracle = [torch.from_numpy(r) for r in aref.attn_res_stage1(bank.double().numpy(), queries.double().numpy(), 1e-5)]
    for g, w, w32, o in zip(got, want, want32, oracle):
        assert g.dtype == w.dtype and not bool(torch.isnan(g.cpu()).any())
        if g.dtype == torch.float32:  # m1, l1 always; o1 for a float32 bank
            assert rel(g, w) < 1e-5
        else:
            assert one_bf16_ulp(g, w32)
        assert rel(g, o) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_refusals_name_the_field():
    """Refusals name the field, before any kernel runs (CPU tensors; triton need not be installed)."""
    o1, m1, l1 = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1), torch.rand(2, 1, 1) + 1
    p, q, w = torch.randn(1, 1, 8), torch.randn(8), torch.randn(8)
    assert "o1 must be [L, B=1, T=1, D=8]" in atk.unsupported_merge(o1[..., :4], m1, l1, p, q, w, 0)
    assert "m1 must be float32" in atk.unsupported_merge(o1, m1.double(), l1, p, q, w, 0)
    assert "query must be [D=8]" in atk.unsupported_merge(o1, m1, l1, p, q[:4], w, 0)
    assert "norm_weight must be" in atk.unsupported_merge(o1, m1, l1, p, q, w.long(), 0)
    assert "slot must be in [0, 2)" in atk.unsupported_merge(o1, m1, l1, p, q, w, 2)
    assert "unit stride on D" in atk.unsupported_merge(o1, m1, l1, torch.randn(1, 1, 16)[..., ::2], q, w, 0)
    with pytest.raises(ValueError, match="slot must be in"):
        atk.attn_res_merge(o1, m1, l1, p, q, w, 5, 1e-5, 1e-5)
    bank, qs = torch.randn(3, 1, 1, 8), torch.randn(2, 8)
    assert "queries must be [L, D=8]" in atk.unsupported_stage1(bank, qs[:, :4])
    assert "1..16 sources" in atk.unsupported_stage1(torch.randn(17, 1, 1, 8), qs)
    on_cpu = "CUDA device" in (atk.unsupported_merge(o1, m1, l1, p, q, w, 0) or "")
    assert on_cpu or INTERPRET or atk.triton is None  # the interpreter runs the kernels on CPU tensors
    assert (atk.unsupported_stage1(bank, qs) is None) == (INTERPRET and atk.triton is not None)


def test_cuda_table_prefers_the_triton_kernels():
    """On the GPU the Triton kernels are the default; the torch forms are their one fallback (and the CPU's)."""
    for op, name in (("AttnResMerge", "attn_res_merge"), ("AttnResStage1", "attn_res_stage1")):
        k = acuda.CUDA[op]
        assert (k.name, k.devices) == (f"triton.{name}", ("cuda",))
        assert (k.fallback.name, k.fallback.devices, k.fallback.fallback) == (f"torch.{name}", ("cuda", "cpu"), None)


@kernels
def test_backend_kernels_write_into_the_executors_slots():
    """The cuda backend's kernels (Kernel.out): given the outputs' planned slots they return those very tensors,
    written; a slot of another shape or dtype is declined (the kernel allocates and the executor copies)."""
    gen = torch.Generator().manual_seed(3)
    x = [t.to(DEV) for t in _merge_inputs(3, 2, 1, 96, torch.bfloat16, gen)]
    a = {"slot": 1, "eps": 1e-5, "norm_eps": 1e-6}
    slot = torch.full((2, 1, 96), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = acuda.merge_triton(x, a, out=(slot,))[0]
    assert got is slot and torch.equal(got, atk.attn_res_merge(*x, 1, 1e-5, 1e-6))
    other = torch.empty(2, 1, 96, device=DEV)  # float32: not the output's dtype
    assert acuda.merge_triton(x, a, out=(other,))[0] is not other
    bank = (torch.randn(4, 2, 1, 96, generator=gen)).to(DEV)
    queries = (torch.randn(3, 96, generator=gen) * 0.5).to(DEV)
    slots = (torch.full((3, 2, 1, 96), float("nan"), device=DEV), torch.full((3, 2, 1), float("nan"), device=DEV),
             torch.full((3, 2, 1), float("nan"), device=DEV))
    got = acuda.stage1_triton([bank, queries], {"eps": 1e-5}, out=slots)
    want = atk.attn_res_stage1(bank, queries, 1e-5)
    assert all(g is s and torch.equal(g, w) for g, s, w in zip(got, slots, want))
