"""Block Attention Residuals (kimi_k3_spec.md §2.2-2.3): each sublayer input is a softmax mix over the bank (the
embedding and the finished block sums) and the running partial sum of the current block.

    w_eff  = norm_w * proj_w                      (fp32)
    s_k    = (v_k . w_eff) / sqrt(mean(v_k^2) + eps)
    out    = sum_k softmax_k(s)_k * v_k           (logits on RMS-normalised rows, mix of the raw rows)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimi_compile.model.common import acc, RMSNorm


class AttnResMix(nn.Module):
    """One mixing point: holds `<name>_res_proj` ([1, hidden]) and `<name>_res_norm` ([hidden])."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden, 1, bias=False)
        self.norm = RMSNorm(hidden, eps)

    def forward(self, bank: list[Tensor], partial: Tensor) -> Tensor:
        if not bank:
            return partial
        eps = self.norm.eps
        w_eff = acc(self.norm.weight) * acc(self.proj.weight).reshape(-1)
        sources = acc(torch.stack([*bank, partial], dim=0))  # [K, B, T, hidden]
        logits = (sources @ w_eff) * torch.rsqrt(sources.pow(2).mean(-1) + eps)  # [K, B, T]
        alpha = torch.softmax(logits, dim=0)
        return (alpha.unsqueeze(-1) * sources).sum(0).to(partial.dtype)
