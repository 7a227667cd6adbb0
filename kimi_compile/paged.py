"""The paged block allocator shared by the reference model's KimiCache and the runtime (numpy, no torch).

Pools are `[num_blocks, block_size, ...]`; block 0 is the null block (padding rows write there; no sequence owns it).
Sequence b's position s lives in block `block_table[b, s // block_size]`, row `s % block_size`. Blocks are taken
from the free list as sequences grow (`reserve`) and returned when they shrink (`truncate`: speculative rollback,
or a finished request).
"""

from __future__ import annotations

import math

import numpy as np


class CacheCapacityError(ValueError):
    """A request does not fit the cache: too many tokens for a sequence, or no free block left."""


class BlockAllocator:
    def __init__(self, batch_size: int, max_seq_len: int, block_size: int, num_blocks: int | None = None):
        if batch_size < 1 or max_seq_len < 1 or block_size < 1:
            raise ValueError(f"BlockAllocator: batch_size, max_seq_len and block_size must be >= 1, got "
                             f"{batch_size}, {max_seq_len}, {block_size}")
        self.batch_size, self.block_size = batch_size, block_size
        self.max_blocks = max(1, math.ceil(max_seq_len / block_size))
        self.num_blocks = num_blocks or batch_size * self.max_blocks + 1
        self.block_table = np.zeros((batch_size, self.max_blocks), dtype=np.int64)
        self.blocks_used = [0] * batch_size
        self.free = list(range(self.num_blocks - 1, 0, -1))
        self.seq_lens = np.zeros(batch_size, dtype=np.int64)

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold."""
        return self.max_blocks * self.block_size

    def reserve(self, new_lens) -> None:
        """Take blocks so that sequence b can hold new_lens[b] tokens."""
        for b, n in enumerate(np.asarray(new_lens).tolist()):
            need = math.ceil(n / self.block_size)
            if need > self.max_blocks:
                raise CacheCapacityError(f"sequence {b}: {n} tokens exceed max_seq_len ({self.capacity}) of this "
                                         "cache")
            while self.blocks_used[b] < need:
                if not self.free:
                    raise CacheCapacityError("out of cache blocks: create the cache with a larger num_blocks")
                self.block_table[b, self.blocks_used[b]] = self.free.pop()
                self.blocks_used[b] += 1

    def truncate(self, b: int, n_tokens: int) -> int:
        """Shrink sequence b to its first n_tokens tokens, returning blocks it no longer needs; -> blocks freed."""
        if not 0 <= n_tokens <= int(self.seq_lens[b]):
            raise ValueError(f"truncate: sequence {b} holds {int(self.seq_lens[b])} tokens, cannot keep {n_tokens}")
        need = math.ceil(n_tokens / self.block_size)
        freed = 0
        while self.blocks_used[b] > need:
            self.blocks_used[b] -= 1
            self.free.append(int(self.block_table[b, self.blocks_used[b]]))
            self.block_table[b, self.blocks_used[b]] = 0
            freed += 1
        self.seq_lens[b] = n_tokens
        return freed
