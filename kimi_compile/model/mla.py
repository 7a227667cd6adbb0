"""Multi-head Latent Attention, NoPE, with the output gate (kimi_k3_spec.md §2.5); K3.1 adds the indexer.

Prefill form: k_nope and v expanded from the latent (kv_b_proj), masked softmax (the indexer's selection is a mask).
Decode form (absorbed): q_nope folded through W_UK into the 512-wide latent, MQA against the cached latent rows (only
the selected ones when indexed: a gather), output through W_UV. Both give the same numbers up to rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimi_compile.config import KimiConfig
from kimi_compile.model.common import acc, MASKED, RMSNorm, Step
from kimi_compile.model.indexer import Indexer
from kimi_compile.model.primitives import paged_gather, paged_write


class KimiMLAAttention(nn.Module):
    def __init__(self, cfg: KimiConfig, indexed: bool):
        super().__init__()
        self.cfg = cfg
        hidden, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.nope, self.rope, self.vdim = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.R = cfg.kv_lora_rank
        self.scale = cfg.q_head_dim**-0.5
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.q_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, H * cfg.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.R + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, 1e-6)
        self.kv_b_proj = nn.Linear(self.R, H * (self.nope + self.vdim), bias=False)
        if cfg.mla_use_output_gate:
            self.g_proj = nn.Linear(hidden, H * self.vdim, bias=False)
        self.o_proj = nn.Linear(H * self.vdim, hidden, bias=False)
        self.indexer = Indexer(cfg) if indexed else None

    def forward(
        self, x: Tensor, step: Step | None = None, kv_pool: Tensor | None = None, index_pool: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x [B,T,hidden] -> (out, new latent pool, new index-K pool). Without `step`: plain causal attention."""
        B, T, _ = x.shape
        H = self.num_heads
        if self.cfg.q_lora_rank is not None:
            cq = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(cq)
        else:
            cq, q = None, self.q_proj(x)
        q = q.view(B, T, H, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        ckv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat([self.kv_a_layernorm(ckv[..., : self.R]), ckv[..., self.R :]], dim=-1)  # [B,T,R+rope]
        index_k = self.indexer.keys(x) if self.indexer is not None else None

        if step is None:
            keys, index_keys = latent, index_k
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, T, T)
        else:
            slots = step.slots(T)
            kv_pool = paged_write(kv_pool, slots, latent.reshape(B * T, -1))
            keys = paged_gather(kv_pool, step.block_table)
            if index_k is not None:
                index_pool = paged_write(index_pool, slots, index_k.reshape(B * T, -1))
                index_keys = paged_gather(index_pool, step.block_table)
            allowed = step.key_allowed(T, keys.shape[1])

        decode = step is not None and step.decode
        if self.indexer is not None:
            score = self.indexer.scores(x, cq, index_keys, allowed)
            if decode:
                idx, valid = self.indexer.select(score, allowed)
                o = self._absorbed(q_nope, q_pe, keys, valid, idx.clamp(max=keys.shape[1] - 1))
            else:
                o = self._expanded(q_nope, q_pe, keys, self.indexer.mask(score, allowed))
        elif decode:
            o = self._absorbed(q_nope, q_pe, keys, allowed, None)
        else:
            o = self._expanded(q_nope, q_pe, keys, allowed)

        o = o.reshape(B, T, H * self.vdim)
        if self.cfg.mla_use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o), kv_pool, index_pool

    def _expanded(self, q_nope: Tensor, q_pe: Tensor, keys: Tensor, mask: Tensor) -> Tensor:
        """Un-absorbed attention; keys [B,S,R+rope]; mask [B,T,S] -> [B,T,H,v]."""
        B, S, _ = keys.shape
        kv = self.kv_b_proj(keys[..., : self.R]).view(B, S, self.num_heads, self.nope + self.vdim)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k_pe = keys[..., self.R :]
        score = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + torch.einsum("bthd,bsd->bhts", q_pe, k_pe)
        score = (acc(score) * self.scale).masked_fill(~mask.unsqueeze(1), MASKED)
        p = torch.softmax(score, dim=-1).to(v.dtype)
        return torch.einsum("bhts,bshd->bthd", p, v)

    def _absorbed(self, q_nope: Tensor, q_pe: Tensor, keys: Tensor, mask: Tensor, idx: Tensor | None) -> Tensor:
        """MQA over the latent: keys [B,S,R+rope]; idx [B,T,k] selects rows (mask then [B,T,k]) -> [B,T,H,v]."""
        B, T, H, _ = q_nope.shape
        w = self.kv_b_proj.weight.view(H, self.nope + self.vdim, self.R)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)  # [B,T,H,R]
        if idx is None:
            c, pe = keys[..., : self.R], keys[..., self.R :]
            score = torch.einsum("bthr,bsr->bhts", q_lat, c) + torch.einsum("bthd,bsd->bhts", q_pe, pe)
            score = (acc(score) * self.scale).masked_fill(~mask.unsqueeze(1), MASKED)
            p = torch.softmax(score, dim=-1).to(c.dtype)
            o_lat = torch.einsum("bhts,bsr->bthr", p, c)
        else:
            k = idx.shape[-1]
            sel = torch.gather(keys.unsqueeze(1).expand(B, T, *keys.shape[1:]), 2,
                               idx.unsqueeze(-1).expand(B, T, k, keys.shape[-1]))  # [B,T,k,R+rope]
            c, pe = sel[..., : self.R], sel[..., self.R :]
            score = torch.einsum("bthr,btkr->bhtk", q_lat, c) + torch.einsum("bthd,btkd->bhtk", q_pe, pe)
            score = (acc(score) * self.scale).masked_fill(~mask.unsqueeze(1), MASKED)
            p = torch.softmax(score, dim=-1).to(c.dtype)
            o_lat = torch.einsum("bhtk,btkr->bthr", p, c)
        return torch.einsum("bthr,hvr->bthv", o_lat, w_uv)
