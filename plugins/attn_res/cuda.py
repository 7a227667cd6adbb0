"""cuda backend kernels for Block Attention Residuals: the two stages as fp32 torch compositions (any device)."""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def stage1(x, a):
    """bank [K,B,T,D], queries [L,D] -> o1 [L,B,T,D], m1 [L,B,T], l1 [L,B,T] (semantics: plugins/attn_res)."""
    bank, queries = x
    b = bank.float()
    s = torch.einsum("kbtd,ld->lkbt", b, queries.float()) * _inv_rms(b, a["eps"]).unsqueeze(0)
    m1 = s.amax(1)
    e = torch.exp(s - m1.unsqueeze(1))
    o1 = torch.einsum("lkbt,kbtd->lbtd", e, b)
    return o1.to(bank.dtype), m1, e.sum(1)


def merge(x, a):
    """o1, m1, l1 (stage 1), partial [B,T,D], query [D], norm_weight [D] -> RMSNorm(mix) [B,T,D]."""
    o1, m1, l1, partial, query, norm_w = x
    slot = a["slot"]
    p = partial.float()
    sp = (p @ query.float()) * _inv_rms(p, a["eps"])
    m = torch.maximum(m1[slot], sp)
    e1, ep = torch.exp(m1[slot] - m), torch.exp(sp - m)
    mix = (o1[slot].float() * e1.unsqueeze(-1) + p * ep.unsqueeze(-1)) / (l1[slot] * e1 + ep).unsqueeze(-1)
    y = mix * _inv_rms(mix, a["norm_eps"]).unsqueeze(-1) * norm_w.float()
    return (y.to(partial.dtype),)


CUDA = {
    "AttnResStage1": Kernel(stage1, devices=("cuda", "cpu"), name="torch.attn_res_stage1"),
    "AttnResMerge": Kernel(merge, devices=("cuda", "cpu"), name="torch.attn_res_merge"),
}
