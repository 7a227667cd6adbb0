"""kimi.MatMulNZ's Triton kernel reads the NZ blocks directly and equals x @ W (GPU only; skips without CUDA)."""

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("Triton kernel tests need a CUDA GPU", allow_module_level=True)

from kimi_compile.plugins.matmul_nz import triton as tnz  # noqa: E402
from kimi_compile.plugins.matmul_nz.reference import nd_to_nz_torch  # noqa: E402


@pytest.mark.parametrize("M, K, N", [(1, 7168, 1536), (32, 1536, 18432), (200, 100, 30), (5, 130, 17)])
def test_matches_plain_matmul(M, K, N):
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(K, N, device="cuda", generator=g) / K**0.5).bfloat16()
    w_nz = nd_to_nz_torch(w).contiguous()
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = tnz.matmul_nz(x, w_nz, K, N, out=out)
    ref = x.double() @ w.double()
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2
