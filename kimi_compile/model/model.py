"""The Kimi K3 / K3.1 text model (kimi_k3_spec.md §2): decoder layers (KDA or MLA, dense MLP or latent MoE) wired
by Block Attention Residuals, the final mix, norm and LM head. Plus the explicit inference cache and prefill/decode.

Module names follow the HF checkpoint so that `"language_model." + state_dict key` is the published name, except
where weights.py maps (stacked experts, the AttnRes proj/norm pairs, the padded A_log).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kimi_compile.config import KimiConfig
from kimi_compile.paged import BlockAllocator
from kimi_compile.model.attn_res import AttnResMix
from kimi_compile.model.common import GatedMLP, RMSNorm, Step
from kimi_compile.model.kda import KimiDeltaAttention
from kimi_compile.model.mla import KimiMLAAttention
from kimi_compile.model.moe import LatentMoE


@dataclasses.dataclass
class LayerCache:
    """Cache tensors of one layer: KDA (conv window, recurrent state) or MLA (latent pool, optional index-K pool)."""

    conv: Tensor | None = None
    state: Tensor | None = None
    kv: Tensor | None = None
    index: Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiConfig, i: int):
        super().__init__()
        self.cfg, self.idx = cfg, i
        self.is_kda = cfg.is_kda(i)
        self.self_attn = KimiDeltaAttention(cfg) if self.is_kda else KimiMLAAttention(cfg, cfg.has_indexer(i))
        if cfg.is_moe(i):
            self.block_sparse_moe = LatentMoE(cfg)
        else:
            self.mlp = GatedMLP(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_res = cfg.attn_res_block_size is not None
        if self.attn_res:
            self.self_attention_res = AttnResMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_res = AttnResMix(cfg.hidden_size, cfg.rms_norm_eps)
            self.block_start = i % cfg.attn_res_block_size == 0

    def _attn(self, x: Tensor, step: Step | None, cache: LayerCache | None) -> tuple[Tensor, LayerCache | None]:
        if self.is_kda:
            out, conv, state = self.self_attn(x, step, cache.conv if cache else None, cache.state if cache else None)
            return out, LayerCache(conv=conv, state=state)
        out, kv, index = self.self_attn(x, step, cache.kv if cache else None, cache.index if cache else None)
        return out, LayerCache(kv=kv, index=index)

    def _ffn(self, x: Tensor) -> Tensor:
        return self.block_sparse_moe(x) if self.cfg.is_moe(self.idx) else self.mlp(x)

    def forward(
        self, partial: Tensor, bank: list[Tensor], step: Step | None, cache: LayerCache | None
    ) -> tuple[Tensor, list[Tensor], LayerCache | None]:
        if not self.attn_res:  # plain pre-norm residual
            a, cache = self._attn(self.input_layernorm(partial), step, cache)
            h = partial + a
            return h + self._ffn(self.post_attention_layernorm(h)), bank, cache
        h = self.self_attention_res(bank, partial)
        if self.block_start:  # freeze the finished block (layer 0: the embedding)
            bank = [*bank, partial]
        a, cache = self._attn(self.input_layernorm(h), step, cache)
        partial = a if self.block_start else partial + a
        h = self.mlp_res(bank, partial)
        return partial + self._ffn(self.post_attention_layernorm(h)), bank, cache


class TextModel(nn.Module):
    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res = AttnResMix(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: Tensor, step: Step | None = None, caches: Sequence[LayerCache] | None = None
    ) -> tuple[Tensor, list[LayerCache | None]]:
        partial = self.embed_tokens(input_ids)
        bank: list[Tensor] = []
        new_caches: list[LayerCache | None] = []
        for i, layer in enumerate(self.layers):
            partial, bank, c = layer(partial, bank, step, caches[i] if caches is not None else None)
            new_caches.append(c)
        h = self.output_attn_res(bank, partial) if self.cfg.attn_res_block_size is not None else partial
        return self.norm(h), new_caches


class KimiK3ForCausalLM(nn.Module):
    """`model(input_ids)` -> logits [B, T, vocab] (full causal forward, no cache).

    With a cache: `prefill(input_ids, cache)` and `decode(token_ids, cache)` (see KimiCache).
    """

    def __init__(self, cfg: KimiConfig):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        h, _ = self.model(input_ids)
        return self.lm_head(h)

    def forward_step(self, input_ids: Tensor, step: Step, caches: Sequence[LayerCache]) -> tuple[Tensor, list]:
        """One cached step over B sequences (T new tokens each, ragged through step.lengths)."""
        h, new = self.model(input_ids, step, caches)
        return self.lm_head(h), new

    # ---- cached inference -------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: Tensor | Sequence[Sequence[int]], cache: "KimiCache",
                lengths: Tensor | Sequence[int] | None = None) -> Tensor:
        """Append prompts (or prompt chunks) to the cache. input_ids [B, T] right-padded (`lengths` gives the valid
        counts) or a list of B token lists. Returns logits [B, T, vocab]; rows past a sequence's length are padding."""
        ids, lens = _as_batch(input_ids, lengths, self.config.vocab_size)
        return self._step(ids, lens, cache, decode=False)

    @torch.no_grad()
    def decode(self, token_ids: Tensor | Sequence[int], cache: "KimiCache") -> Tensor:
        """One new token per sequence: token_ids [B] (or [B, 1]) -> logits [B, vocab]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1, 1)
        return self._step(ids, torch.ones(ids.shape[0], dtype=torch.long), cache, decode=True)[:, 0]

    def _step(self, ids: Tensor, lens: Tensor, cache: "KimiCache", decode: bool) -> Tensor:
        if ids.shape[0] != cache.batch_size:
            raise ValueError(f"input_ids: batch {ids.shape[0]} does not match the cache's batch {cache.batch_size}")
        cache.reserve(cache.seq_lens + lens)
        step = Step(cache.seq_lens.clone(), lens, cache.block_table, cache.block_size, decode, cache.kda_chunk)
        logits, new = self.forward_step(ids, step, cache.layers)
        cache.layers = new
        cache.seq_lens = cache.seq_lens + lens
        return logits


def _as_batch(input_ids, lengths, vocab: int) -> tuple[Tensor, Tensor]:
    if isinstance(input_ids, Tensor):
        ids = input_ids.long()
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        lens = torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long) if lengths is None else \
            torch.as_tensor(lengths, dtype=torch.long)
    else:
        rows = [list(r) for r in input_ids]
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    if lens.shape != (ids.shape[0],) or bool((lens < 0).any()) or bool((lens > ids.shape[1]).any()):
        raise ValueError(f"lengths: expected {ids.shape[0]} values in 0..{ids.shape[1]}, got {lens.tolist()}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"input_ids: token ids must lie in 0..{vocab - 1}")
    return ids, lens


class KimiCache:
    """Explicit inference state for B sequences: paged MLA latent KV and index-K pools (block 0 is the null block),
    block tables, KDA conv windows and recurrent states, per-sequence lengths."""

    def __init__(self, cfg: KimiConfig, batch_size: int, max_seq_len: int, block_size: int = 16,
                 num_blocks: int | None = None, dtype: torch.dtype = torch.float32, kda_chunk: int = 64):
        self.cfg, self.batch_size, self.block_size, self.kda_chunk = cfg, batch_size, block_size, kda_chunk
        self.blocks = BlockAllocator(batch_size, max_seq_len, block_size, num_blocks)
        self.max_blocks, self.num_blocks = self.blocks.max_blocks, self.blocks.num_blocks
        self.block_table = torch.from_numpy(self.blocks.block_table)  # shares memory with the allocator's table
        self.seq_lens = torch.zeros(batch_size, dtype=torch.long)
        P, W = cfg.kda_proj_dim, cfg.short_conv_kernel_size
        self.layers: list[LayerCache] = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda(i):
                self.layers.append(LayerCache(
                    conv=torch.zeros(batch_size, W - 1, 3 * P, dtype=dtype),
                    state=torch.zeros(batch_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim,
                                      dtype=torch.float64 if dtype == torch.float64 else torch.float32)))
            else:
                idx = torch.zeros(self.num_blocks, block_size, cfg.index_head_dim, dtype=dtype) \
                    if cfg.has_indexer(i) else None
                self.layers.append(LayerCache(kv=torch.zeros(self.num_blocks, block_size, cfg.latent_dim, dtype=dtype),
                                              index=idx))

    def reserve(self, new_lens: Tensor) -> None:
        """Allocate blocks so that sequence b can hold new_lens[b] tokens."""
        self.blocks.reserve(new_lens.numpy())
