"""cuda backend kernels for the paged-cache primitives: torch index ops, on any device, writes in place."""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel

_BYTES = (torch.float8_e4m3fn, torch.float8_e5m2)  # index ops move their bytes (torch has no float8 index kernels)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _BYTES else t


def paged_write(x, a):
    """pool [NB, BS, D] <- rows `slots` (flat block * BS + row) of values [N, D], in place; returns the pool."""
    pool, slots, values = x
    d = pool.shape[-1]
    _raw(pool).view(-1, d).index_copy_(0, slots.reshape(-1), _raw(values.to(pool.dtype)).reshape(-1, d))
    return (pool,)


def paged_gather(x, a):
    """pool [NB, BS, D], block_table [B, MB] -> [B, MB * BS, D]: row s of sequence b is its position s."""
    pool, bt = x
    B, MB = bt.shape
    rows = _raw(pool).index_select(0, bt.reshape(-1)).reshape(B, MB * pool.shape[1], *pool.shape[2:])
    return (rows.view(pool.dtype),)


CUDA = {
    "PagedWrite": Kernel(paged_write, devices=("cuda", "cpu"), inplace={0: 0}, name="torch.index_copy_"),
    "PagedGather": Kernel(paged_gather, devices=("cuda", "cpu"), name="torch.index_select"),
}
