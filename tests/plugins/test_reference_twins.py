"""Each plugins/<op>/reference.py holds one oracle: its numpy twin (the registered reference of the op) and its torch
twins (the GPU kernels' oracle) agree on the same inputs, with the same output order and masking value. CPU only."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kimi_compile import ops  # noqa: E402
from kimi_compile.plugins.indexer_topk import reference as iref  # noqa: E402
from kimi_compile.plugins.kda import reference as kref  # noqa: E402
from kimi_compile.plugins.sparse_mla import reference as mref  # noqa: E402


def _paged_index_cache(lens, bs, D, gen):
    """Block table with shuffled blocks (block 0 unused) and an MXFP8 index-K cache written by the torch twin."""
    nblk = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(sum(nblk), generator=gen) + 1
    bt = torch.zeros(len(lens), max(nblk), dtype=torch.int64)
    o = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[o:o + n]
        o += n
    codes = torch.zeros(sum(nblk) + 1, bs, D, dtype=torch.uint8)
    scales = torch.zeros(sum(nblk) + 1, bs, D // 32, dtype=torch.uint8)
    for b, n in enumerate(lens):
        k = torch.randn(n, D, generator=gen) * (1 + torch.rand(n, 1, generator=gen))
        slots = bt[b][torch.arange(n) // bs] * bs + torch.arange(n) % bs
        iref.write_index_cache_ref(k, slots, codes, scales)
    return codes, scales, bt


def test_indexer_topk_twins_share_one_contract():
    """Decode (T=1): the numpy twin on the MXFP8 pools and the torch twin on the same cache select the same positions
    with the same scores; unused slots are -1 / MASKED in both."""
    gen = torch.Generator().manual_seed(0)
    lens, bs, D, H, topk = [37, 5, 20], 8, 64, 4, 16
    codes, scales, bt = _paged_index_cache(lens, bs, D, gen)
    q = torch.randn(len(lens), H, D, generator=gen)
    w = torch.rand(len(lens), H, generator=gen)
    ti, ts = iref.indexer_topk_decode_ref(q, w, codes, scales, bt, torch.tensor(lens), topk)
    start = np.array([n - 1 for n in lens])
    ni, ns = ops.lookup("IndexerTopK").reference(
        q[:, None].numpy(), w[:, None].numpy(), codes.numpy(), bt.numpy(), start, np.ones(len(lens), np.int64), topk,
        index_scale_pool=scales.numpy(), k_format="mxfp8")
    ni, ns = ni[:, 0], ns[:, 0]
    for b, n in enumerate(lens):
        m = min(n, topk)
        assert sorted(ti[b, :m].tolist()) == sorted(ni[b, :m].tolist())
        np.testing.assert_allclose(np.sort(ts[b, :m].numpy()), np.sort(ns[b, :m].astype(np.float64)), rtol=1e-6)
        assert np.all(np.diff(ns[b, :m]) <= 0)  # the numpy twin sorts by score
        assert (ti[b, m:] == -1).all() and (ni[b, m:] == -1).all()
        assert (ts[b, m:] == iref.MASKED).all() and (ns[b, m:] == np.float32(iref.MASKED)).all()


def test_indexer_topk_eager_baseline_keeps_the_contract():
    gen = torch.Generator().manual_seed(1)
    lens, bs, D, H, topk = [30, 6], 8, 64, 4, 12
    codes, scales, bt = _paged_index_cache(lens, bs, D, gen)
    q = torch.randn(len(lens), H, D, generator=gen).bfloat16()
    w = torch.rand(len(lens), H, generator=gen)
    cl = torch.tensor(lens)
    ei, ev = iref.indexer_topk_decode_eager(q, w, codes, scales, bt, cl, topk)
    _, _, full = iref.indexer_topk_decode_ref(q, w, codes, scales, bt, cl, topk, return_all_scores=True)
    assert iref.check_topk(ei, ev.double(), full, lens, topk, rtol=1e-2)["ok"]
    assert (ei[1, 6:] == -1).all() and (ev[1, 6:] == np.float32(iref.MASKED)).all()


def test_sparse_mla_twins_share_one_contract():
    """The torch twin on the kernel's three pools (E4M3 codes, E8M0 byte per 128 values by the ceil rule, bf16 RoPE)
    equals the numpy twin on the same pools (kv_format mxfp8, tile 128, float rope) with identity W_UK / W_UV; a row
    with no valid index is zero in both."""
    from kimi_compile.plugins.quant.reference import mx_quantize_torch

    gen = torch.Generator().manual_seed(2)
    bs, nb, H, k = 4, 5, 2, 6
    codes, scales = mx_quantize_torch(torch.randn(nb, bs, 512, generator=gen), block=128, rounding="ceil")
    rope = torch.randn(nb, bs, 64, generator=gen).bfloat16()
    bt = torch.tensor([[3, 1, 4], [2, 0, 0]])
    idx = torch.stack([torch.randperm(12, generator=gen)[:k], torch.full((k,), -1)])[:, None]  # [B, T=1, k]
    idx[0, 0, 2] = -1
    q = torch.randn(2, 1, H, 576, generator=gen)
    scale = 576 ** -0.5
    want = mref.sparse_mla_pools_ref(q, codes, scales, rope, bt, idx, scale).numpy()
    eye = np.broadcast_to(np.eye(512, dtype=np.float32), (H, 512, 512))
    got = ops.lookup("SparseMLA").reference(
        q[..., :512].numpy(), q[..., 512:].numpy(), codes.numpy(), bt.numpy(), idx.numpy(), eye, eye, scales.numpy(),
        rope.float().numpy(), scale=scale, kv_lora_rank=512, kv_format="mxfp8", tile=128, rope_format="float")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert (got[1] == 0).all() and (want[1] == 0).all()


def test_kda_twins_share_one_contract():
    """The numpy twin (the whole op, zero conv history, no padding) equals the torch twins' fused prefill on the
    projections, then the output projection; the final states agree (same [B, H, Dk, Dv] layout)."""
    rng = np.random.default_rng(3)
    B, T, hid, H, D, W = 2, 5, 16, 2, 8, 4
    P = H * D

    def r(*s):
        return (rng.standard_normal(s) * 0.3).astype(np.float32)

    zeros = np.zeros
    f = dict(x=r(B, T, hid), conv_state=zeros((B, W - 1, 3 * P), np.float32), state=zeros((B, H, D, D), np.float32),
             lengths=np.array([T, T], np.int64), w_q=r(hid, P), w_k=r(hid, P), w_v=r(hid, P), conv_q=r(P, 1, W),
             conv_k=r(P, 1, W), conv_v=r(P, 1, W), w_f_a=r(hid, D), w_f_b=r(D, P), w_b=r(hid, H), w_g=r(hid, P),
             A_log=r(H), dt_bias=r(H, D), o_norm=r(D) + 1, w_o=r(P, hid))
    out, _, state = ops.lookup("KDA").reference(**f, lower_bound=-5.0, scale=D ** -0.5)
    t = {k: torch.from_numpy(v) for k, v in f.items()}
    x = t["x"]
    o, S = kref.kda_prefill_fused_ref(x @ t["w_q"], x @ t["w_k"], x @ t["w_v"], t["conv_q"][:, 0], t["conv_k"][:, 0],
                                      t["conv_v"][:, 0], x @ t["w_f_a"] @ t["w_f_b"], x @ t["w_b"], t["A_log"],
                                      t["dt_bias"], x @ t["w_g"], t["o_norm"], lower_bound=-5.0, scale=D ** -0.5)
    np.testing.assert_allclose((o @ t["w_o"]).numpy(), out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(S.numpy(), state, rtol=1e-4, atol=1e-5)
