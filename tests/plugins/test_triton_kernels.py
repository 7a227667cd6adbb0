"""GPU kernel tests: Triton kernels vs the float64/float32 torch references on fresh random inputs (never zeros).

Skips cleanly without triton or CUDA. Outputs are poisoned (NaN / sentinel) before each run; indices are compared as
sets up to ties (torch_ref.check_topk); bf16 outputs need ||out - ref|| / ||ref|| < 1e-2; FP8 codes must equal the
reference bytes (same exact rounding rule) on at least 99.99% of elements (conversion ties aside, none expected).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("Triton kernel tests need a CUDA GPU", allow_module_level=True)

try:
    from kimi_compile.plugins.indexer_topk import torch_ref as iref
    from kimi_compile.plugins.indexer_topk import triton as itk
    from kimi_compile.plugins.kda import torch_ref as kref
    from kimi_compile.plugins.kda import triton as ktk
    from kimi_compile.plugins.quant import triton as qtk
    from kimi_compile.plugins.sparse_mla import torch_ref as mref
    from kimi_compile.plugins.sparse_mla import triton as mtk
except ImportError:  # running from a plain checkout
    from plugins.indexer_topk import torch_ref as iref
    from plugins.indexer_topk import triton as itk
    from plugins.kda import torch_ref as kref
    from plugins.kda import triton as ktk
    from plugins.quant import triton as qtk
    from plugins.sparse_mla import torch_ref as mref
    from plugins.sparse_mla import triton as mtk

DEV = "cuda"


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _paged(n_tokens_per_seq, bs, gen):
    """Random block table: each sequence gets its own shuffled physical blocks."""
    nblk = [(n + bs - 1) // bs for n in n_tokens_per_seq]
    total = sum(nblk) + 3
    perm = torch.randperm(total, generator=gen)
    mb = max(nblk)
    bt = torch.zeros(len(nblk), mb, dtype=torch.int32)
    o = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[o:o + n].int()
        o += n
    return bt, total


def _index_cache(lens, bs, gen, rounding="floor"):
    bt, nb = _paged(lens, bs, gen)
    codes = torch.randint(0, 255, (nb, bs, 128), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 255, (nb, bs, 4), dtype=torch.uint8, generator=gen)
    for b, n in enumerate(lens):
        k = torch.randn(n, 128, generator=gen) * (1 + torch.rand(n, 1, generator=gen))
        slots = (bt[b].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs)
        iref.write_index_cache_ref(k, slots, codes, scales, rounding)
    return codes, scales, bt


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_mxfp8_quantize_to_cache(rounding):
    gen = torch.Generator().manual_seed(1)
    N, nb, bs = 1000, 40, 64
    x = (torch.randn(N, 128, generator=gen) * torch.exp(torch.randn(N, 1, generator=gen) * 3)).bfloat16()
    x[5, :32] = 0  # an all-zero block
    slots = torch.randperm(nb * bs, generator=gen)[:N]
    slots[7] = -1
    codes = torch.full((nb, bs, 128), 0xAB, dtype=torch.uint8, device=DEV)
    scales = torch.full((nb, bs, 4), 0xAB, dtype=torch.uint8, device=DEV)
    qtk.mxfp8_quantize_to_cache(x.to(DEV), slots.to(DEV), codes, scales, rounding)
    rc, rs = iref.mxfp8_quantize_ref(x.float(), rounding)
    keep = slots >= 0
    gc = codes.view(-1, 128).cpu()[slots[keep]]
    gs = scales.view(-1, 4).cpu()[slots[keep]]
    assert torch.equal(gs, rs[keep])
    assert (gc == rc[keep]).float().mean() >= 0.9999
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[keep]] = True
    assert bool((codes.view(-1, 128).cpu()[~written] == 0xAB).all())  # slot -1 and unused slots untouched
    try:  # the project's quant oracle (needs ml_dtypes)
        from kimi_compile.plugins.quant.reference import mx_quantize_torch
    except ImportError:
        try:
            from plugins.quant.reference import mx_quantize_torch
        except ImportError:
            return
    oc, os_ = mx_quantize_torch(x.float(), rounding=rounding)
    assert torch.equal(os_[keep], gs) and (oc[keep] == gc).float().mean() >= 0.9999


def test_mla_fp8_quantize_to_cache():
    gen = torch.Generator().manual_seed(2)
    N, nb, bs = 700, 20, 64
    c = (torch.randn(N, 512, generator=gen) * torch.exp(torch.randn(N, 4, 1, generator=gen)).repeat_interleave(128, 1)
         .reshape(N, 512)).bfloat16()
    pe = torch.randn(N, 64, generator=gen).bfloat16()
    slots = torch.randperm(nb * bs, generator=gen)[:N]
    cache = torch.full((nb, bs, 656), 0xCD, dtype=torch.uint8, device=DEV)
    qtk.mla_fp8_quantize_to_cache(c.to(DEV), pe.to(DEV), slots.to(DEV), cache)
    ref = mref.mla_fp8_quantize_ref(c, pe)
    got = cache.view(-1, 656).cpu()[slots]
    assert torch.equal(got[:, 512:], ref[:, 512:])
    assert (got[:, :512] == ref[:, :512]).float().mean() >= 0.9999


@pytest.mark.parametrize("impl,tma,kw", [("v1", None, {}), ("v2", None, {}), ("v3", True, {}), ("v3", False, {}),
                                         ("v3", True, {"pair": 2}), ("v3", False, {"pair": 2, "prefetch_bt": False}),
                                         ("v4", None, {}), ("v4", None, {"num_stages": 2}),
                                         ("v4", None, {"num_stages": 4, "progs_per_sm": 1}),
                                         ("v4", None, {"maxnreg": 96, "progs_per_sm": 5}),
                                         ("v4", None, {"kperm": False}),
                                         ("v4", None, {"kperm": False, "scale_tma": False, "num_stages": 3})])
@pytest.mark.parametrize("bs", [64, 32])
def test_indexer_topk_decode(bs, impl, tma, kw):
    gen = torch.Generator().manual_seed(3)
    lens = [5000, 1500, 2048, 9000, 1]
    topk = 2048
    codes, scales, bt = _index_cache(lens, bs, gen)
    B = len(lens)
    q = torch.randn(B, 64, 128, generator=gen).bfloat16()
    w = torch.randn(B, 64, generator=gen) * 0.1
    cl = torch.tensor(lens, dtype=torch.int32)
    for _ in range(2):  # twice: the self-cleaning workspace must be reusable
        oi = torch.full((B, topk), -7, dtype=torch.int32, device=DEV)
        os_ = torch.full((B, topk), float("nan"), device=DEV)
        itk.indexer_topk_decode(q.to(DEV), w.to(DEV), codes.to(DEV), scales.to(DEV), bt.to(DEV), cl.to(DEV), topk,
                                out=(oi, os_), impl=impl, tma=tma, **kw)
        torch.cuda.synchronize()
        _, _, full = iref.indexer_topk_decode_ref(q, w, codes, scales, bt, cl, topk, return_all_scores=True)
        res = iref.check_topk(oi, os_, full, lens, topk)
        assert res["ok"], res


@pytest.mark.parametrize("impl", ["v2", "v3", "v4"])
@pytest.mark.parametrize("lens,topk", [([70000, 65536], 2048), ([131072], 2048), ([3000, 200, 9000], 512),
                                       ([40000, 9000], 8192), ([300000], 256)])
def test_indexer_topk_decode_long(lens, topk, impl):
    """Threshold selects on long rows (register and memory paths: > 4096 candidates, > 4096 group maxima),
    random (non-zero) cache."""
    gen = torch.Generator().manual_seed(11)
    bs = 64
    bt, nb = _paged(lens, bs, gen)
    codes = torch.randint(0, 255, (nb, bs, 128), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 255, (nb, bs, 4), dtype=torch.uint8, generator=gen)
    k = torch.randn(nb * bs, 128, generator=gen)
    iref.write_index_cache_ref(k, torch.arange(nb * bs), codes, scales)
    B = len(lens)
    q = torch.randn(B, 64, 128, generator=gen).bfloat16()
    w = torch.randn(B, 64, generator=gen) * 0.1
    cl = torch.tensor(lens, dtype=torch.int32)
    oi = torch.full((B, topk), -7, dtype=torch.int32, device=DEV)
    os_ = torch.full((B, topk), float("nan"), device=DEV)
    for _ in range(2):
        itk.indexer_topk_decode(q.to(DEV), w.to(DEV), codes.to(DEV), scales.to(DEV), bt.to(DEV), cl.to(DEV), topk,
                                out=(oi, os_), impl=impl)
    torch.cuda.synchronize()
    _, _, full = iref.indexer_topk_decode_ref(q, w, codes, scales, bt, cl, topk, return_all_scores=True)
    res = iref.check_topk(oi, os_, full, lens, topk)
    assert res["ok"], res


def _onnx_reference():
    import importlib
    return importlib.import_module(itk.__name__.rsplit(".", 1)[0]).reference


@pytest.mark.parametrize("zero_w", [False, True])
def test_indexer_topk_onnx_contract(zero_w):
    """indexer_topk_decode_onnx_contract vs kimi.IndexerTopK's numpy reference (on the dequantized pool):
    int64, -1 / -1e30 padding, sorted by score desc then position asc (ties exactly when w = 0)."""
    reference = _onnx_reference()
    gen = torch.Generator().manual_seed(12)
    bs, topk = 64, 256
    lens = [1000, 100, 700]
    codes, scales, bt = _index_cache(lens, bs, gen)
    B = len(lens)
    q = torch.randn(B, 1, 64, 128, generator=gen).bfloat16()
    w = torch.zeros(B, 1, 64) if zero_w else torch.randn(B, 1, 64, generator=gen) * 0.1
    start = torch.tensor([n - 1 for n in lens])  # decode: the new token is the last cached one
    length = torch.ones(B, dtype=torch.int64)
    pool = iref.mxfp8_dequantize_ref(codes, scales).numpy()
    ri, rs = reference(q.float().numpy(), w.numpy(), pool, bt.long().numpy(), start.numpy(), length.numpy(), topk)
    gi, gs = itk.indexer_topk_decode_onnx_contract(q.to(DEV), w.to(DEV), codes.to(DEV), scales.to(DEV), bt.to(DEV),
                                                   start.to(DEV), length.to(DEV), topk)
    gi, gs = gi.cpu(), gs.cpu()
    assert gi.dtype == torch.int64 and gi.shape == (B, 1, topk) and gs.shape == (B, 1, topk)
    ri, rs = torch.from_numpy(ri), torch.from_numpy(rs)
    assert torch.equal(gi < 0, ri < 0)
    assert bool((gs[gi < 0] == -1e30).all())
    if zero_w:
        assert torch.equal(gi, ri)  # all scores tie: positions ascending
        return
    for b in range(B):
        n = int((ri[b, 0] >= 0).sum())
        tol = 1e-3 * float(rs[b, 0, :n].abs().max())
        full = torch.full((lens[b],), float("nan"), dtype=torch.float64)
        full[ri[b, 0, :n]] = rs[b, 0, :n].double()
        # slot by slot the reference score of our index equals the reference's (up to near-ties)
        d = torch.from_numpy(reference(q[b:b + 1].float().numpy(), w[b:b + 1].numpy(), pool,
                                       bt[b:b + 1].long().numpy(), start[b:b + 1].numpy(), length[b:b + 1].numpy(),
                                       lens[b])[1])[0, 0].double()
        allref = torch.empty(lens[b], dtype=torch.float64)
        allref[torch.from_numpy(reference(q[b:b + 1].float().numpy(), w[b:b + 1].numpy(), pool,
                                          bt[b:b + 1].long().numpy(), start[b:b + 1].numpy(),
                                          length[b:b + 1].numpy(), lens[b])[0])[0, 0]] = d
        assert float((allref[gi[b, 0, :n]] - rs[b, 0, :n].double()).abs().max()) <= tol
        assert bool((gs[b, 0, 1:n] <= gs[b, 0, :n - 1]).all())


@pytest.mark.parametrize("impl", ["v2", "v3", "v4"])
def test_indexer_topk_ties(impl):
    """Many exactly equal scores (w = 0 for all heads but a constant key): ties resolved to exactly k slots."""
    gen = torch.Generator().manual_seed(4)
    lens = [3000]
    codes, scales, bt = _index_cache(lens, 64, gen)
    q = torch.randn(1, 64, 128, generator=gen).bfloat16()
    w = torch.zeros(1, 64)  # every score is exactly 0
    oi, os_ = itk.indexer_topk_decode(q.to(DEV), w.to(DEV), codes.to(DEV), scales.to(DEV), bt.to(DEV),
                                      torch.tensor(lens, dtype=torch.int32, device=DEV), 2048, impl=impl)
    sel = oi.cpu()[0]
    assert sel.unique().numel() == 2048 and int(sel.min()) >= 0 and int(sel.max()) < 3000
    assert bool((os_.cpu() == 0).all())


def test_indexer_v4_runs_on_hopper():
    """v4 falls back to v3 where Gluon / TMA / 64-key pages are missing; on Hopper+ it must not fall back."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("v4 needs Hopper+")
    codes = torch.zeros(4, 64, 128, dtype=torch.uint8, device=DEV)
    assert itk._v4_ok(codes)
    with pytest.raises(ValueError, match="unknown keyword"):
        itk.indexer_topk_decode(torch.zeros(1, 64, 128, dtype=torch.bfloat16, device=DEV),
                                torch.zeros(1, 64, device=DEV), codes, torch.zeros(4, 64, 4, dtype=torch.uint8,
                                                                                    device=DEV),
                                torch.zeros(1, 4, dtype=torch.int32, device=DEV),
                                torch.ones(1, dtype=torch.int32, device=DEV), 16, impl="v4", pair=2)


@pytest.mark.parametrize("impl", ["v3", "v4"])
def test_indexer_topk_prefill(impl):
    gen = torch.Generator().manual_seed(5)
    start, T, topk = 600, 96, 256
    codes, scales, bt = _index_cache([start + T], 64, gen)
    q = torch.randn(T, 64, 128, generator=gen).bfloat16()
    w = torch.rand(T, 64, generator=gen) * 0.1
    oi, os_ = itk.indexer_topk_prefill(q.to(DEV), w.to(DEV), codes.to(DEV), scales.to(DEV), bt[0].to(DEV), start, topk,
                                       impl=impl)
    _, _, full = iref.indexer_topk_prefill_ref(q, w, codes, scales, bt[0], start, topk, return_all_scores=True)
    res = iref.check_topk(oi, os_, full, [start + t + 1 for t in range(T)], topk)
    assert res["ok"], res


def _mla_cache(lens, bs, gen):
    bt, nb = _paged(lens, bs, gen)
    cache = torch.randint(0, 255, (nb, bs, 656), dtype=torch.uint8, generator=gen)
    for b, n in enumerate(lens):
        c = torch.randn(n, 512, generator=gen) * (0.5 + torch.rand(n, 1, generator=gen))
        pe = torch.randn(n, 64, generator=gen)
        slots = bt[b].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        mref.write_mla_cache_ref(c, pe, slots, cache)
    return cache, bt


@pytest.mark.parametrize("impl,nsplit,nacc,v4", [
    ("v1", None, 4, {}), ("v1", 1, 4, {}), ("v1", 3, 2, {}), ("v2", None, 4, {}), ("v2", 1, 4, {}), ("v3", None, 4, {}),
    ("v3", 1, 4, {}), ("v3", 7, 4, {}),
    ("v4", None, 2, {"bh": 64, "fused": True}), ("v4", 1, 4, {"bh": 64}), ("v4", 3, 1, {"bh": 32, "fused": False}),
    ("v4", 5, 4, {"bh": 64, "fused": True, "qloop": True}), ("v4", 16, 1, {"bh": 16, "fused": True}),
    ("v4", 7, 2, {"bh": 32, "fused": True, "qloop": True}),
    ("v5", None, None, {}), ("v5", 1, None, {"tn": 64, "bh": 64, "warps1": 4}),
    ("v5", 3, None, {"bh2": 128, "warps2": 8}), ("v5", 5, None, {"tn": 32, "bh2": 128}),
    ("v5", None, None, {"tn": 64, "bh": 128, "warps1": 8, "ns1": 0, "maxnreg1": 128, "bk": 128, "num_stages": 3}),
    ("v5", 3, None, {"tn": 32, "ns1": -1, "bk": 128, "num_stages": 0}),
    ("v5", None, None, {"rows_per_launch": 2})])
def test_sparse_mla_decode(impl, nsplit, nacc, v4):
    gen = torch.Generator().manual_seed(6)
    lens, topk, H = [3000, 2500, 100], 2048, 128
    cache, bt = _mla_cache(lens, 64, gen)
    B = len(lens)
    idx = torch.full((B, topk), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        m = min(n, topk)
        idx[b, :m] = torch.randperm(n, generator=gen)[:m].int()
    idx[0] = idx[0][torch.randperm(topk, generator=gen)]  # -1 entries anywhere
    idx[0, ::7] = -1
    q = (torch.randn(B, H, 576, generator=gen) * 0.5).bfloat16()
    ref = mref.sparse_mla_decode_ref(q, cache, bt, idx, 576 ** -0.5)
    out = torch.empty((B, H, 512), dtype=torch.bfloat16, device=DEV)
    for _ in range(2):  # twice: v4's fused merge counters must reset themselves
        out.fill_(float("nan"))
        mtk.sparse_mla_decode(q.to(DEV), cache.to(DEV), bt.to(DEV), idx.to(DEV), nsplit=nsplit, nacc=nacc, out=out,
                              impl=impl, bn={"v3": 32, "v5": None}.get(impl, 64), **v4)
        assert not out.isnan().any()
        assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("impl", ["v1", "v5"])
def test_sparse_mla_prefill(impl):
    gen = torch.Generator().manual_seed(7)
    L, T, topk, H = 1200, 40, 256, 128
    cache, bt = _mla_cache([L], 64, gen)
    q = (torch.randn(T, H, 576, generator=gen) * 0.5).bfloat16()
    idx = torch.stack([torch.randperm(L, generator=gen)[:topk] for _ in range(T)]).int()
    idx[:, -10:] = -1
    out = mtk.sparse_mla_prefill(q.to(DEV), cache.to(DEV), bt[0].to(DEV), idx.to(DEV), impl=impl)
    ref = mref.sparse_mla_prefill_ref(q, cache, bt[0], idx, 576 ** -0.5)
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("fused", [False, True])
def test_kda_decode_step(fused):
    gen = torch.Generator().manual_seed(8)
    B, H, D = 3, 8, 128
    q = torch.randn(B, H, D, generator=gen)
    k = torch.randn(B, H, D, generator=gen)
    v = torch.randn(B, H, D, generator=gen)
    f = torch.randn(B, H, D, generator=gen)
    b = torch.randn(B, H, generator=gen)
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.randn(H * D, generator=gen) * 0.5
    S0 = torch.randn(B, H, D, D, generator=gen) * 0.1
    if fused:
        qn = kref.l2norm_ref(q) * D ** -0.5
        kn = kref.l2norm_ref(k)
        g = kref.kda_gate_ref(f[:, None], A_log, dt_bias, -5.0)[:, 0]
        ro, rS = kref.kda_step_ref(qn, kn, v, g, torch.sigmoid(b), S0)
    else:
        q, k = kref.l2norm_ref(q) * D ** -0.5, kref.l2norm_ref(k)
        g = -5 * torch.rand(B, H, D, generator=gen)
        beta = torch.rand(B, H, generator=gen)
        ro, rS = kref.kda_step_ref(q, k, v, g, beta, S0)
    S = S0.to(DEV).contiguous()
    out = torch.full((B, H, D), float("nan"), device=DEV)
    if fused:
        ktk.kda_decode_step(q.to(DEV), k.to(DEV), v.to(DEV), f.to(DEV), b.to(DEV), S, scale=D ** -0.5, out=out,
                            A_log=A_log.to(DEV), dt_bias=dt_bias.to(DEV), use_qk_l2norm=True, use_beta_sigmoid=True)
    else:
        ktk.kda_decode_step(q.to(DEV), k.to(DEV), v.to(DEV), g.to(DEV), beta.to(DEV), S, out=out)
    assert rel(out, ro) < 1e-5 and rel(S, rS) < 1e-5


def test_kda_prefill_fused():
    pytest.importorskip("fla")
    gen = torch.Generator().manual_seed(9)
    B, T, H, D = 2, 200, 4, 128
    C = H * D
    xq, xk, xv, f, gate = (torch.randn(B, T, C, generator=gen).bfloat16() for _ in range(5))
    wq, wk, wv = (torch.randn(C, 4, generator=gen).bfloat16() * 0.5 for _ in range(3))
    b = torch.randn(B, T, H, generator=gen).bfloat16()
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.randn(C, generator=gen) * 0.5
    ow = (1 + 0.1 * torch.randn(D, generator=gen)).bfloat16()
    ref, rS = kref.kda_prefill_fused_ref(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, gate, ow)
    # pre-work alone, float32 outputs (bf16 storage)
    q, k, v, g, beta = ktk.kda_prefill_preprocess(*(x.to(DEV) for x in (xq, xk, xv, wq, wk, wv, f, b, A_log,
                                                                        dt_bias)))
    rq, rk, rv, rg, rb = kref.kda_prefill_preprocess_ref(xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias)
    for a, r_ in ((q, rq), (k, rk), (v, rv), (g, rg), (beta, rb)):
        assert rel(a, r_) < 1e-2
    for gate_in_fla in (True, False):
        out, S = ktk.kda_prefill_fused(*(x.to(DEV) for x in (xq, xk, xv, wq, wk, wv, f, b, A_log, dt_bias, gate, ow)),
                                       gate_in_fla=gate_in_fla)
        assert rel(out, ref) < 1e-2, gate_in_fla
        assert rel(S, rS) < 1e-2, gate_in_fla


def test_bad_input_names_the_field():
    q = torch.randn(2, 64, 128, device=DEV).bfloat16()
    w = torch.randn(2, 64, device=DEV)
    codes = torch.zeros(4, 64, 128, dtype=torch.uint8, device=DEV)
    scales = torch.zeros(4, 64, 4, dtype=torch.uint8, device=DEV)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    cl = torch.tensor([100, 50], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="q must be torch.bfloat16"):
        itk.indexer_topk_decode(q.float(), w, codes, scales, bt, cl, 16)
    with pytest.raises(ValueError, match="impl must be"):
        itk.indexer_topk_decode(q, w, codes, scales, bt, cl, 16, impl="v9")
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['pair'\]"):
        itk.indexer_topk_decode(q, w, codes, scales, bt, cl, 16, impl="v2", pair=2)
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['fused'\]"):
        mtk.sparse_mla_decode(torch.randn(1, 128, 576, device=DEV).bfloat16(),
                              torch.zeros(2, 64, 656, dtype=torch.uint8, device=DEV), bt[:1],
                              torch.zeros(1, 8, dtype=torch.int32, device=DEV), impl="v1", fused=True)
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['qloop'\]"):
        mtk.sparse_mla_decode(torch.randn(1, 128, 576, device=DEV).bfloat16(),
                              torch.zeros(2, 64, 656, dtype=torch.uint8, device=DEV), bt[:1],
                              torch.zeros(1, 8, dtype=torch.int32, device=DEV), qloop=True)
    with pytest.raises(ValueError, match="kv_cache uint8"):
        mtk.sparse_mla_decode(torch.randn(1, 64, 512, device=DEV).bfloat16(),
                              torch.zeros(2, 64, 656, dtype=torch.uint8, device=DEV), bt[:1],
                              torch.zeros(1, 8, dtype=torch.int32, device=DEV))
