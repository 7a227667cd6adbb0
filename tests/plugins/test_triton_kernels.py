"""GPU kernels (plugins/*/triton.py) against the ops' oracles on fresh random inputs (never zeros).

The kernel tests need triton and a CUDA GPU and skip cleanly without them. Outputs are poisoned (NaN / sentinel)
before each run; indices are compared as sets up to ties (reference.check_topk); bf16 outputs need
||out - ref|| / ||ref|| < 1e-2; FP8 codes and E8M0 scales must equal the quant oracle's bytes (the same exact
rule). The CPU tests pin the test helpers to the registered references and check that bad inputs are refused with
the field named, with or without triton.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kimi_compile import ops
from kimi_compile.plugins.indexer_topk import reference as iref
from kimi_compile.plugins.indexer_topk import triton as itk
from kimi_compile.plugins.kda import reference as kref
from kimi_compile.plugins.kda import triton as ktk
from kimi_compile.plugins.quant import triton as qtk
from kimi_compile.plugins.quant.reference import mx_dequantize, mx_quantize_torch
from kimi_compile.plugins.sparse_mla import triton as mtk

DEV = "cuda"
gpu = pytest.mark.skipif(itk.triton is None or not torch.cuda.is_available(),
                         reason="the Triton kernels need triton and a CUDA GPU")


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


def _slots(bt, b, n, bs):
    return bt[b].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs


def _index_cache(lens, bs, gen, rounding="floor"):
    bt, nb = _paged(lens, bs, gen)
    codes = torch.randint(0, 255, (nb, bs, 128), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 255, (nb, bs, 4), dtype=torch.uint8, generator=gen)
    for b, n in enumerate(lens):
        k = torch.randn(n, 128, generator=gen) * (1 + torch.rand(n, 1, generator=gen))
        iref.write_index_cache_ref(k, _slots(bt, b, n, bs), codes, scales, rounding)
    return codes, scales, bt


def _mla_pools(lens, bs, gen):
    """The three latent-cache pools as the quantize pass writes them (E4M3 codes, one E8M0 byte per 128 values by
    the ceil rule, bf16 RoPE dims), written through the quant oracle; unused rows hold random bytes."""
    bt, nb = _paged(lens, bs, gen)
    codes = torch.randint(0, 255, (nb, bs, 512), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (nb, bs, 4), dtype=torch.uint8, generator=gen)
    rope = torch.randn(nb, bs, 64, generator=gen).bfloat16()
    for b, n in enumerate(lens):
        c = torch.randn(n, 512, generator=gen) * (0.5 + torch.rand(n, 1, generator=gen))
        s = _slots(bt, b, n, bs)
        cq, cs = mx_quantize_torch(c, block=128, rounding="ceil")
        codes.view(-1, 512)[s], scales.view(-1, 4)[s] = cq, cs
        rope.view(-1, 64)[s] = torch.randn(n, 64, generator=gen).bfloat16()
    return codes, scales, rope, bt


def _mla_ref(q_lat, codes, scales, rope, bt, indices, sm_scale):
    """float64 o_lat [B, T, H, 512] of the kernels' contract on the three pools (dequantized by the quant oracle)."""
    c = torch.from_numpy(mx_dequantize(codes.reshape(-1, 512).numpy(), scales.reshape(-1, 4).numpy(), block=128))
    c, pe = c.double(), rope.reshape(-1, 64).double()
    B, T, H, _ = q_lat.shape
    bs = codes.shape[1]
    out = torch.zeros(B, T, H, 512, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            sel = indices[b, t][indices[b, t] >= 0].long()
            if sel.numel() == 0:
                continue
            rows = bt[b].long()[sel // bs] * bs + sel % bs
            qq = q_lat[b, t].double()
            s = (qq[:, :512] @ c[rows].T + qq[:, 512:] @ pe[rows].T) * sm_scale
            out[b, t] = torch.softmax(s, -1) @ c[rows]
    return out


def _mla_indices(lens, T, topk, gen):
    idx = torch.full((len(lens), T, topk), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        for t in range(T):
            m = min(n, topk)
            idx[b, t, :m] = torch.randperm(n, generator=gen)[:m]
            idx[b, t] = idx[b, t][torch.randperm(topk, generator=gen)]  # -1 entries anywhere
    idx[0, :, ::7] = -1
    return idx


# ------------------------------------------------------------------ CPU: helpers and refusals
def test_mla_reference_helper_is_the_registered_reference():
    """_mla_ref (the GPU tests' oracle on the three pools) equals kimi.SparseMLA's registered reference on the same
    pools (kv_format mxfp8, tile 128, rope_format float) with identity W_UK / W_UV, so o = o_lat."""
    gen = torch.Generator().manual_seed(20)
    lens, H, topk = [90, 40], 2, 16
    codes, scales, rope, bt = _mla_pools(lens, 16, gen)
    idx = _mla_indices(lens, 2, topk, gen)
    q = (torch.randn(2, 2, H, 576, generator=gen) * 0.5).bfloat16().float()
    eye = np.broadcast_to(np.eye(512, dtype=np.float32), (H, 512, 512))
    got = ops.lookup("SparseMLA").reference(
        q[..., :512].numpy(), q[..., 512:].numpy(), codes.numpy(), bt.long().numpy(), idx.numpy(), eye, eye,
        scales.numpy(), rope.float().numpy(), scale=576 ** -0.5, kv_lora_rank=512, kv_format="mxfp8", tile=128,
        rope_format="float")
    want = _mla_ref(q, codes, scales, rope, bt, idx, 576 ** -0.5)
    assert rel(want, torch.from_numpy(got)) < 1e-6


@pytest.mark.parametrize("cap,gluon", [((9, 0), True), ((10, 0), False), ((12, 0), False), ((8, 9), False)])
def test_gluon_score_kernel_is_hopper_only(monkeypatch, cap, gluon):
    """The indexer's Gluon score kernel (wgmma) is chosen on Hopper only: compiling it for Blackwell (sm_100 / sm_120,
    TMA but no wgmma) aborts the process in LLVM, so "auto" must pick the Triton score kernel there, and naming
    "gluon" must be refused with the reason."""
    from kimi_compile.plugins import wgmma_reason
    from kimi_compile.plugins.indexer_topk import gluon as igl

    monkeypatch.setattr(igl, "applies", lambda k_codes, heads: None)
    monkeypatch.setattr(itk, "_tma_ok", lambda k_codes: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    codes = torch.zeros(2, 64, 128, dtype=torch.uint8)
    assert itk.strategy_for(codes, 64) == ("gluon" if gluon else "triton")
    why = itk._gluon_reason(codes, 64)
    assert (why is None) == gluon
    if not gluon:
        assert f"sm_{cap[0]}{cap[1]}" in why and why == wgmma_reason(cap, "the Gluon score kernel")


def test_bad_input_names_the_field():
    """Refusals name the field, before any kernel runs (CPU tensors; triton need not be installed)."""
    q = torch.randn(2, 1, 64, 128).bfloat16()
    w = torch.randn(2, 1, 64)
    codes = torch.zeros(4, 64, 128, dtype=torch.uint8)
    scales = torch.zeros(4, 64, 4, dtype=torch.uint8)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    st, ln = torch.tensor([99, 49]), torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="q must be torch.bfloat16 or torch.float32"):
        itk.indexer_topk(q.half(), w, codes, scales, bt, st, ln, 16)
    with pytest.raises(ValueError, match=r"scales must be \[NB, BS, 4\]"):
        itk.indexer_topk(q, w, codes, scales[..., :2], bt, st, ln, 16)
    with pytest.raises(ValueError, match="power of two in"):
        itk.indexer_topk(q, w, codes[:, :48].contiguous(), scales[:, :48].contiguous(), bt, st, ln, 16)
    with pytest.raises(ValueError, match="lengths must be"):
        itk.indexer_topk(q, w, codes, scales, bt, st, ln[:1], 16)
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['impl'\]"):
        itk.indexer_topk(q, w, codes, scales, bt, st, ln, 16, impl="v4")
    with pytest.raises(ValueError, match="strategy must be"):
        itk.indexer_topk(q, w, codes, scales, bt, st, ln, 16, strategy="v3")
    with pytest.raises(ValueError, match="sort must be True or False"):
        itk.indexer_topk(q, w, codes, scales, bt, st, ln, 16, sort=0)
    from kimi_compile.plugins.indexer_topk import cuda as icuda

    x = [q, w, codes, bt.long(), st, ln, scales]
    with pytest.raises(ValueError, match="attribute 'sorted' must be 0 or 1, got 2"):
        icuda.indexer_topk_torch(x, {"topk": 16, "sorted": 2, "k_format": "mxfp8", "block": 32})
    assert icuda.sort_attr({"sorted": 0}) is False and icuda.sort_attr({}) is True
    on_cpu = "CUDA device" in (itk.unsupported(q, w, codes, scales, bt, st, ln, 16) or "")
    assert on_cpu or os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs the kernels on CPU tensors
    ql = torch.randn(1, 1, 128, 576).bfloat16()
    kc = torch.zeros(2, 64, 512, dtype=torch.uint8)
    ks = torch.zeros(2, 64, 4, dtype=torch.uint8)
    kr = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="kv_rope must be torch.bfloat16"):
        mtk.sparse_mla(ql, kc, ks, kr.float(), bt[:1], idx, 0.05)
    with pytest.raises(ValueError, match=r"kv_scales must be \[NB, BS, 4\]"):
        mtk.sparse_mla(ql, kc, ks[..., :1], kr, bt[:1], idx, 0.05)
    with pytest.raises(ValueError, match="q_lat must be"):
        mtk.sparse_mla(ql[..., :512], kc, ks, kr, bt[:1], idx, 0.05)
    with pytest.raises(ValueError, match="multiple of 64"):
        mtk.sparse_mla(ql[:, :, :96], kc, ks, kr, bt[:1], idx, 0.05)
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['impl'\]"):
        mtk.sparse_mla(ql, kc, ks, kr, bt[:1], idx, 0.05, impl="v5")
    assert mtk.supports(ql, kc, ks, kr, bt[:1], idx, 0.05) == (os.environ.get("TRITON_INTERPRET") == "1")


# ------------------------------------------------------------------ quantize into the caches
@gpu
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_mxfp8_quantize_to_cache(rounding):
    gen = torch.Generator().manual_seed(1)
    N, nb, bs = 1000, 40, 64
    x = (torch.randn(N, 128, generator=gen) * torch.exp(torch.randn(N, 1, generator=gen) * 3)).bfloat16()
    x[5, :32] = 0  # an all-zero block
    x[6, 40] = float("nan")  # a NaN block: scale 0xFF, codes 0x7F
    slots = torch.randperm(nb * bs, generator=gen)[:N]
    slots[7] = -1
    codes = torch.full((nb, bs, 128), 0xAB, dtype=torch.uint8, device=DEV)
    scales = torch.full((nb, bs, 4), 0xAB, dtype=torch.uint8, device=DEV)
    qtk.mxfp8_quantize_to_cache(x.to(DEV), slots.to(DEV), codes, scales, rounding)
    rc, rs = mx_quantize_torch(x.float(), block=32, rounding=rounding)
    keep = slots >= 0
    assert torch.equal(scales.view(-1, 4).cpu()[slots[keep]], rs[keep])
    assert torch.equal(codes.view(-1, 128).cpu()[slots[keep]], rc[keep])
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[keep]] = True
    assert bool((codes.view(-1, 128).cpu()[~written] == 0xAB).all())  # slot -1 and unused slots untouched
    assert bool((scales.view(-1, 4).cpu()[~written] == 0xAB).all())


@pytest.mark.skipif(qtk.triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1: CPU tensors)")
def test_mxfp8_dequantize_exact():
    """code * 2^(scale - 127) exactly (fp32 out), NaN blocks where the scale is 0xFF, the 2^-127 scale (an all-tiny
    block) included; bf16 out is that value rounded (within one ulp: the interpreter truncates), checked where it is
    a normal number."""
    from kimi_compile.plugins.quant.reference import mx_dequantize_torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(70, 128, generator=gen) * torch.exp(torch.randn(70, 1, generator=gen) * 3)
    x[3, :32], x[4, 40], x[5, 64:96] = 0, float("nan"), 1e-39
    c, s = mx_quantize_torch(x, block=32, rounding="floor")
    assert int(s[5, 2]) == 0  # the scale 2^-127 is exercised
    want = mx_dequantize_torch(c, s).float()
    got = qtk.mxfp8_dequantize(c.to(dev), s.to(dev), torch.float32).cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    got16 = qtk.mxfp8_dequantize(c.view(torch.float8_e4m3fn).to(dev), s.to(dev), torch.bfloat16).cpu().float()
    # normal values only: Triton's interpreter mis-rounds float32 -> bf16 below 2^-126 (4.4e-39 for 1.0e-39)
    ok = torch.isnan(want) | (want.abs() < 2.0**-126) | ((got16 - want).abs() <= want.abs() * 2.0**-7)
    assert bool(ok.all())
    with pytest.raises(ValueError, match="scales must be"):
        qtk.mxfp8_dequantize(c, s[:, :2], torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        qtk.mxfp8_dequantize(c[:, :96], s[:, :3], torch.float32)


@gpu
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_quantize_and_qdq_mx_kernels_equal_their_torch_twins(rounding, block):
    """The cuda backend's kimi.QuantizeMX / kimi.QDQMX Triton kernels give the torch twins' bytes and values (blocks
    of 32: the index keys; of 128: the latent KV cache, which ran the torch form's ~37 launches before), written into
    the executor's slots when given (Kernel.out: those very tensors returned)."""
    from kimi_compile.plugins.quant import cuda as qcuda

    gen = torch.Generator().manual_seed(5 + block)
    x = (torch.randn(3, 37, 512, generator=gen) * torch.exp(torch.randn(3, 37, 1, generator=gen) * 3)).bfloat16()
    x[0, 1, :block], x[1, 2, 7], x[2, 3, 300] = 0, float("nan"), float("inf")
    x = x.to(DEV)
    a = {"block": block, "elem_type": 17, "rounding": rounding}
    q, s = qcuda.quantize_mx_triton([x], a)
    rq, rs = qcuda.quantize_mx([x], a)
    assert q.dtype == rq.dtype and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert s.shape == (3, 37, 512 // block)
    slots = (torch.full((3, 37, 512), 7, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn),
             torch.full((3, 37, 512 // block), 7, dtype=torch.uint8, device=DEV))
    got = qcuda.quantize_mx_triton([x], a, out=slots)
    assert all(g is t for g, t in zip(got, slots))
    assert torch.equal(slots[0].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(slots[1], rs)
    (y,) = qcuda.qdq_mx_triton([x], a)
    (ry,) = qcuda.qdq_mx([x], a)
    assert y.dtype == ry.dtype == torch.bfloat16
    assert torch.equal(torch.isnan(y), torch.isnan(ry)) and torch.equal(torch.nan_to_num(y), torch.nan_to_num(ry))
    ys = torch.full_like(y, float("nan"))
    assert qcuda.qdq_mx_triton([x], a, out=(ys,))[0] is ys and torch.equal(torch.nan_to_num(ys), torch.nan_to_num(ry))
    assert qcuda.qdq_mx_triton([x], a, out=(torch.empty(3, 37, 512, device=DEV),))[0].dtype == torch.bfloat16


@gpu
def test_mla_fp8_quantize_to_cache():
    """The latent cache's three pools: codes and E8M0 bytes equal the quant oracle's (block 128, ceil: the quantize
    pass's fp8_tile ue8m0 rule), RoPE dims stored bf16; unlisted slots untouched."""
    gen = torch.Generator().manual_seed(2)
    N, nb, bs = 700, 20, 64
    c = (torch.randn(N, 512, generator=gen) * torch.exp(torch.randn(N, 4, 1, generator=gen)).repeat_interleave(128, 1)
         .reshape(N, 512)).bfloat16()
    c[3, :128] = 0
    pe = torch.randn(N, 64, generator=gen).bfloat16()
    slots = torch.randperm(nb * bs, generator=gen)[:N]
    slots[9] = -1
    kc = torch.full((nb, bs, 512), 0xCD, dtype=torch.uint8, device=DEV)
    ks = torch.full((nb, bs, 4), 0xCD, dtype=torch.uint8, device=DEV)
    kr = torch.full((nb, bs, 64), 7.0, dtype=torch.bfloat16, device=DEV)
    qtk.mla_fp8_quantize_to_cache(c.to(DEV), pe.to(DEV), slots.to(DEV), kc, ks, kr)
    rc, rs = mx_quantize_torch(c.float(), block=128, rounding="ceil")
    keep = slots >= 0
    assert torch.equal(ks.view(-1, 4).cpu()[slots[keep]], rs[keep])
    assert torch.equal(kc.view(-1, 512).cpu()[slots[keep]], rc[keep])
    assert torch.equal(kr.view(-1, 64).cpu()[slots[keep]], pe[keep])
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[keep]] = True
    assert bool((kc.view(-1, 512).cpu()[~written] == 0xCD).all()) and bool((kr.view(-1, 64).cpu()[~written] == 7).all())


# ------------------------------------------------------------------ indexer
def _decode_rows(q, w, codes, scales, bt, lens, topk, strategy, out):
    B = len(lens)
    return itk.indexer_topk_rows(q.to(DEV), w.to(DEV), codes.to(DEV), scales.to(DEV), bt.to(DEV),
                                 torch.arange(B, dtype=torch.int32, device=DEV),
                                 torch.tensor(lens, dtype=torch.int32, device=DEV), topk, strategy=strategy, out=out)


@gpu
@pytest.mark.parametrize("strategy", ["auto", "gluon", "triton"])
@pytest.mark.parametrize("bs", [64, 32])
def test_indexer_topk_rows(bs, strategy):
    if strategy == "gluon" and (bs != 64 or torch.cuda.get_device_capability()[0] < 9):
        pytest.skip("the Gluon score kernel needs 64-key pages on Hopper+ (test_indexer_strategy covers the refusal)")
    gen = torch.Generator().manual_seed(3)
    lens = [5000, 1500, 2048, 9000, 1]
    topk = 2048
    codes, scales, bt = _index_cache(lens, bs, gen)
    B = len(lens)
    q = torch.randn(B, 64, 128, generator=gen).bfloat16()
    w = torch.randn(B, 64, generator=gen) * 0.1
    _, _, full = iref.indexer_topk_decode_ref(q, w, codes, scales, bt, torch.tensor(lens), topk,
                                              return_all_scores=True)
    for _ in range(2):  # twice: the self-cleaning workspace must be reusable
        oi = torch.full((B, topk), -7, dtype=torch.int32, device=DEV)
        os_ = torch.full((B, topk), float("nan"), device=DEV)
        _decode_rows(q, w, codes, scales, bt, lens, topk, strategy, (oi, os_))
        torch.cuda.synchronize()
        res = iref.check_topk(oi, os_, full, lens, topk)
        assert res["ok"], res


@gpu
@pytest.mark.parametrize("strategy", ["auto", "triton"])
@pytest.mark.parametrize("lens,topk", [([70000, 65536], 2048), ([131072], 2048), ([3000, 200, 9000], 512),
                                       ([40000, 9000], 8192), ([300000], 256)])
def test_indexer_topk_rows_long(lens, topk, strategy):
    """Threshold selects on long rows (register and memory paths: > 4096 candidates; > 4096 group maxima, merged),
    random (non-zero) cache."""
    gen = torch.Generator().manual_seed(11)
    bs = 64
    bt, nb = _paged(lens, bs, gen)
    codes = torch.randint(0, 255, (nb, bs, 128), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 255, (nb, bs, 4), dtype=torch.uint8, generator=gen)
    iref.write_index_cache_ref(torch.randn(nb * bs, 128, generator=gen), torch.arange(nb * bs), codes, scales)
    B = len(lens)
    q = torch.randn(B, 64, 128, generator=gen).bfloat16()
    w = torch.randn(B, 64, generator=gen) * 0.1
    oi = torch.full((B, topk), -7, dtype=torch.int32, device=DEV)
    os_ = torch.full((B, topk), float("nan"), device=DEV)
    for _ in range(2):
        _decode_rows(q, w, codes, scales, bt, lens, topk, strategy, (oi, os_))
    torch.cuda.synchronize()
    _, _, full = iref.indexer_topk_decode_ref(q, w, codes, scales, bt, torch.tensor(lens), topk,
                                              return_all_scores=True)
    res = iref.check_topk(oi, os_, full, lens, topk)
    assert res["ok"], res


@gpu
@pytest.mark.parametrize("strategy", ["gluon", "triton"])
def test_indexer_score_kernels_write_both_maxima(strategy):
    """Stage 1's maxima workspace: for each row, the max of every 4 positions, then of every COARSE, of the scores it
    wrote (positions < L; -inf past L in the last group), bit for bit, as far as the row's length reaches (the
    candidate kernel reads no further). Rows ending mid-group and mid-page."""
    if strategy == "gluon" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the Gluon score kernel needs Hopper+ (test_indexer_strategy covers the refusal)")
    gen = torch.Generator().manual_seed(14)
    lens, bs = [5003, 70, 4096, 1], 64
    codes, scales, bt = _index_cache(lens, bs, gen)
    B = len(lens)
    q = torch.randn(B, 64, 128, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(B, 64, generator=gen) * 0.1).to(DEV)
    L = torch.tensor(lens, dtype=torch.int32)
    sc, gm = itk.indexer_scores(q, w, codes.to(DEV), scales.to(DEV), bt.to(DEV),
                                torch.arange(B, dtype=torch.int32, device=DEV), L.to(DEV), 2048, strategy=strategy)
    sc, gm = sc.cpu(), gm.cpu()
    want = _maxima(sc, L)
    nfine = sc.shape[1] // itk._group_size(64)
    for r, n in enumerate(lens):
        for lo, g in ((0, itk._group_size(64)), (nfine, itk.COARSE)):
            m = -(-n // g)
            assert torch.equal(gm[r, lo:lo + m].view(torch.int32), want[r, lo:lo + m].view(torch.int32)), (r, g)


@gpu
@pytest.mark.parametrize("zero_w", [False, True])
def test_indexer_topk_contract(zero_w):
    """indexer_topk vs kimi.IndexerTopK's registered reference on the same MXFP8 pools, T = 2 queries per sequence:
    int64, -1 / -1e30 padding, sorted by score desc then position asc (ties exactly when w = 0)."""
    reference = ops.lookup("IndexerTopK").reference
    gen = torch.Generator().manual_seed(12)
    bs, topk, T = 64, 256, 2
    lens = [1000, 100, 700]
    codes, scales, bt = _index_cache(lens, bs, gen)
    B = len(lens)
    q = torch.randn(B, T, 64, 128, generator=gen).bfloat16()
    w = torch.zeros(B, T, 64) if zero_w else torch.randn(B, T, 64, generator=gen) * 0.1
    start = torch.tensor([n - T for n in lens])  # the step's tokens are the last T cached ones
    length = torch.full((B,), T, dtype=torch.int64)
    ri, rs = reference(q.float().numpy(), w.numpy(), codes.numpy(), bt.long().numpy(), start.numpy(),
                       length.numpy(), topk, index_scale_pool=scales.numpy(), k_format="mxfp8")
    gi = torch.full((B, T, topk), -7, dtype=torch.int64, device=DEV)
    gs = torch.full((B, T, topk), float("nan"), device=DEV)
    itk.indexer_topk(q.to(DEV), w.to(DEV), codes.to(DEV), scales.to(DEV), bt.long().to(DEV), start.to(DEV),
                     length.to(DEV), topk, out=(gi, gs))
    gi, gs = gi.cpu(), gs.cpu()
    ri, rs = torch.from_numpy(ri), torch.from_numpy(rs)
    assert torch.equal(gi < 0, ri < 0)
    assert bool((gs[gi < 0] == -1e30).all())
    if zero_w:
        assert torch.equal(gi, ri)  # all scores tie: positions ascending
        return
    for b in range(B):
        for t in range(T):
            n = int((ri[b, t] >= 0).sum())
            L = lens[b] - T + t + 1
            tol = 1e-3 * float(rs[b, t, :n].abs().max())
            ei, every = reference(q[b:b + 1, t:t + 1].float().numpy(), w[b:b + 1, t:t + 1].numpy(), codes.numpy(),
                                  bt[b:b + 1].long().numpy(), start[b:b + 1].numpy() + t, np.ones(1, np.int64), L,
                                  index_scale_pool=scales.numpy(), k_format="mxfp8")  # every visible score
            allref = torch.empty(L, dtype=torch.float64)
            allref[torch.from_numpy(ei)[0, 0]] = torch.from_numpy(every)[0, 0].double()
            # slot by slot the reference score of our index equals the reference's (up to near-ties)
            assert float((allref[gi[b, t, :n]] - rs[b, t, :n].double()).abs().max()) <= tol
            assert bool((gs[b, t, 1:n] <= gs[b, t, :n - 1]).all())


def _interp_runs_score_kernels() -> bool:
    """Triton 3.6's interpreter cannot run the score kernel (its tl.range over loaded bounds); 3.9's can."""
    return os.environ.get("TRITON_INTERPRET") == "1" and itk.triton is not None and \
        tuple(int(x) for x in itk.triton.__version__.split(".")[:2]) >= (3, 9)


@pytest.mark.skipif(itk.triton is None or not (torch.cuda.is_available() or _interp_runs_score_kernels()),
                    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1 with triton >= 3.9: CPU tensors)")
@pytest.mark.parametrize("lens,topk,T", [([1000, 100, 700], 256, 2), ([3000, 0], 512, 1)])
def test_indexer_topk_unsorted(lens, topk, T):
    """sort=False (the op's sorted=0): per query the same (position, score) pairs as the sorted contract, bit for
    bit, the min(topk, L) selected slots first, then -1 / -1e30; written into the given slots (poisoned first).
    Rows shorter than topk, an empty row and a row past 2048 positions (several candidate slices)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(21)
    codes, scales, bt = _index_cache(lens, 64, gen)
    B = len(lens)
    q = torch.randn(B, T, 64, 128, generator=gen).bfloat16().to(dev)
    w = (torch.randn(B, T, 64, generator=gen) * 0.1).to(dev)
    start = torch.tensor([max(n - T, 0) for n in lens], device=dev)
    length = torch.tensor([min(T, n) for n in lens], device=dev)
    args = (q, w, codes.to(dev), scales.to(dev), bt.long().to(dev), start, length, topk)
    si, ss = itk.indexer_topk(*args, strategy="triton")
    ui = torch.full((B, T, topk), -7, dtype=torch.int64, device=dev)
    us = torch.full((B, T, topk), float("nan"), device=dev)
    got = itk.indexer_topk(*args, strategy="triton", out=(ui, us), sort=False)
    assert got[0] is ui and got[1] is us
    si, ss, ui, us = si.cpu(), ss.cpu(), ui.cpu(), us.cpu()
    assert not torch.equal(ui, si)  # the unsorted path really is another order (else this test proves nothing)
    for b in range(B):
        for t in range(T):
            n = int((si[b, t] >= 0).sum())
            assert n == min(topk, max(0, min(int(start[b]) + t + 1, int(start[b] + length[b]))))
            assert bool((ui[b, t, :n] >= 0).all()) and bool((ui[b, t, n:] == -1).all())
            assert bool((us[b, t, n:] == -1e30).all())
            o = torch.argsort(ui[b, t, :n])
            r = torch.argsort(si[b, t, :n])
            assert torch.equal(ui[b, t, :n][o], si[b, t, :n][r])
            assert torch.equal(us[b, t, :n][o].view(torch.int32), ss[b, t, :n][r].view(torch.int32))


@gpu
def test_indexer_backend_kernel_writes_into_the_executors_slots():
    """The cuda backend's IndexerTopK kernel (Kernel.out): given the executor's (indices, scores) slots it returns
    those very tensors, equal to the op's own allocation; a slot of another dtype is declined."""
    from kimi_compile.plugins.indexer_topk import cuda as icuda

    gen = torch.Generator().manual_seed(13)
    lens, T, topk = [900, 300], 1, 256
    codes, scales, bt = _index_cache(lens, 64, gen)
    B = len(lens)
    q = torch.randn(B, T, 64, 128, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(B, T, 64, generator=gen) * 0.1).to(DEV)
    start = torch.tensor([n - T for n in lens], device=DEV)
    length = torch.full((B,), T, dtype=torch.int64, device=DEV)
    x = [q, w, codes.view(torch.float8_e4m3fn).to(DEV), bt.long().to(DEV), start, length, scales.to(DEV)]
    a = {"topk": topk, "k_format": "mxfp8", "block": 32}
    slots = (torch.full((B, T, topk), -7, dtype=torch.int64, device=DEV),
             torch.full((B, T, topk), float("nan"), device=DEV))
    got = icuda.indexer_topk_triton(x, a, out=slots)
    want = itk.indexer_topk(q, w, x[2].view(torch.uint8), x[6], x[3], start, length, topk)
    assert all(g is s and torch.equal(g, w_) for g, s, w_ in zip(got, slots, want))
    other = (torch.empty(B, T, topk, dtype=torch.int32, device=DEV), slots[1])
    assert icuda.indexer_topk_triton(x, a, out=other)[0] is not other[0]


_INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def _order_key(x):
    """The kernels' order-preserving int32 image of fp32 scores (`_key`), as int64."""
    b = x.contiguous().view(torch.int32).long()
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def _maxima(sc, L):
    """The score kernels' maxima workspace of score rows sc [R, cap] with lengths L: per row the max of every G
    positions, then of every COARSE (-inf past the row's length)."""
    R, cap = sc.shape
    x = torch.where(torch.arange(cap)[None] < L[:, None], sc, float("-inf"))
    G = itk._group_size(64)
    return torch.cat([x.view(R, cap // G, G).amax(-1), x.view(R, cap // itk.COARSE, itk.COARSE).amax(-1)], 1)


@pytest.mark.skipif(itk.triton is None or not (torch.cuda.is_available() or _INTERP),
                    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1: CPU tensors)")
@pytest.mark.parametrize("shape", [(64, 4), (128, 2), (32, 4)])
@pytest.mark.parametrize("lens,topk", [([1000], 200), ([900, 40, 1024, 0], 300), ([5000, 3000], 2048)])
def test_indexer_rank_stage(lens, topk, shape, monkeypatch):
    """Stages 2 and 3 writing order keys, then the rank kernel, on synthetic score rows without the score kernel:
    the contract's order exactly (score desc as the int32 order key orders it, -0.0 below +0.0, then position asc)
    with many tied scores, rows shorter than topk (-1 / MASKED padding), topk not a multiple of the slot block,
    the two (slots, warps) shapes the launch picks (2 or 4 slots per lane, 4 or 2 warps splitting the keys) and one
    of 1 slot per lane."""
    from kimi_compile.onnx_body import MASKED

    monkeypatch.setattr(itk, "_rank_shape", lambda R, k, nsm: shape)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(len(lens) + topk)
    R, cap = len(lens), max(1024, -(-max(lens) // 1024) * 1024)
    sc = (torch.randn(R, cap, generator=gen) * 4).round() / 4  # many exact ties
    sc[:, ::7] = 0.0
    sc[:, 3::11] = -0.0
    G = itk._group_size(64)
    L = torch.tensor(lens, dtype=torch.int32)
    ws = tuple(t.to(dev) for t in (sc, _maxima(sc, L), torch.empty(R, cap), torch.empty(R, cap, dtype=torch.int32),
                                   torch.zeros(R, dtype=torch.int32)))
    kp = -(-topk // itk.RANK_CHK) * itk.RANK_CHK
    keys = torch.full((R, kp), 7.0, dtype=torch.float64, device=dev)
    itk._select(ws, L.to(dev), keys, None, cap, cap // G, topk, G, itk.num_sms(keys.device), MASKED)
    oi = torch.full((R, topk), -7, dtype=torch.int64, device=dev)
    os_ = torch.full((R, topk), float("nan"), device=dev)
    itk._rank(keys, topk, oi, os_)
    oi, os_ = oi.cpu(), os_.cpu()
    for r, n in enumerate(lens):
        k = _order_key(sc[r, :n])
        order = torch.tensor(sorted(range(n), key=lambda i: (-int(k[i]), i))[:topk], dtype=torch.int64)
        m = min(n, topk)
        assert torch.equal(oi[r, :m], order)
        assert torch.equal(os_[r, :m].view(torch.int32), sc[r, order].view(torch.int32))  # bit for bit
        assert bool((oi[r, m:] == -1).all()) and bool((os_[r, m:] == MASKED).all())


def _candidate_count(sc, gm, n, topk, ngb=4096):
    """Stage 2's candidate count of one row as its docstring specifies it: the row's ng group maxima (gm: fine, then
    coarse as `_maxima` lays them out; the coarse ones when there are at least ngb of them) merged into min(ng, ngb)
    groups of adjacent maxima (sizes differing by at most one, the larger first); T = the top 16 bits of the k-th
    largest merged maximum's order key (k = min(n, topk); every position when there are fewer groups than k); the
    positions whose score key is >= T."""
    k = min(n, topk)
    nfine = sc.numel() // itk._group_size(64)
    ng = -(-n // itk.COARSE)
    if ng >= ngb:
        gm = gm[nfine:]
    else:
        ng = -(-n // itk._group_size(64))
    q, r = divmod(ng, ngb)
    if min(ng, ngb) < k:
        return n
    sizes = [q + (g < r) for g in range(min(ng, ngb))]
    merged = torch.stack([part.max() for part in torch.split(gm[:ng], sizes)])
    t = (int(_order_key(merged).sort(descending=True).values[k - 1]) >> 16) << 16
    return int((_order_key(sc[:n]) >= t).sum())


@pytest.mark.skipif(itk.triton is None or not (torch.cuda.is_available() or _INTERP),
                    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1: CPU tensors)")
def test_indexer_candidates_follow_the_rows_length():
    """Stage 2's threshold comes from group maxima merged by each row's own length, so rows much shorter than the
    cache's capacity keep a candidate set near topk (measured 2026-12-06, H100 e2e at 32K context in a 136K-token
    cache: the threshold from capacity-sized groups passed every position, 32K candidates, and the exact select took
    134 us a call). Synthetic continuous scores, a 72K-position cache: rows of 30000 (groups of 1-2 maxima of 4
    positions), 65536 (4096 coarse maxima of 16 positions, one a group), 12000 (1), 1500 (< topk: every position),
    32772 and 70000 positions (4375 coarse maxima in groups of 1-2, where the fine ones would make groups of 16 or 20
    positions), topk 2048. The 32772-position row is just past a power of two: merged a power-of-two F at a time it
    had 2049 groups and 33% of its positions passed (measured on the e2e decode's scores at 32769 positions: 10.5K
    candidates); in 4096 groups of 2-3 maxima, 8%. Expected candidate shares for independent scores: 9%, 4%, 25%,
    100%, 8%, 4%; asserted below 15%, 8%, 35%, -, 12%, 8%, each count equal to the one the kernel's specification
    gives (`_candidate_count`), and the selections exact."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    lens, topk, cap = [30000, 65536, 12000, 1500, 32772, 70000], 2048, 73728
    R = len(lens)
    sc = torch.randn(R, cap, generator=gen)
    G = itk._group_size(64)
    L = torch.tensor(lens, dtype=torch.int32)
    gm = _maxima(sc, L)
    ws = tuple(t.to(dev) for t in (sc, gm, torch.empty(R, cap), torch.empty(R, cap, dtype=torch.int32),
                                   torch.zeros(R, dtype=torch.int32)))
    itk._candidates(ws, L.to(dev), cap, cap // G, topk, G, itk.num_sms(ws[0].device))
    nc = ws[4].cpu().tolist()
    for r, (n, c, share) in enumerate(zip(lens, nc, (0.15, 0.08, 0.35, 1.0, 0.12, 0.08))):
        assert min(n, topk) <= c <= share * n, (n, c)
        kth = sc[r, :n].topk(min(n, topk)).values[-1]
        top = (sc[r, :n] >= kth).nonzero().flatten()
        assert bool(torch.isin(top, ws[3][r][:c].cpu().long()).all())  # every top-k score is a candidate
        assert c == _candidate_count(sc[r], gm[r], n, topk), (n, c)  # the threshold exactly as specified
    ws[4].zero_()
    out_i = torch.full((R, topk), -7, dtype=torch.int32, device=dev)
    out_s = torch.full((R, topk), float("nan"), device=dev)
    itk._select(ws, L.to(dev), out_i, out_s, cap, cap // G, topk, G, itk.num_sms(ws[0].device), -1e30)
    for r, n in enumerate(lens):
        want = set(sc[r, :n].topk(min(n, topk)).indices.tolist())  # continuous scores: no ties
        got = out_i[r].cpu()
        assert set(got[got >= 0].tolist()) == want and int((got < 0).sum()) == topk - min(n, topk)


@gpu
@pytest.mark.parametrize("strategy", ["auto", "triton"])
def test_indexer_topk_ties(strategy):
    """Many exactly equal scores (w = 0: every score is 0): ties resolved to exactly k slots, the lowest positions."""
    gen = torch.Generator().manual_seed(4)
    lens = [3000]
    codes, scales, bt = _index_cache(lens, 64, gen)
    q = torch.randn(1, 64, 128, generator=gen).bfloat16()
    w = torch.zeros(1, 64)
    oi, os_ = _decode_rows(q, w, codes, scales, bt, lens, 2048, strategy, None)
    sel = oi.cpu()[0]
    assert sel.unique().numel() == 2048 and int(sel.min()) >= 0 and int(sel.max()) < 3000
    assert bool((os_.cpu() == 0).all())


@gpu
def test_indexer_strategy():
    """"auto" takes the Gluon score kernel on Hopper+ with 64-key pages and 64 heads, the Triton one elsewhere; an
    explicit "gluon" where it does not apply is refused with the reason."""
    codes = torch.zeros(4, 64, 128, dtype=torch.uint8, device=DEV)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert itk.strategy_for(codes, 64) == ("gluon" if hopper else "triton")
    assert itk.strategy_for(codes[:, :32], 64) == "triton"
    assert itk.strategy_for(codes, 32) == "triton"
    q = torch.zeros(1, 1, 64, 128, dtype=torch.bfloat16, device=DEV)
    args = (torch.zeros(1, 1, 64, device=DEV), codes[:, :32].contiguous(), torch.zeros(4, 32, 4, dtype=torch.uint8,
                                                                                        device=DEV),
            torch.zeros(1, 4, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV),
            torch.ones(1, dtype=torch.int64, device=DEV), 16)
    with pytest.raises(ValueError, match="64-key cache pages"):
        itk.indexer_topk(q, *args, strategy="gluon")


@gpu
@pytest.mark.parametrize("strategy", ["auto", "triton"])
def test_indexer_topk_prefill(strategy):
    """One sequence, T = 96 new tokens after 600 cached ones: query t sees positions s <= 600 + t."""
    gen = torch.Generator().manual_seed(5)
    start, T, topk = 600, 96, 256
    codes, scales, bt = _index_cache([start + T], 64, gen)
    q = torch.randn(T, 64, 128, generator=gen).bfloat16()
    w = torch.rand(T, 64, generator=gen) * 0.1
    oi, os_ = itk.indexer_topk(q[None].to(DEV), w[None].to(DEV), codes.to(DEV), scales.to(DEV), bt.to(DEV),
                               torch.tensor([start], device=DEV), torch.tensor([T], device=DEV), topk,
                               strategy=strategy)
    _, _, full = iref.indexer_topk_prefill_ref(q, w, codes, scales, bt[0], start, topk, return_all_scores=True)
    res = iref.check_topk(oi[0], os_[0], full, [start + t + 1 for t in range(T)], topk)
    assert res["ok"], res


@gpu
def test_indexer_topk_cuda_graph():
    """Captured once, replayed with other lengths written into the same device tensor: the replay equals a direct
    call (lengths are read on the device; nothing is sized from them)."""
    gen = torch.Generator().manual_seed(13)
    lens, topk = [4000, 3000], 512
    codes, scales, bt = _index_cache(lens, 64, gen)
    q = torch.randn(2, 1, 64, 128, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(2, 1, 64, generator=gen) * 0.1).to(DEV)
    codes, scales, bt = codes.to(DEV), scales.to(DEV), bt.to(DEV)
    start = torch.tensor([999, 2999], device=DEV)
    length = torch.ones(2, dtype=torch.int64, device=DEV)
    out = (torch.empty(2, 1, topk, dtype=torch.int64, device=DEV), torch.empty(2, 1, topk, device=DEV))
    run = lambda: itk.indexer_topk(q, w, codes, scales, bt, start, length, topk, out=out)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up: compiles, allocates the workspace
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    start.copy_(torch.tensor([3999, 1499], device=DEV))
    g.replay()
    torch.cuda.synchronize()
    gi, gs = out[0].clone(), out[1].clone()
    di, ds = itk.indexer_topk(q, w, codes, scales, bt, start, length, topk)
    assert torch.equal(gi, di) and torch.equal(gs, ds)
    assert int((gi[1] >= 0).sum()) == topk and int(gi[1].max()) < 1500


# ------------------------------------------------------------------ sparse MLA
@gpu
@pytest.mark.parametrize("B", [1, 3, 6])  # the three launch configurations (1-2, 3-4, 5+ rows)
def test_sparse_mla_decode(B):
    gen = torch.Generator().manual_seed(6)
    lens, topk, H = [3000, 2500, 100, 2048, 700, 5000][:B], 2048, 128
    codes, scales, rope, bt = _mla_pools(lens, 64, gen)
    idx = _mla_indices(lens, 1, topk, gen)
    q = (torch.randn(B, 1, H, 576, generator=gen) * 0.5).bfloat16()
    ref = _mla_ref(q, codes, scales, rope, bt, idx, 576 ** -0.5)
    out = torch.empty((B, 1, H, 512), dtype=torch.bfloat16, device=DEV)
    for _ in range(2):  # twice: the cached workspaces are reused
        out.fill_(float("nan"))
        mtk.sparse_mla(q.to(DEV), codes.to(DEV), scales.to(DEV), rope.to(DEV), bt.to(DEV), idx.to(DEV), 576 ** -0.5,
                       out=out)
        assert not out.isnan().any()
        assert rel(out, ref) < 1e-2


def test_sparse_mla_config_head_blocks(monkeypatch):
    """Both passes' head blocks fall back to 64 heads where the head count is not a multiple of the configured block
    (a pass-2 block of 128 at 64 heads would launch no pass-2 program)."""
    monkeypatch.setattr(mtk, "_LARGE", dict(mtk._LARGE, bh=128, bh2=128))
    assert (mtk._config(8, 64)["bh"], mtk._config(8, 64)["bh2"]) == (64, 64)
    assert (mtk._config(8, 192)["bh"], mtk._config(8, 192)["bh2"]) == (64, 64)
    assert (mtk._config(8, 256)["bh"], mtk._config(8, 256)["bh2"]) == (128, 128)


@pytest.mark.skipif(mtk.triton is None or not (torch.cuda.is_available() or _INTERP),
                    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1: CPU tensors)")
@pytest.mark.parametrize("B", [1, 3, 6])  # the three launch configurations, each splitting the keys here
def test_sparse_mla_small_shapes(B):
    """The sparse MLA kernels at small shapes (64 heads, top-256), which also run in Triton's interpreter on CPU
    tensors (tests/conftest.py widens its bfloat16 dot operands): key splits (8, 4 and 4 for 1, 3 and 6 rows), rows
    shorter than topk, -1 indices anywhere, a sequence with no valid index (zeros), the output poisoned."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(16)
    lens, topk, H = [300, 40, 700, 256, 90, 500][:B], 256, 64
    codes, scales, rope, bt = _mla_pools(lens, 64, gen)
    idx = _mla_indices(lens, 1, topk, gen)
    if B > 1:
        idx[1] = -1  # no valid index: zeros
    q = (torch.randn(B, 1, H, 576, generator=gen) * 0.5).bfloat16()
    ref = _mla_ref(q, codes, scales, rope, bt, idx, 576 ** -0.5)
    out = torch.full((B, 1, H, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    mtk.sparse_mla(q.to(dev), codes.to(dev), scales.to(dev), rope.to(dev), bt.to(dev), idx.to(dev), 576 ** -0.5,
                   out=out)
    out = out.cpu()
    assert not out.isnan().any()
    assert rel(out, ref) < 1e-2
    if B > 1:
        assert not out[1].any()


@gpu
def test_sparse_mla_prefill_and_float8_codes():
    """T = 40 queries of one sequence, each its own selected set (int32 indices, int64 block table, float8-typed
    code pool)."""
    gen = torch.Generator().manual_seed(7)
    L, T, topk, H = 1200, 40, 256, 128
    codes, scales, rope, bt = _mla_pools([L], 64, gen)
    q = (torch.randn(1, T, H, 576, generator=gen) * 0.5).bfloat16()
    idx = _mla_indices([L], T, topk, gen)
    out = mtk.sparse_mla(q.to(DEV), codes.to(DEV).view(torch.float8_e4m3fn), scales.to(DEV), rope.to(DEV),
                         bt.long().to(DEV), idx.int().to(DEV), 576 ** -0.5)
    assert out.shape == (1, T, H, 512) and out.dtype == torch.bfloat16
    assert rel(out, _mla_ref(q, codes, scales, rope, bt, idx, 576 ** -0.5)) < 1e-2


@gpu
def test_sparse_mla_cuda_graph():
    """Captured once, replayed with other indices written into the same device tensor: equals a direct call."""
    gen = torch.Generator().manual_seed(14)
    lens, topk, H = [3000], 2048, 128
    codes, scales, rope, bt = (t.to(DEV) for t in _mla_pools(lens, 64, gen))
    idx = _mla_indices(lens, 1, topk, gen).to(DEV)
    q = (torch.randn(1, 1, H, 576, generator=gen) * 0.5).bfloat16().to(DEV)
    out = torch.empty(1, 1, H, 512, dtype=torch.bfloat16, device=DEV)
    run = lambda: mtk.sparse_mla(q, codes, scales, rope, bt, idx, 576 ** -0.5, out=out)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    idx.copy_(_mla_indices(lens, 1, topk, gen).to(DEV))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mtk.sparse_mla(q, codes, scales, rope, bt, idx, 576 ** -0.5))


# ------------------------------------------------------------------ KDA
@gpu
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
    assert rel(out, ro) < 1e-5 and rel(S, rS) < 1e-5  # S: updated in place


def test_mx_kernels_refuse_and_fall_back_with_reasons(caplog):
    """Build-time refusals name the attribute; at run time a tensor the kernels do not take (CPU, a last dim that is
    not a power of two) runs the torch twin, said once."""
    from kimi_compile.plugins.quant import cuda as qcuda

    if qtk.triton is not None:
        why = qcuda._mx_triton_supports([], {"block": 16, "elem_type": 17, "rounding": "floor"})
        assert "blocks of 32 or 128" in why and "got block 16" in why
        assert "rounding" in qcuda._mx_triton_supports([], {"block": 32, "elem_type": 17, "rounding": "rne"})
        assert qcuda._mx_triton_supports([], {"block": 32, "elem_type": 17, "rounding": "ceil"}) is None
        assert qcuda._mx_triton_supports([], {"block": 128, "elem_type": 17, "rounding": "ceil"}) is None
    assert "not a CUDA device" in qcuda._mx_triton_refuses(torch.zeros(2, 96), 32)
    x = torch.randn(4, 64)
    a = {"block": 32, "elem_type": 17, "rounding": "floor"}
    with caplog.at_level("WARNING", logger="kimi_compile.kernels"):
        q, s = qcuda.quantize_mx_triton([x], a)
        (y,) = qcuda.qdq_mx_triton([x], a)
    rq, rs = qcuda.quantize_mx([x], a)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(y, qcuda.qdq_mx([x], a)[0])
    assert "running torch.mx_quantize" in caplog.text and "running torch.mx_qdq" in caplog.text
