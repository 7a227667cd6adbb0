"""K3.1 lightning indexer (MODEL.md): per query, score every visible key and keep the index_topk best.

    q_I = wq_b(cq) [T, n, d]            (cq: the MLA q latent after q_a_layernorm)
    k_I = LayerNorm(wk(x)) [T, d]       (one key head shared by all index heads; cached per token)
    w   = weights_proj(x) * n^-0.5 * d^-0.5
    I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s])      for visible s
    selected(t) = the min(index_topk, #visible) highest I[t, .], ties to the lower position
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimi_compile.config import KimiConfig
from kimi_compile.model.common import acc, MASKED, topk_stable


class Indexer(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        n, d = cfg.index_n_heads, cfg.index_head_dim
        assert n and d and cfg.q_lora_rank and cfg.index_topk
        self.n_heads, self.head_dim, self.topk = n, d, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, n * d, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, n, bias=False)

    def keys(self, x: Tensor) -> Tensor:
        """k_I [B, T, d] for the new tokens (what the index-K cache stores)."""
        return F.layer_norm(acc(self.wk(x)), (self.head_dim,), acc(self.k_norm.weight), acc(self.k_norm.bias),
                            1e-6).to(x.dtype)

    def scores(self, x: Tensor, cq: Tensor, keys: Tensor, allowed: Tensor) -> Tensor:
        """I [B, T, S] in fp32, MASKED where a key is not visible."""
        B, T, _ = x.shape
        q = acc(self.wq_b(cq).view(B, T, self.n_heads, self.head_dim))
        w = acc(self.weights_proj(x)) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        logits = torch.relu(torch.einsum("bthd,bsd->bths", q, acc(keys)))  # [B, T, n, S]
        score = (logits * w.unsqueeze(-1)).sum(dim=2)
        return score.masked_fill(~allowed, MASKED)

    def select(self, score: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
        """Top index_topk positions per query: (indices [B,T,k] int64, valid [B,T,k]).

        The score row is padded with index_topk masked columns so k is a constant; a selected index is valid when it
        points at a visible key (fewer than k visible keys -> the rest are invalid). Invalid indices may point past S.
        """
        B, T, S = score.shape
        padded = torch.cat([score, score.new_full((B, T, self.topk), MASKED)], dim=-1)
        _, idx = topk_stable(padded, self.topk)
        allowed_p = torch.cat([allowed, allowed.new_zeros(B, T, self.topk)], dim=-1)
        return idx, torch.gather(allowed_p, -1, idx)

    def mask(self, score: Tensor, allowed: Tensor) -> Tensor:
        """[B, T, S] bool: key s is among the selected positions of query t (the prefill form)."""
        B, T, S = score.shape
        idx, valid = self.select(score, allowed)
        sel = torch.zeros(B, T, S + self.topk, dtype=torch.bool, device=score.device).scatter(-1, idx, valid)
        return sel[..., :S] & allowed
