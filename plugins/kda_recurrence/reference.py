"""kimi.KDARecurrence: the oracle is the reference model's torch recurrences (kimi_compile.model.primitives: the
recurrent form, or the chunked form when chunk_size > 0), on numpy inputs; outputs (o, final_state) as numpy."""

from __future__ import annotations


def kda_recurrence(q, k, v, g, beta, state, chunk_size=0):
    import torch

    from kimi_compile.model.primitives import kda_chunked, kda_recurrent

    args = [torch.as_tensor(x) for x in (q, k, v, g, beta, state)]
    o, s = kda_chunked(*args, chunk_size) if chunk_size else kda_recurrent(*args)
    return o.numpy(), s.numpy()
