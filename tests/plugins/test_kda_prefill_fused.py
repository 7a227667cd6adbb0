"""The cuda backend's fused KDA prefill (plugins/kda/cuda.py `prefill_fused`: the projections, the Triton pre-kernel
`kda_prefill_prepare`, the chunked core `kda_chunk` (fla-core's gate cumsum and intra kernels, then our fused chunk
recurrence), the output norm-and-gate kernel) against the torch form it replaces (`prepare` + the recurrence + the
torch post-work), on fresh random inputs with a carried conv window and rows of every kind: a full row, a row ending
mid-chunk, a row of two tokens (its new window takes a row of the old one) and a padding row (lengths 0: its window
and state must not move); T not a multiple of the kernel's 32-token spans and heads not a multiple of the kernel's
head block.

Kernel tests run on a CUDA GPU, or on CPU tensors under TRITON_INTERPRET=1, and skip cleanly otherwise; the whole-layer
test needs fla-core's gate and intra kernels, so a CUDA GPU (and the chunk-core test fla's chunk_kda). Tolerances:
float32 q, k, v, beta and the gate made from the masked f within 1e-5 relative (norm), f (masked in place: -inf on
padding rows, the rest untouched) and the new window equal exactly; bfloat16 q and k within 1e-2 (the kernel hands the
chunked core q and k in u's dtype, the torch form keeps them in float32 until then), v and the window within one bf16
ulp (the interpreter truncates casts to bf16, the GPU rounds). The layer (bfloat16): output and state within 2e-2 / 1e-2
of the torch form on the same GPU; in float32 the fused prefill declines (fla's dots would take the operands in TF32).
The refusal test runs everywhere.
"""

from __future__ import annotations

import pytest
import torch
from kimi_compile.plugins.kda import cuda as kcuda
from kimi_compile.plugins.kda import triton as ktk

from tests.plugins.test_kda_decode_fused import (
    ATTRS,
    DEV,
    INTERPRET,
    _layer,
    _prepare_refusals,
    _rel,
    _to,
    kernels,
)


@kernels
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D, H", [(32, 4), (16, 4), (32, 3)])
def test_prefill_prepare_matches_the_torch_form(dt, D, H):
    # T = 150: five spans of 32 tokens (the kernel's shortest, as the GPU's SM count gives these shapes), the last
    # partial; rows ending in the first and the fifth; 3 heads leave the fourth of the program's head block masked
    gen = torch.Generator().manual_seed(D * 5 + H + (dt == torch.bfloat16))
    B, T = 4, 150
    assert ktk._pre_shape(B, T, H, D, ktk.num_sms(DEV))[1] == 32
    x = _layer(B, H, D, 48, dt, gen, T, [T, 20, 2, 0])
    (h, cs, _, lengths, w_q, w_k, w_v, c_q, c_k, c_v, w_f_a, w_f_b, w_b, _, A_log, dt_bias, _, _) = x
    cs_ref = cs.clone()
    want = kcuda.prepare(h, cs_ref, lengths, w_q, w_k, w_v, c_q, c_k, c_v, w_f_a, w_f_b, w_b, A_log, dt_bias, ATTRS)
    u = h @ torch.cat([w_q, w_k, w_v], 1)
    f, b = (h @ w_f_a) @ w_f_b, h @ w_b
    cw = torch.cat([c_q, c_k, c_v], 0).reshape(-1, 4)
    cs_dev, f_dev = cs.clone().to(DEV), f.clone().to(DEV)
    got = ktk.kda_prefill_prepare(*_to([u], DEV), cs_dev, *_to([cw], DEV), f_dev, *_to([b, lengths], DEV),
                                  scale=ATTRS["scale"], l2_eps=ATTRS["l2_eps"])
    assert got[3].data_ptr() == f_dev.data_ptr()  # f masked in place
    q, k, v, fm, beta = (t.cpu() for t in got)
    assert q.dtype == k.dtype == v.dtype == dt and fm.dtype == dt and beta.dtype == torch.float32
    for name, g_, w_ in (("q", q, want[0]), ("k", k, want[1]), ("v", v, want[2]), ("beta", beta, want[4])):
        tol = 1e-5 if dt == torch.float32 else (2 ** -7 if name in ("v", "beta") else 1e-2)
        assert _rel(g_.float(), w_.float()) < tol, (name, _rel(g_.float(), w_.float()))
    valid = (torch.arange(T).reshape(1, T) < lengths.reshape(B, 1)).reshape(B, T, 1, 1)
    assert torch.equal(fm, torch.where(valid, f.reshape(B, T, H, D), float("-inf")))
    # the gate chunk_kda makes from the masked f (the torch form's formula): 0 on padding rows, as the torch form's
    g = ATTRS["lower_bound"] * torch.sigmoid(torch.exp(A_log.float()).reshape(H, 1)
                                             * (fm.float() + dt_bias.float().reshape(H, D)))
    assert _rel(g, want[3]) < (1e-5 if dt == torch.float32 else 1e-2)
    assert float(g[3].abs().max()) == 0 and float(g[1, 20:].abs().max()) == 0 and float(beta[3].abs().max()) == 0
    if dt == torch.float32:
        assert torch.equal(cs_dev.cpu(), cs_ref)
    else:
        assert _rel(cs_dev.cpu(), cs_ref) <= 2 ** -8
    assert torch.equal(cs_dev.cpu()[3], cs[3])  # the padding row's window did not move


@pytest.mark.skipif(not torch.cuda.is_available() or ktk.triton is None, reason="needs CUDA and triton")
def test_kda_kernel_on_the_gpu_declines_the_fused_prefill_in_float32():
    """float32 activations never reach fla's chunk_kda (its dots take float32 operands in TF32: plugins/kda/cuda.py
    `fla_chunk_applies`): the fused prefill declines and kimi.KDA runs the torch chunked form."""
    gen = torch.Generator().manual_seed(7)
    x = _to(_layer(4, 4, 128, 256, torch.float32, gen, 150, [150, 77, 2, 0]), "cuda")
    assert not kcuda.fla_chunk_applies(torch.float32) and kcuda.fla_chunk_applies(torch.bfloat16)
    assert kcuda.prefill_fused([t.clone() for t in x], ATTRS) is None


@pytest.mark.skipif(not torch.cuda.is_available() or ktk.triton is None, reason="needs CUDA and triton")
def test_kda_kernel_on_the_gpu_takes_the_fused_prefill(monkeypatch):
    """kimi.KDA's cuda kernel at T > 1 on bf16 CUDA tensors (the fused path) equals the same kernel on the torch
    form."""
    pytest.importorskip("fla", reason="the fused prefill runs fla-core's gate and intra kernels")
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(8)
    T = 150
    x = _to(_layer(4, 4, 128, 256, dt, gen, T, [T, 77, 2, 0]), "cuda")
    calls = []
    real = kcuda.prefill_fused
    monkeypatch.setattr(kcuda, "prefill_fused", lambda x_, a_, *r: calls.append(1) or real(x_, a_, *r))
    fused_x = [t.clone() for t in x]
    got = kcuda.kda(fused_x, ATTRS)
    assert calls and got is not None, "the fused prefill was not taken"
    assert got[1] is fused_x[1] and got[2] is fused_x[2]  # in place, as the op's contract says
    monkeypatch.setattr(kcuda, "prefill_fused", lambda x_, a_, *r: None)
    torch_x = [t.clone() for t in x]
    want = kcuda.kda(torch_x, ATTRS)
    assert _rel(got[0].float(), want[0].float()) < 2e-2
    assert _rel(got[2], want[2]) < 1e-2
    assert _rel(got[1].float(), want[1].float()) <= 2 ** -8
    assert torch.equal(got[2][3], x[2][3]) and torch.equal(got[1][3], x[1][3])  # the padding row


def test_prefill_prepare_refusals_name_the_field():
    P3, H, T = 3 * 4 * 32, 4, 5
    checked = _prepare_refusals(ktk.prefill_prepare_unsupported, T, P3, H)
    if checked is None:
        return
    u, ok = checked
    assert "f must be" in ktk.prefill_prepare_unsupported(u, **{**ok, "f": torch.zeros(2, T + 1, P3 // 3)})
    assert "power of two" in ktk.prefill_prepare_unsupported(torch.zeros(2, T, 3 * 4 * 24), **{
        **ok, "conv_state": torch.zeros(2, 3, 3 * 4 * 24), "conv_w": torch.zeros(3 * 4 * 24, 4),
        "f": torch.zeros(2, T, 4 * 24)})
    with pytest.raises(ValueError, match="kernel size 4"):
        ktk.kda_prefill_prepare(u, ok["conv_state"], torch.zeros(P3, 3), ok["f"], ok["b"], ok["lengths"], scale=1.0,
                                l2_eps=1e-6)
    # 70000 tokens of 96 heads x 128: offsets past int32 in the kernel's rows (meta tensors: shapes only)
    Tl, Pl, Hl = 70000, 96 * 128, 96
    big = {"conv_state": torch.empty(1, 3, 3 * Pl, device="meta"), "conv_w": torch.empty(3 * Pl, 4, device="meta"),
           "f": torch.empty(1, Tl, Pl, device="meta"), "b": torch.empty(1, Tl, Hl, device="meta"),
           "lengths": torch.ones(1, dtype=torch.int64)}
    assert "2^31" in ktk.prefill_prepare_unsupported(torch.empty(1, Tl, 3 * Pl, device="meta"), **big)


def _chunk_recurrence_ref(qg, kg, w, u, g, A, S, scale, BT=64):
    """kda_chunk_state_out's recurrence in float32 torch, rounding where the kernel (and fla's two kernels) round:
    the state to u's dtype for the dots, v_new to u's dtype."""
    B, T, H, K = qg.shape
    S = S.clone()

    def rnd(x):  # to u's dtype and back: Triton's interpreter truncates to bf16 where the GPU rounds
        if INTERPRET and u.dtype == torch.bfloat16:
            return (x.float().view(torch.int32) & -65536).view(torch.float32)
        return x.to(u.dtype).float()

    o = torch.empty(u.shape, dtype=torch.float32)
    tril = torch.ones(BT, BT).tril().bool()
    for c in range(0, T, BT):
        sl = slice(c, min(c + BT, T))
        n = sl.stop - sl.start
        sb = rnd(S)  # [B, H, K, V]
        vn = rnd(u[:, sl].float() - torch.einsum("btkh,bhkv->bthv", w[:, sl].float().transpose(2, 3), sb))
        a = torch.where(tril[:n, :n], A[:, sl, :, :n].float().permute(0, 2, 1, 3), 0.0)  # [B, H, n, n]
        o[:, sl] = (torch.einsum("bthk,bhkv->bthv", qg[:, sl].float(), sb) * scale
                    + torch.einsum("bhts,bshv->bthv", a, vn))
        S = S * torch.exp2(g[:, sl.stop - 1])[..., None] + torch.einsum("bthk,bthv->bhkv", kg[:, sl].float(), vn)
    return rnd(o), S


@kernels
@pytest.mark.parametrize("T", [150, 64])
@pytest.mark.parametrize("shape", [*ktk.STATE_SHAPES, None], ids=lambda s: f"bv{s[0]}" if s else "d16")
def test_chunk_state_out_matches_the_recurrence(T, shape, monkeypatch):
    """The fused state/output recurrence of the chunked prefill (ours in place of fla's per-chunk states + output
    kernels) against the same recurrence in torch, bf16 inputs as fla's intra kernels give them: T = 150 is three
    chunks (the last partial), 64 one; V = 128 in slices of each program shape the launch may pick, and head dims of
    16 (no shape's slice divides V: the whole value dim); a nonzero initial state updated in place.
    The reference rounds where the kernel rounds (truncating under the interpreter, as it does); output within 5e-3
    relative, state 1e-3 (measured in the interpreter: 9.3e-5 and 2.2e-5 at T = 150)."""
    if shape is not None:
        monkeypatch.setattr(ktk, "STATE_SHAPES", (shape,))
    gen = torch.Generator().manual_seed(T)
    B, H, K, V, dt = (2, 3, 32, 128, torch.bfloat16) if shape else (2, 3, 16, 16, torch.bfloat16)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=gen) * sc)  # noqa: E731
    qg, kg, w = (r(B, T, H, K, sc=0.3).to(dt) for _ in range(3))
    u = r(B, T, H, V).to(dt)
    g = torch.cumsum(-torch.rand(B, T, H, K, generator=gen) * 0.2, 1)  # decreasing log2 gates, as a chunk cumsum
    for c in range(64, T, 64):  # chunk-local: restart at each chunk
        g[:, c:] -= g[:, c - 1:c].clone()
    A = r(B, T, H, 64, sc=0.2).to(dt)
    S0 = r(B, H, K, V)
    want_o, want_S = _chunk_recurrence_ref(qg, kg, w, u, g, A, S0, 0.7)
    S = S0.clone().to(DEV)
    o = ktk.kda_chunk_state_out(*_to([qg, kg, w, u, g, A], DEV), S, scale=0.7)
    assert o.dtype == dt and o.shape == u.shape
    assert _rel(o.cpu().float(), want_o) < 5e-3, _rel(o.cpu().float(), want_o)
    assert _rel(S.cpu(), want_S) < 1e-3, _rel(S.cpu(), want_S)
    assert _rel(S.cpu(), S0) > 0.1  # the state moved (in place)


@pytest.mark.skipif(not torch.cuda.is_available() or ktk.triton is None, reason="needs CUDA and triton")
@pytest.mark.parametrize("B, T, H", [(1, 1000, 4), (3, 200, 2), (1, 64 * 40, 96)])
def test_kda_chunk_matches_fla_chunk_kda_on_the_gpu(B, T, H):
    """`kda_chunk` (fla's gate cumsum and intra kernels, then our fused state/output recurrence) against fla-core's
    chunk_kda on the same prepared bf16 inputs and initial state: the same arithmetic but for the per-chunk states'
    round trip through memory (bf16 in both) and fp32 summation order. Output within 2e-3 relative, state 1e-3; the
    state updated in place. 4, 6 and 96 (sequence, head) pairs take the 32-, 32- and 128-column program shapes."""
    pytest.importorskip("fla", reason="the reference is fla-core's chunk_kda")
    from fla.ops.kda import chunk_kda

    gen = torch.Generator(device="cuda").manual_seed(B * T + H)
    D, dt = 128, torch.bfloat16
    rn = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(rn(B, T, H, D), dim=-1).mul(D ** -0.5).to(dt)
    k = torch.nn.functional.normalize(rn(B, T, H, D), dim=-1).to(dt)
    v, f = rn(B, T, H, D).to(dt), rn(B, T, H, D).to(dt)
    beta = torch.sigmoid(rn(B, T, H))
    A_log, dt_bias = rn(H) * 0.5, rn(H * D) * 0.5
    S0 = rn(B, H, D, D) * 0.1
    want_o, want_S = chunk_kda(q, k, v, f, beta, scale=1.0, initial_state=S0.clone(), output_final_state=True,
                               use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A_log,
                               dt_bias=dt_bias)
    S = S0.clone()
    o = ktk.kda_chunk(q, k, v, f, beta, A_log, dt_bias, S, scale=1.0, lower_bound=-5.0)
    assert o.dtype == dt and o.shape == v.shape
    assert _rel(o.float(), want_o.float()) < 2e-3, _rel(o.float(), want_o.float())
    assert _rel(S, want_S) < 1e-3, _rel(S, want_S)


def test_chunk_state_out_refusals_name_the_field():
    """Malformed inputs are refused before any launch, naming the field (runs everywhere: meta tensors)."""
    B, T, H, K, V = 2, 70, 3, 32, 64
    m = lambda *s, dt=torch.bfloat16: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    ok = {"qg": m(B, T, H, K), "kg": m(B, T, H, K), "w": m(B, T, H, K), "u": m(B, T, H, V),
          "g": m(B, T, H, K, dt=torch.float32), "Aqk": m(B, T, H, 64), "state": m(B, H, K, V, dt=torch.float32)}
    for field, bad, msg in (("kg", m(B, T, H, K + 1), "kg must be"), ("u", m(B, T + 1, H, V), "u must be"),
                            ("g", m(B, T, H, 16, dt=torch.float32), "g must be"),
                            ("state", m(B, H, K, V), "state must be fp32"), ("Aqk", m(B, T, H, 32), "Aqk must be"),
                            ("qg", None, "powers of two >= 16")):
        args = {**ok, field: bad}
        if field == "qg":  # every [B, T, H, K] input follows qg's K: 24 everywhere reaches the head-dim check
            args = {**ok, **{n: m(B, T, H, 24) for n in ("qg", "kg", "w")}, "g": m(B, T, H, 24, dt=torch.float32),
                    "state": m(B, H, 24, V, dt=torch.float32)}
        with pytest.raises(ValueError, match=msg):
            ktk.kda_chunk_state_out(args.pop("qg"), args.pop("kg"), args.pop("w"), args.pop("u"), args.pop("g"),
                                    args.pop("Aqk"), args.pop("state"), scale=1.0)
