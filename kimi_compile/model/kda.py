"""Kimi Delta Attention (kimi_k3_spec.md §2.4): short convs, L2-normalised q/k, safe gate, beta, gated delta rule,
per-head RMSNorm times the sigmoid output gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimi_compile.config import KimiConfig
from kimi_compile.model.common import acc, RMSNorm, Step
from kimi_compile.model.primitives import kda_recurrence


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        H, D, hidden = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
        P, W = H * D, cfg.short_conv_kernel_size
        self.num_heads, self.head_dim, self.conv_size = H, D, W
        self.q_proj = nn.Linear(hidden, P, bias=False)
        self.k_proj = nn.Linear(hidden, P, bias=False)
        self.v_proj = nn.Linear(hidden, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj = nn.Linear(hidden, D, bias=False)
        self.f_b_proj = nn.Linear(D, P, bias=False)
        self.b_proj = nn.Linear(hidden, H, bias=False)
        if cfg.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, D, bias=False)
            self.g_b_proj = nn.Linear(D, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.o_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(P, hidden, bias=False)

    def _conv(self, u: Tensor, conv: nn.Conv1d, state: Tensor | None, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
        """Causal depthwise conv + SiLU over [state ‖ u]; returns the output and the new window (last W-1 inputs)."""
        B, T, C = u.shape
        if state is None:
            state = u.new_zeros(B, self.conv_size - 1, C)
        x = torch.cat([state, u], dim=1)  # [B, W-1+T, C]
        y = F.silu(F.conv1d(x.transpose(1, 2), conv.weight, groups=C).transpose(1, 2))
        if lengths is None:
            new_state = x[:, T:]
        else:  # ragged batch: the window ends at each sequence's last valid token
            rows = lengths.view(B, 1) + torch.arange(self.conv_size - 1, device=u.device).view(1, -1)
            new_state = torch.gather(x, 1, rows.unsqueeze(-1).expand(B, self.conv_size - 1, C))
        return y, new_state

    def gate(self, x: Tensor) -> Tensor:
        """Log-decay g [B,T,H,D] in fp32: safe gate lb*sigmoid(exp(A_log)*(f+dt_bias)), or -exp(A_log)*softplus(..)."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        f = acc(self.f_b_proj(self.f_a_proj(x))).view(B, T, H, D) + acc(self.dt_bias).view(H, D)
        a = acc(self.A_log).exp().view(H, 1)
        if self.cfg.gate_lower_bound is not None:
            return self.cfg.gate_lower_bound * torch.sigmoid(a * f)
        return -a * F.softplus(f)

    def forward(
        self, x: Tensor, step: Step | None = None, conv_state: Tensor | None = None, state: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [B,T,hidden] -> (out, new conv window [B, W-1, 3P] (q‖k‖v), new recurrent state [B,H,D,D] fp32)."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        P = H * D
        lengths = step.lengths if step is not None else None
        cs = [None, None, None] if conv_state is None else list(conv_state.split(P, dim=-1))
        q, cq = self._conv(self.q_proj(x), self.q_conv1d, cs[0], lengths)
        k, ck = self._conv(self.k_proj(x), self.k_conv1d, cs[1], lengths)
        v, cv = self._conv(self.v_proj(x), self.v_conv1d, cs[2], lengths)
        q = acc(q.view(B, T, H, D))
        k = acc(k.view(B, T, H, D))
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * D**-0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        g = self.gate(x)
        beta = torch.sigmoid(acc(self.b_proj(x)))
        if step is not None:  # padding rows leave the state untouched: no decay, no write
            valid = step.valid(T)
            g = g * valid.view(B, T, 1, 1)
            beta = beta * valid.view(B, T, 1)
        if state is None:
            state = x.new_zeros(B, H, D, D, dtype=q.dtype)
        chunk = 0 if (step is not None and step.decode) else (step.kda_chunk if step is not None else 64)
        o, new_state = kda_recurrence(q, k, v.view(B, T, H, D).to(q.dtype), g, beta, state, chunk)
        gate = self.g_proj(x) if self.cfg.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(gate.view(B, T, H, D))
        return self.o_proj(o.reshape(B, T, P)), torch.cat([cq, ck, cv], dim=-1), new_state
