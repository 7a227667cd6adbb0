"""The cuda backend's fused KDA decode token (plugins/kda/cuda.py `decode_fused`: the projections, then the Triton
pre-kernel `kda_decode_prepare`, the decode step and the output norm-and-gate kernel) against the torch form it
replaces (`prepare` + the recurrence + the torch post-work), on fresh random inputs with a padding row (lengths 0:
its conv window and state must not move), float32 and bfloat16, head dims 32 and 16 (on the GPU a [D] vector with
D < 128 is replicated over the program's threads, so the window shift must not race; the interpreter runs threads in
sequence, so only the GPU run of these tests can show a race).

Kernel tests run on a CUDA GPU, or on CPU tensors under TRITON_INTERPRET=1, and skip cleanly otherwise. Tolerances:
float32 relative error (norm) < 1e-5 on every output and the new conv window equal exactly where both sides take the
same u (the whole-layer test: within 1e-6, u's GEMM rounds differently on cuBLAS and the CPU); bfloat16 the delta-rule
inputs within 1e-2 relative (norm), v and the conv window within one bf16 ulp, the layer output within 2e-2 (the
interpreter truncates casts to bf16, the GPU rounds). The refusal test runs everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from kimi_compile.plugins.kda import cuda as kcuda
from kimi_compile.plugins.kda import triton as ktk

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
kernels = pytest.mark.skipif(ktk.triton is None or not (INTERPRET or torch.cuda.is_available()),
                             reason="the Triton kernels need triton and a CUDA GPU (or TRITON_INTERPRET=1)")
ATTRS = {"scale": 0.17, "l2_eps": 0.3, "lower_bound": -5.0, "eps": 1e-5}  # an eps large enough to matter


def _layer(B, H, D, hidden, dt, gen, T=1, lengths=None):
    """kimi.KDA's 18 inputs for B rows of T tokens (lengths: valid tokens per row; default [1, 0, 1][:B] at T = 1)."""
    P = H * D
    r = lambda *s, k=1.0: (torch.randn(*s, generator=gen) * k).to(dt)
    h = r(B, T, hidden)
    conv_state = r(B, 3, 3 * P)
    state = torch.randn(B, H, D, D, generator=gen) * 0.3
    lengths = torch.tensor([1, 0, 1][:B] if lengths is None else lengths, dtype=torch.int64)
    ws = [r(hidden, P, k=hidden ** -0.5) for _ in range(3)]
    convs = [r(P, 1, 4, k=0.5) for _ in range(3)]
    lora = 8
    rest = [r(hidden, lora, k=hidden ** -0.5), r(lora, P, k=lora ** -0.5), r(hidden, H, k=hidden ** -0.5),
            r(hidden, P, k=hidden ** -0.5), torch.randn(H, generator=gen) * 0.5, torch.randn(P, generator=gen) * 0.5,
            1.0 + 0.1 * r(D), r(P, hidden, k=P ** -0.5)]
    return [h, conv_state, state, lengths, *ws, *convs, *rest]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _to(x, dev):
    return [t.to(dev) for t in x]


@kernels
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 16])
def test_decode_prepare_matches_the_torch_form(dt, D):
    gen = torch.Generator().manual_seed(D * 7 + (dt == torch.bfloat16))
    x = _layer(3, 4, D, 48, dt, gen)
    (h, cs, _, lengths, w_q, w_k, w_v, c_q, c_k, c_v, w_f_a, w_f_b, w_b, _, A_log, dt_bias, _, _) = x
    cs_ref = cs.clone()
    want = kcuda.prepare(h, cs_ref, lengths, w_q, w_k, w_v, c_q, c_k, c_v, w_f_a, w_f_b, w_b, A_log, dt_bias, ATTRS)
    u = h @ torch.cat([w_q, w_k, w_v], 1)
    f, b = (h @ w_f_a) @ w_f_b, h @ w_b
    cw = torch.cat([c_q, c_k, c_v], 0).reshape(-1, 4)
    dev = _to([u, cw, f, b, lengths, A_log, dt_bias], DEV)
    cs_dev = cs.clone().to(DEV)
    got = ktk.kda_decode_prepare(dev[0], cs_dev, *dev[1:], scale=ATTRS["scale"], l2_eps=ATTRS["l2_eps"],
                                 lower_bound=ATTRS["lower_bound"])
    names = ("q", "k", "v", "g", "beta")
    for name, g_, w_ in zip(names, got, want):
        w_ = w_.reshape(g_.shape)
        assert g_.dtype == (dt if name == "v" else torch.float32), name
        tol = 1e-5 if dt == torch.float32 else (2 ** -7 if name == "v" else 1e-2)
        assert _rel(g_.cpu(), w_) < tol, (name, _rel(g_.cpu(), w_))
    assert float(got[3][1].abs().max()) == 0 and float(got[4][1].abs().max()) == 0  # the padding row
    if dt == torch.float32:
        assert torch.equal(cs_dev.cpu(), cs_ref)
    else:
        assert _rel(cs_dev.cpu(), cs_ref) <= 2 ** -8
    assert torch.equal(cs_dev.cpu()[1], cs[1])  # the padding row's window did not move


@kernels
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_decode_fused_equals_the_torch_form(dt):
    gen = torch.Generator().manual_seed(11 + (dt == torch.bfloat16))
    x = _layer(3, 4, 32, 64, dt, gen)
    ref_x = [t.clone() for t in x]
    want, want_cs, want_state = kcuda.kda(ref_x, ATTRS)  # CPU tensors: the torch form
    dev_x = _to([t.clone() for t in x], DEV)
    out = kcuda.decode_fused(dev_x, ATTRS)
    assert out is not None, "decode_fused declined inputs it should take"
    got, got_cs, got_state = out
    assert got_cs is dev_x[1] and got_state is dev_x[2]  # in place, as the op's contract says
    tol = 1e-5 if dt == torch.float32 else 2e-2
    assert _rel(got.cpu(), want) < tol
    assert _rel(got_state.cpu(), want_state) < (1e-5 if dt == torch.float32 else 1e-2)
    assert torch.equal(got_state.cpu()[1], x[2][1])  # the padding row's state is untouched
    # the window holds u = h @ [w_q | w_k | w_v]: cuBLAS and the CPU round that GEMM differently (rel 7.2e-8 in fp32
    # on an H100); within the GEMM's rounding, not bit-equal
    assert _rel(got_cs.cpu(), want_cs) <= (1e-6 if dt == torch.float32 else 2 ** -8)


@kernels
def test_decode_prepare_takes_strided_small_inputs():
    """lengths, A_log and dt_bias as strided views (dt_bias [H, D] as the op's contract allows) give what their
    contiguous copies give (the kernel reads them as flat arrays)."""
    gen = torch.Generator().manual_seed(3)
    B, H, D = 3, 4, 32
    P = H * D
    u, f = torch.randn(B, 1, 3 * P, generator=gen), torch.randn(B, 1, P, generator=gen)
    b, cw = torch.randn(B, 1, H, generator=gen), torch.randn(3 * P, 4, generator=gen) * 0.5
    cs = torch.randn(B, 3, 3 * P, generator=gen)
    lengths = torch.tensor([1, 9, 0, 9, 1, 9])[::2]
    A_log = torch.randn(2 * H, generator=gen)[::2]
    dt_bias = torch.randn(D, H, generator=gen).t()
    kw = {"scale": 0.2, "l2_eps": 1e-6, "lower_bound": -5.0}
    cs1, cs2 = cs.clone().to(DEV), cs.clone().to(DEV)
    strided = ktk.kda_decode_prepare(*_to([u], DEV), cs1, *_to([cw, f, b, lengths, A_log, dt_bias], DEV), **kw)
    flat = ktk.kda_decode_prepare(*_to([u], DEV), cs2, *_to([cw, f, b, lengths.contiguous(), A_log.contiguous(),
                                                             dt_bias.contiguous()], DEV), **kw)
    for g_, w_ in zip(strided, flat):
        assert torch.equal(g_, w_)
    assert torch.equal(cs1, cs2)


@pytest.mark.skipif(not torch.cuda.is_available() or ktk.triton is None, reason="needs CUDA and triton")
def test_kda_kernel_on_the_gpu_takes_the_fused_decode(monkeypatch):
    """kimi.KDA's cuda kernel at T = 1 on CUDA tensors (the fused path) equals the same kernel on the torch form."""
    gen = torch.Generator().manual_seed(5)
    x = _to(_layer(3, 4, 128, 256, torch.bfloat16, gen), "cuda")
    calls = []
    real = kcuda.decode_fused
    monkeypatch.setattr(kcuda, "decode_fused", lambda x_, a_, *r: calls.append(1) or real(x_, a_, *r))
    fused_x = [t.clone() for t in x]
    got = kcuda.kda(fused_x, ATTRS)
    assert calls, "the fused decode was not taken"
    slot = torch.full_like(got[0], float("nan"))  # the executor's slot (Kernel.out): written, the same numbers
    into = kcuda.kda([t.clone() for t in x], ATTRS, out=(slot, None, None))
    assert into[0] is slot and torch.equal(slot, got[0])
    monkeypatch.setattr(kcuda, "decode_fused", lambda x_, a_, *r: None)
    torch_x = [t.clone() for t in x]
    want = kcuda.kda(torch_x, ATTRS)
    assert _rel(got[0].float(), want[0].float()) < 2e-2
    assert _rel(got[2], want[2]) < 1e-2
    assert _rel(got[1].float(), want[1].float()) <= 2 ** -8


def _prepare_refusals(check, T: int, P3: int, H: int, **extra) -> tuple | None:
    """The refusals both prepare kernels share (`_prepare_unsupported`), for `check` (a *_prepare_unsupported) on
    [2, T, P3] inputs of H heads; returns (u, the accepted inputs) for the caller's own cases, None where the checks
    cannot run here (no triton; no GPU and no interpreter: the device refusal is asserted)."""
    u = torch.zeros(2, T, P3)
    ok = {"conv_state": torch.zeros(2, 3, P3), "conv_w": torch.zeros(P3, 4), "f": torch.zeros(2, T, P3 // 3),
          "b": torch.zeros(2, T, H), "lengths": torch.ones(2, dtype=torch.int64), **extra}
    why = check(u, **ok)
    if ktk.triton is None:
        assert why == "triton is not installed"
        return None
    if not INTERPRET:
        assert "CUDA tensor" in why
        return None
    assert why is None
    assert "kernel size 4" in check(u, **{**ok, "conv_w": torch.zeros(P3, 3)})
    assert "conv_state" in check(u, **{**ok, "conv_state": torch.zeros(2, 2, P3)})
    assert "lengths" in check(u, **{**ok, "lengths": torch.ones(2)})
    return u, ok


def test_decode_prepare_refusals_name_the_field():
    P3, H = 3 * 4 * 32, 4
    checked = _prepare_refusals(ktk.decode_prepare_unsupported, 1, P3, H, A_log=torch.zeros(H),
                                dt_bias=torch.zeros(P3 // 3))
    if checked is None:
        return
    u, ok = checked
    assert "one decode token" in ktk.decode_prepare_unsupported(torch.zeros(2, 2, P3), **ok)
    assert "power of two" in ktk.decode_prepare_unsupported(torch.zeros(2, 1, 3 * 4 * 24), **{
        **ok, "conv_state": torch.zeros(2, 3, 3 * 4 * 24), "conv_w": torch.zeros(3 * 4 * 24, 4)})
    with pytest.raises(ValueError, match="kernel size 4"):
        ktk.kda_decode_prepare(u, ok["conv_state"], torch.zeros(P3, 3), ok["f"], ok["b"], ok["lengths"],
                               ok["A_log"], ok["dt_bias"], scale=1.0, l2_eps=1e-6, lower_bound=-5.0)
