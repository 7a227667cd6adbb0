"""The collectives' numpy oracle: at world size 1 each is the identity. With more ranks a collective has no
single-process meaning; the reference refuses, naming what runs it (the cuda backend over torch.distributed)."""

from __future__ import annotations

import numpy as np


def _identity(name: str):
    def ref(x, world=1, **_attrs):
        if int(world) != 1:
            raise ValueError(f"kimi.{name} over {world} ranks has no single-process reference: run the artifact's "
                             "ranks together on the cuda backend (torch.distributed; torchrun -m kimi_compile run)")
        return np.asarray(x)
    ref.__name__ = name
    return ref


all_reduce = _identity("AllReduce")
all_gather = _identity("AllGather")
reduce_scatter = _identity("ReduceScatter")
all_to_all = _identity("AllToAll")
