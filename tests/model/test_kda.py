import pytest
import torch

from kimi_compile.model.primitives import kda_chunked, kda_recurrent
from tests.conftest import rel


def _inputs(B, T, H, K, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype) * K**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    gate = -5 * torch.rand(B, T, H, K, generator=g, dtype=dtype)  # safe-gate range (-5, 0)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    s0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("T, chunk", [(1, 16), (15, 16), (37, 16), (64, 16), (70, 64)])
def test_chunked_equals_recurrent(T, chunk):
    args = _inputs(2, T, 3, 16, 8, torch.float64, seed=T)
    o1, s1 = kda_recurrent(*args)
    o2, s2 = kda_chunked(*args, chunk_size=chunk)
    assert o2.shape == o1.shape
    assert rel(o2, o1) < 1e-12 and rel(s2, s1) < 1e-12
    o3, s3 = kda_chunked(*(a.float() for a in args), chunk_size=chunk)
    assert rel(o3, o1) < 1e-5 and rel(s3, s1) < 1e-5


def test_state_carries_over_between_calls():
    q, k, v, g, b, s0 = _inputs(1, 40, 2, 8, 8, torch.float64, seed=1)
    o_all, s_all = kda_chunked(q, k, v, g, b, s0, chunk_size=16)
    o1, s1 = kda_chunked(q[:, :23], k[:, :23], v[:, :23], g[:, :23], b[:, :23], s0, chunk_size=16)
    o2, s2 = kda_recurrent(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], b[:, 23:], s1)
    assert rel(torch.cat([o1, o2], 1), o_all) < 1e-12 and rel(s2, s_all) < 1e-12


def test_decay_and_delta_semantics_single_step():
    # one step from a known state, written out by hand
    q, k, v, g, b, s0 = _inputs(1, 1, 1, 4, 3, torch.float64, seed=2)
    S = s0[0, 0] * g[0, 0, 0].exp().unsqueeze(-1)
    kk = k[0, 0, 0]
    S = S + b[0, 0, 0] * torch.outer(kk, v[0, 0, 0] - S.t() @ kk)
    o, s = kda_recurrent(q, k, v, g, b, s0)
    assert torch.allclose(s[0, 0], S) and torch.allclose(o[0, 0, 0], S.t() @ q[0, 0, 0])
