"""Context-parallel KDA kernels on a GPU (skipped without CUDA and fla-core): the segment map by one chunk_kda call over
the augmented state, composed over segments, equals the sequential recurrence; the three ops on simulated ranks equal
the kimi.KDA kernel on whole sequences, at the small preset's head size (128)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("context-parallel KDA GPU kernels need a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla", reason="the GPU segment map runs fla-core's chunk_kda")

from kimi_compile.model.primitives import kda_recurrent  # noqa: E402
from kimi_compile.plugins.kda.cuda import kda  # noqa: E402
from kimi_compile.plugins.kda_cp.cuda import chunk_recurrence  # noqa: E402
from kimi_compile.plugins.kda_recurrence.reference import initial_states, segment_map  # noqa: E402
from tests.conftest import rel  # noqa: E402
from tests.plugins.test_kda_cp import ATTRS, _run_cp, _weights  # noqa: E402

# fla-core's chunk kernels multiply float32 operands in TF32 (10-bit mantissa): its own forward against the float64
# recurrence is about 1e-3 relative at these sizes, and the map is the same kernel, so the bound is that kernel's
BOUND = 5e-3


def _inputs(gen, B, T, H, D):
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen, device="cuda"), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen, device="cuda")
    g = -torch.rand(B, T, H, D, generator=gen, device="cuda") * 0.2
    beta = torch.rand(B, T, H, generator=gen, device="cuda")
    return k, g, beta, v


@pytest.mark.parametrize("segments", [[300], [64, 129, 7], [1, 250, 50]])
def test_gpu_segment_maps_compose_to_the_sequential_recurrence(segments):
    gen = torch.Generator(device="cuda").manual_seed(len(segments))
    B, T, H, D = 2, sum(segments), 4, 128
    k, g, beta, v = _inputs(gen, B, T, H, D)
    s0 = torch.randn(B, H, D, D, generator=gen, device="cuda") * 0.1
    _, want = kda_recurrent(torch.zeros_like(k).double(), k.double(), v.double(), g.double(), beta.double(),
                            s0.double())
    cuts = [sum(segments[:i]) for i in range(len(segments) + 1)]
    maps = [segment_map(*(t[:, a:e] for t in (k, g, beta, v)), recurrence=chunk_recurrence)
            for a, e in zip(cuts, cuts[1:])]
    starts = initial_states(maps, s0)
    A, Bm = maps[-1]
    got = A @ starts[-1] + Bm
    assert rel(got, want) < BOUND
    # the map is affine: a second initial state through the same maps gives that state's sequential result
    s1 = torch.randn_like(s0)
    _, want1 = kda_recurrent(torch.zeros_like(k).double(), k.double(), v.double(), g.double(), beta.double(),
                             s1.double())
    got1 = s1
    for A_, B_ in maps:
        got1 = A_ @ got1 + B_
    assert rel(got1, want1) < BOUND


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (4, "zigzag"), (2, "contiguous")])
def test_gpu_context_parallel_kda_equals_the_whole_layer(world, layout):
    gen = torch.Generator().manual_seed(world)
    hid, H, D = 256, 2, 128
    lengths = torch.tensor([301, 77, 2, 1])  # not divisible by 2P; the short rows leave chunks empty
    B, T = len(lengths), int(lengths.max())
    W = 4
    x = torch.randn(B, T, hid, generator=gen)
    conv0 = torch.randn(B, W - 1, 3 * H * D, generator=gen) * 0.5
    s0 = torch.randn(B, H, D, D, generator=gen) * 0.1
    wts = _weights(gen, hid, H, D)
    attrs = {**ATTRS, "scale": D ** -0.5}
    cuda = lambda t: t.cuda()  # noqa: E731
    ref_out, ref_conv, ref_state = kda((x, conv0.clone(), s0.clone(), lengths, *wts), attrs)  # CPU float32
    ranks, bounds = _run_cp(*map(cuda, (x, conv0, s0, lengths)), [cuda(w) for w in wts], world, layout, attrs)
    from kimi_compile import cp_layout

    got = torch.zeros_like(ref_out)
    for r, (o, c_, s_, _) in enumerate(ranks):
        for j, c in enumerate(cp_layout.rank_chunks(world, layout, r)):
            for b in range(B):
                a, e = bounds[b][c]
                got[b, a:e] = o[j * B + b, : e - a].cpu()
                assert rel(c_[j * B + b].cpu(), ref_conv[b]) < 1e-6  # windows are copies: exact up to GEMM order
                assert rel(s_[j * B + b].cpu(), ref_state[b]) < BOUND
    valid = torch.arange(T)[None, :] < lengths[:, None]
    assert rel(got[valid], ref_out[valid]) < BOUND
