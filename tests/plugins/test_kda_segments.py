"""Sequence-parallel KDA: a segment's affine state map (plugins/kda_recurrence/reference.py) composed across segments
gives the sequential recurrence's state, and each segment replayed from its true initial state gives its outputs."""

import pytest
import torch

from kimi_compile.model.primitives import kda_recurrent
from kimi_compile.plugins.kda_recurrence.reference import compose, initial_states, segment_map


def _inputs(B, T, H, D, gen):
    q = torch.randn(B, T, H, D, generator=gen) * D ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, D, generator=gen))  # the safe gate's range
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    s0 = torch.randn(B, H, D, D, generator=gen) * 0.1
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("segments", [[37], [10, 27], [5, 16, 1, 15], [64, 64, 9]])
def test_segment_maps_compose_to_the_sequential_recurrence(segments):
    gen = torch.Generator().manual_seed(len(segments))
    T = sum(segments)
    q, k, v, g, beta, s0 = _inputs(2, T, 3, 16, gen)
    o_seq, s_seq = kda_recurrent(q, k, v, g, beta, s0)
    bounds = [0]
    for n in segments:
        bounds.append(bounds[-1] + n)
    cut = lambda x, i: x[:, bounds[i]:bounds[i + 1]]  # noqa: E731
    maps = [segment_map(cut(k, i), cut(g, i), cut(beta, i), cut(v, i)) for i in range(len(segments))]
    total = maps[0]
    for m in maps[1:]:
        total = compose(m, total)
    assert torch.allclose(total[0] @ s0 + total[1], s_seq, rtol=1e-4, atol=1e-5)
    outs = []
    for i, s_in in enumerate(initial_states(maps, s0)):  # each rank replays its segment from its true state
        o, s = kda_recurrent(cut(q, i), cut(k, i), cut(v, i), cut(g, i), cut(beta, i), s_in)
        outs.append(o)
    assert torch.allclose(torch.cat(outs, 1), o_seq, rtol=1e-4, atol=1e-5)
    assert torch.allclose(s, s_seq, rtol=1e-4, atol=1e-5)


def test_a_wrong_composition_order_is_caught():
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta, s0 = _inputs(1, 20, 2, 8, gen)
    _, s_seq = kda_recurrent(q, k, v, g, beta, s0)
    m1 = segment_map(k[:, :10], g[:, :10], beta[:, :10], v[:, :10])
    m2 = segment_map(k[:, 10:], g[:, 10:], beta[:, 10:], v[:, 10:])
    wrong = compose(m1, m2)  # applies the second segment first
    assert not torch.allclose(wrong[0] @ s0 + wrong[1], s_seq, rtol=1e-3, atol=1e-4)
