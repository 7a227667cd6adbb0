"""Context-parallel KDA ops (plugins/kda_cp) against the kimi.KDA kernel on whole sequences, in one process: every
rank's pieces built with kimi_compile/cp_layout.py, the all-gathers done by concatenating the ranks' tensors in rank
order. Ragged lengths not divisible by the chunk count, chunks shorter than the conv window and empty ones."""

import pytest
import torch

from kimi_compile import cp_layout
from kimi_compile.plugins.kda.cuda import kda
from kimi_compile.plugins.kda_cp import cuda as cp

HID, H, D, W = 24, 2, 8, 4
P_ = H * D
ATTRS = {"lower_bound": -5.0, "scale": D ** -0.5, "l2_eps": 1e-6, "eps": 1e-5, "chunk_size": 64}


def _weights(gen, hid=HID, H=H, D=D):
    r = lambda *s, sc=0.3: torch.randn(*s, generator=gen) * sc  # noqa: E731
    P = H * D
    return [r(hid, P), r(hid, P), r(hid, P), r(P, 1, W), r(P, 1, W), r(P, 1, W), r(hid, D), r(D, P), r(hid, H),
            r(hid, P), r(H, sc=0.5), r(H, D, sc=0.5), 1 + r(D, sc=0.1), r(P, hid)]


def _run_cp(x, conv0, s0, lengths, wts, world, layout, attrs=ATTRS):
    """The three ops on every simulated rank (tensors on x's device); returns per rank (out, new_conv, new_state,
    rows' lengths)."""
    B, HID, dev = x.shape[0], x.shape[-1], x.device
    n = cp_layout.chunks(world, layout)
    bounds = [cp_layout.bounds(int(L), world, layout) for L in lengths]
    Tl = max(2, max(b - a for bs in bounds for a, b in bs))
    ranks = []
    for r in range(world):
        mine = cp_layout.rank_chunks(world, layout, r)
        xs = torch.zeros(len(mine) * B, Tl, HID, device=dev)
        lens = torch.zeros(len(mine) * B, dtype=torch.int64, device=dev)
        for j, c in enumerate(mine):
            for b in range(B):
                a, e = bounds[b][c]
                xs[j * B + b, : e - a] = x[b, a:e]
                lens[j * B + b] = e - a
        idx = torch.arange(B, device=dev).repeat(len(mine))
        ranks.append((xs, lens, conv0[idx].clone(), s0[idx].clone()))
    assert n == sum(len(cp_layout.rank_chunks(world, layout, r)) for r in range(world))
    prep, (w_g, A_log, dt_bias, o_norm, w_o) = wts[:9], wts[9:]
    tails = torch.cat([cp.conv_tail((xs, lens, *wts[:3], wts[3]), {})[0] for xs, lens, _, _ in ranks])
    lens_all = torch.cat([lens for _, lens, _, _ in ranks])
    out = []
    a_ = [{**attrs, "world": world, "layout": layout, "rank": r} for r in range(world)]
    maps = torch.cat([cp.segment_map((xs, cs, lens, tails, lens_all, *prep, A_log, dt_bias), a_[r])[0]
                      for r, (xs, lens, cs, _) in enumerate(ranks)])
    for r, (xs, lens, cs, ss) in enumerate(ranks):
        o, c_, s_ = cp.segment_replay((xs, cs, ss, lens, tails, lens_all, maps, *prep, w_g, A_log, dt_bias, o_norm,
                                       w_o), a_[r])
        out.append((o, c_, s_, lens))
    return out, bounds


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (2, "contiguous"), (3, "zigzag"), (4, "zigzag")])
def test_context_parallel_kda_equals_the_sequential_layer(world, layout):
    gen = torch.Generator().manual_seed(world)
    lengths = torch.tensor([13, 7, 2, 1])  # 13, 7 not divisible by 2P; 2 and 1: most chunks empty
    B, T = len(lengths), int(lengths.max())
    x = torch.randn(B, T, HID, generator=gen)
    conv0 = torch.randn(B, W - 1, 3 * P_, generator=gen) * 0.5  # a prefill continuing earlier tokens
    s0 = torch.randn(B, H, D, D, generator=gen) * 0.1
    wts = _weights(gen)
    ref_out, ref_conv, ref_state = kda((x, conv0.clone(), s0.clone(), lengths, *wts), ATTRS)
    ranks, bounds = _run_cp(x, conv0, s0, lengths, wts, world, layout)
    got = torch.zeros_like(ref_out)
    for r, (o, c_, s_, lens) in enumerate(ranks):
        mine = cp_layout.rank_chunks(world, layout, r)
        for j, c in enumerate(mine):
            for b in range(B):
                a, e = bounds[b][c]
                got[b, a:e] = o[j * B + b, : e - a]
                # every piece row carries its sequence's state after the prefill
                torch.testing.assert_close(c_[j * B + b], ref_conv[b], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(s_[j * B + b], ref_state[b], rtol=1e-4, atol=1e-5)
    valid = torch.arange(T)[None, :] < lengths[:, None]
    err = (got - ref_out)[valid].norm() / ref_out[valid].norm()
    assert err < 1e-5, err


def test_without_the_true_initial_state_it_differs():
    """The replay must start from the composed state: feeding zero maps (every piece from the sequence's initial
    state) gives wrong outputs, so the test above would catch a missing prefix combine."""
    world, layout = 2, "zigzag"
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([9])
    x = torch.randn(1, 9, HID, generator=gen)
    conv0, s0 = torch.zeros(1, W - 1, 3 * P_), torch.zeros(1, H, D, D)
    wts = _weights(gen)
    ref_out, _, _ = kda((x, conv0.clone(), s0.clone(), lengths, *wts), ATTRS)
    prep, (w_g, A_log, dt_bias, o_norm, w_o) = wts[:9], wts[9:]
    ranks, bounds = _run_cp(x, conv0, s0, lengths, wts, world, layout)
    # rank 1 holds chunks 1 and 2; replay it with identity maps instead of the gathered ones
    xs = torch.zeros(2, 3, HID)
    lens = torch.tensor([bounds[0][1][1] - bounds[0][1][0], bounds[0][2][1] - bounds[0][2][0]])
    for j, c in enumerate((1, 2)):
        a, e = bounds[0][c]
        xs[j, : e - a] = x[0, a:e]
    eye = torch.cat([torch.eye(D).expand(4, H, D, D), torch.zeros(4, H, D, D)], -1)
    tails = torch.zeros(4, W - 1, 3 * P_)
    o, _, _ = cp.segment_replay((xs, conv0.repeat(2, 1, 1), s0.repeat(2, 1, 1, 1), lens, tails,
                                 torch.tensor([2, 0, 2, 2]), eye, *prep, w_g, A_log, dt_bias, o_norm, w_o),
                                {**ATTRS, "world": world, "layout": layout, "rank": 1})
    a, e = bounds[0][1]
    assert not torch.allclose(o[0, : e - a], ref_out[0, a:e], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(ranks[1][0][0, : e - a], ref_out[0, a:e], rtol=1e-4, atol=1e-5)


def test_fused_weights_die_with_their_parts():
    """plugins/kda/cuda.py `_cat_once`: a weight set's concatenation is made once while its parts live, and a later
    miss drops the entries of parts that died (a session unloaded), so a process that loads sessions in turn holds
    only the live sessions' concatenations."""
    import gc

    from kimi_compile.plugins.kda import cuda as kcuda

    parts = [torch.randn(4, 3), torch.randn(4, 3)]
    first = kcuda._cat_once(parts, 1)
    assert kcuda._cat_once(parts, 1) is first and torch.equal(first, torch.cat(parts, 1))
    assert kcuda._cat_once(parts, 0) is not first  # the dim is part of the key
    dead = (*map(id, parts), 1)
    del parts, first
    gc.collect()
    other = [torch.randn(2, 3), torch.randn(5, 3)]
    assert torch.equal(kcuda._cat_once(other, 0), torch.cat(other, 0))
    assert dead not in kcuda._FUSED
    assert all(r() is not None for refs, _ in kcuda._FUSED.values() for r in refs)
