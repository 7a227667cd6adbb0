"""Latent MoE (kimi_k3_spec.md §2.6): sigmoid router with correction bias (selection only), renormalised top-k,
routed experts in the latent (down-proj, experts, weighted sum, RMSNorm, up-proj), plus shared experts on x.

Routed expert weights are held stacked, `experts.w1/w3` [E, I, latent] and `experts.w2` [E, latent, I]; the checkpoint
stores them per expert (`experts.{e}.w1.weight`, ...), mapped by weights.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimi_compile.config import KimiConfig
from kimi_compile.model.common import acc, GatedMLP, RMSNorm, activation


class Router(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, hidden] -> (expert ids [N, k], weights [N, k] fp32)."""
        cfg = self.cfg
        s = torch.sigmoid(acc(x) @ acc(self.weight).t())
        choice = s + acc(self.e_score_correction_bias)
        if cfg.num_expert_group > 1:  # keep the topk_group groups with the best top-2 sums
            N = choice.shape[0]
            grouped = choice.view(N, cfg.num_expert_group, -1)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score).scatter(-1, group_score.topk(cfg.topk_group, dim=-1).indices, 1.0)
            choice = (grouped * keep.unsqueeze(-1)).view(N, -1)
        idx = torch.topk(choice, cfg.num_experts_per_token, dim=-1).indices
        w = torch.gather(s, -1, idx)
        if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * cfg.routed_scaling_factor


class Experts(nn.Module):
    def __init__(self, cfg: KimiConfig, dim: int):
        super().__init__()
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.w1 = nn.Parameter(torch.empty(E, inter, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(E, inter, dim))  # up
        self.w2 = nn.Parameter(torch.empty(E, dim, inter))  # down

    def forward(self, z: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """z [N, dim], idx/w [N, k] -> sum_k w_k * w2_e(act(w3_e z, w1_e z)) [N, dim], accumulated in fp32."""
        gate = torch.einsum("nd,nkid->nki", z, self.w1[idx])
        up = torch.einsum("nd,nkid->nki", z, self.w3[idx])
        h = activation(self.cfg, up, gate)
        y = torch.einsum("nki,nkdi->nkd", h, self.w2[idx])
        return (acc(y) * w.unsqueeze(-1)).sum(1).to(z.dtype)


class LatentMoE(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        hidden, latent = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg, latent or hidden)
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(hidden, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, hidden, bias=False)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, hidden, cfg.moe_intermediate_size * cfg.num_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.gate(x)
        latent = self.cfg.routed_expert_hidden_size is not None
        z = self.routed_expert_down_proj(x) if latent else x
        y = self.experts(z, idx, w)
        if latent:
            if self.cfg.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(x)
        return y.reshape(shape)
