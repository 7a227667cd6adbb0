"""kimi.PagedWrite / kimi.PagedGather: the numpy oracle (semantics in __init__.py)."""

from __future__ import annotations

import numpy as np


def paged_write(pool, slots, values):
    out = np.array(pool, copy=True)
    out.reshape(-1, pool.shape[-1])[np.asarray(slots).reshape(-1)] = np.asarray(values).reshape(-1, pool.shape[-1])
    return out


def paged_gather(pool, block_table):
    B, MB = block_table.shape
    return pool[block_table.reshape(-1)].reshape(B, MB * pool.shape[1], pool.shape[2])
