"""Small building blocks shared by the layers: RMSNorm, SiTU, the gated MLP, step metadata, stable top-k."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from kimi_compile.config import KimiConfig

MASKED = -1e30  # finite "minus infinity": a fully masked row stays finite instead of turning into NaN


def acc(x: Tensor) -> Tensor:
    """Accumulation precision: fp32, or fp64 when the model runs in fp64 (tests separate rounding from bugs)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    """w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back before the weight (HF KimiRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = acc(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def situ(up: Tensor, gate: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU: beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) if linear_beta else up), fp32."""
    g = acc(gate)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    u = acc(up)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(up.dtype)


def activation(cfg: KimiConfig, up: Tensor, gate: Tensor) -> Tensor:
    if cfg.hidden_act == "silu":
        return nn.functional.silu(gate) * up
    return situ(up, gate, cfg.activation_situ_beta or 1.0, cfg.activation_situ_linear_beta)


class GatedMLP(nn.Module):
    """down_proj(act(up_proj x, gate_proj x)): the dense layer-0 MLP and the shared experts."""

    def __init__(self, cfg: KimiConfig, hidden: int, inter: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(activation(self.cfg, self.up_proj(x), self.gate_proj(x)))


def topk_stable(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Largest k along the last dim, ties broken towards the lower index (ONNX TopK's documented rule).

    Eager mode sorts stably to guarantee the rule; under export it is a plain TopK, which has the same semantics.
    """
    if torch.compiler.is_exporting():
        return torch.topk(x, k, dim=-1, largest=True, sorted=True)
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


@dataclasses.dataclass
class Step:
    """Where the T new tokens of each of the B sequences sit: the caches are read and written through this.

    start [B]: tokens already cached; lengths [B]: valid new tokens (rows t >= lengths[b] are padding);
    block_table [B, MB] int64 (entries past a sequence's blocks point at the null block 0); block_size;
    decode: use the decode forms (recurrent KDA, absorbed MLA with a gather of the selected positions).
    """

    start: Tensor
    lengths: Tensor
    block_table: Tensor
    block_size: int
    decode: bool = False
    kda_chunk: int = 64

    def positions(self, T: int) -> Tensor:
        return self.start.unsqueeze(1) + torch.arange(T, device=self.start.device).unsqueeze(0)

    def valid(self, T: int) -> Tensor:
        return torch.arange(T, device=self.start.device).unsqueeze(0) < self.lengths.unsqueeze(1)

    def slots(self, T: int) -> Tensor:
        """Flat pool row of every new token, [B*T]; padding rows go to the null slot 0."""
        pos = self.positions(T)
        col = (pos // self.block_size).clamp(max=self.block_table.shape[1] - 1)
        blk = torch.gather(self.block_table, 1, col)
        slot = blk * self.block_size + pos % self.block_size
        return torch.where(self.valid(T), slot, torch.zeros_like(slot)).reshape(-1)

    def key_allowed(self, T: int, S: int) -> Tensor:
        """[B, T, S]: key position s is visible to query row t (causal and within the sequence)."""
        s = torch.arange(S, device=self.start.device).view(1, 1, S)
        qpos = self.positions(T).unsqueeze(-1)
        end = (self.start + self.lengths).view(-1, 1, 1)
        return (s <= qpos) & (s < end)
