"""Session over a built artifact: paged cache pools and block tables (block 0 = null block), KDA states, ragged
batches, greedy or seeded sampling."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kimi_compile.artifact import ArtifactError, load_manifest


class RuntimeInputError(ValueError):
    pass


class CacheState:
    """Cache tensors of one batch, laid out as the graphs' cache inputs (`manifest["runtime"]["caches"]`)."""

    def __init__(self, caches: list[dict], batch_size: int, max_seq_len: int, block_size: int,
                 num_blocks: int | None = None):
        self.batch_size, self.block_size = batch_size, block_size
        self.max_blocks = max(1, math.ceil(max_seq_len / block_size))
        self.num_blocks = num_blocks or batch_size * self.max_blocks + 1
        self.block_table = np.zeros((batch_size, self.max_blocks), dtype=np.int64)
        self.blocks_used = [0] * batch_size
        self.free = list(range(self.num_blocks - 1, 0, -1))
        self.seq_lens = np.zeros(batch_size, dtype=np.int64)
        self.names = [c["name"] for c in caches]
        self.tensors: dict[str, np.ndarray] = {}
        for c in caches:
            shape = [batch_size if d == "batch" else self.num_blocks if d == "num_blocks" else d for d in c["shape"]]
            self.tensors[c["name"]] = np.zeros(shape, dtype=np.dtype(c["dtype"]))

    def reserve(self, new_lens: np.ndarray) -> None:
        for b, n in enumerate(new_lens.tolist()):
            need = math.ceil(n / self.block_size)
            if need > self.max_blocks:
                raise RuntimeInputError(f"sequence {b}: {n} tokens exceed max_seq_len "
                                        f"({self.max_blocks * self.block_size}) of this cache")
            while self.blocks_used[b] < need:
                if not self.free:
                    raise RuntimeInputError("out of cache blocks: create the cache with a larger num_blocks")
                self.block_table[b, self.blocks_used[b]] = self.free.pop()
                self.blocks_used[b] += 1

    @property
    def bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class Session:
    def __init__(self, artifact_dir: str | Path, threads: int | None = None):
        from kimi_compile import backends

        self.dir = Path(artifact_dir)
        self.manifest = load_manifest(self.dir)
        rt = self.manifest.get("runtime")
        if not isinstance(rt, dict):
            raise ArtifactError(self.dir, "manifest has no 'runtime' section", "manifest.json")
        self.runtime = rt
        self.block_size = int(rt["block_size"])
        self.vocab_size = int(rt["vocab_size"])
        self.eos_token_id = rt.get("eos_token_id")
        self.backend = backends.get(self.manifest["backend"]["name"]).load(self.dir, self.manifest, threads=threads)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> CacheState:
        return CacheState(self.runtime["caches"], batch_size, max_seq_len or int(self.runtime["max_seq_len"]),
                          self.block_size)

    def _check_ids(self, rows: Sequence[Sequence[int]]) -> None:
        for b, r in enumerate(rows):
            for t in r:
                if not (isinstance(t, (int, np.integer)) and 0 <= int(t) < self.vocab_size):
                    raise RuntimeInputError(f"prompt {b}: token id {t!r} is not in 0..{self.vocab_size - 1}")

    def _run(self, phase: str, ids: np.ndarray, lens: np.ndarray, cache: CacheState) -> np.ndarray:
        cache.reserve(cache.seq_lens + lens)
        feeds = {"input_ids": ids.astype(np.int64), "start": cache.seq_lens.copy(), "lengths": lens.astype(np.int64),
                 "block_table": cache.block_table, **cache.tensors}
        out = self.backend.run(phase, feeds)
        for name in cache.names:
            cache.tensors[name] = out[name + ".out"]
        cache.seq_lens = cache.seq_lens + lens
        return out["logits"]

    def prefill(self, prompts: Sequence[Sequence[int]], cache: CacheState) -> np.ndarray:
        """Append B prompts (any lengths >= 1) to the cache; returns all logits [B, T, vocab] (rows past a prompt's
        length are padding)."""
        if len(prompts) != cache.batch_size:
            raise RuntimeInputError(f"prompts: {len(prompts)} given, cache holds {cache.batch_size} sequences")
        if any(len(p) == 0 for p in prompts):
            raise RuntimeInputError("prompts: every prompt needs at least one token")
        self._check_ids(prompts)
        T = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), max(T, 2)), dtype=np.int64)  # the prefill graph takes T >= 2
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = p
        lens = np.array([len(p) for p in prompts], dtype=np.int64)
        return self._run("prefill", ids, lens, cache)[:, :T]

    def decode(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        """One token per sequence -> logits [B, vocab]."""
        self._check_ids([tokens])
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        return self._run("decode", ids, np.ones(ids.shape[0], dtype=np.int64), cache)[:, 0]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, seed: int | None = None, stop_at_eos: bool = True) -> list[list[int]]:
        """Greedy (temperature 0) or seeded sampling for a batch of prompts of different lengths."""
        if max_new_tokens < 0:
            raise RuntimeInputError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
        prompts = [list(p) for p in prompts]
        cache = self.new_cache(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
        rng = np.random.default_rng(seed)
        logits = self.prefill(prompts, cache)
        last = np.stack([logits[b, len(p) - 1] for b, p in enumerate(prompts)])
        out: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), dtype=bool)
        for step in range(max_new_tokens):
            nxt = self._pick(last, temperature, top_k, rng)
            for b in range(len(prompts)):
                if not done[b]:
                    out[b].append(int(nxt[b]))
                    if stop_at_eos and self.eos_token_id is not None and nxt[b] == self.eos_token_id:
                        done[b] = True
            if done.all() or step == max_new_tokens - 1:
                break
            last = self.decode(nxt.tolist(), cache)
        return out

    @staticmethod
    def _pick(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> np.ndarray:
        if temperature <= 0:
            return logits.argmax(-1)
        z = logits.astype(np.float64) / temperature
        if top_k:
            kth = np.sort(z, axis=-1)[:, -top_k][:, None]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.array([rng.choice(p.shape[-1], p=row) for row in p])


def load(artifact_dir: str | Path, **kwargs) -> Session:
    return Session(artifact_dir, **kwargs)
