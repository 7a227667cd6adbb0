"""cuda backend kernels of the context-parallel KDA ops, around the functions of reference.py (GEMMs, the conv, the
window and state bookkeeping):
  map     on a GPU one fla-core chunk_kda call over the augmented state: initial state [I | 0] and values [0 | v]
          (Dk + Dv columns) give [A | B] as the final state, since every column of the state runs its own linear
          recurrence; on the CPU, and for float32 activations (plugins/kda/cuda.py `fla_chunk_applies`), the
          reference model's chunked form in float32;
  replay  the kimi.KDA kernel (plugins/kda/cuda.py: chunk_kda on a GPU) from each piece's true window and state.
Meta tensors (the build's shape-only runs) get outputs of the right shapes."""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel
from kimi_compile.plugins.kda.cuda import fla_chunk_applies

from . import reference


def _meta(*shapes):
    return tuple(torch.empty(s, dtype=torch.float32, device="meta") for s in shapes)


def conv_tail(x, a):
    h, lengths, w_q, w_k, w_v, conv_q = x
    W = conv_q.shape[-1]
    if h.device.type == "meta":
        return _meta((h.shape[0], W - 1, 3 * conv_q.shape[0]))
    return (reference.conv_tail(h, lengths, w_q, w_k, w_v, W),)


def chunk_recurrence(q, k, v, g, beta, state):
    """(o, final state) of the gated delta rule by fla-core's chunk_kda (GPU), state fp32, not modified."""
    from fla.ops.kda import chunk_kda

    return chunk_kda(q.to(v.dtype), k.to(v.dtype), v, g.float(), beta.float(), scale=1.0,
                     initial_state=state.float().contiguous(), output_final_state=True)


def segment_map(x, a):
    h, conv_q, A_log = x[0], x[8], x[14]
    H = A_log.numel()
    D = conv_q.shape[0] // H
    if h.device.type == "meta":
        return _meta((h.shape[0], H, D, 2 * D))
    fla = h.is_cuda and fla_chunk_applies(h.dtype)  # float32: the chunked form in torch (FP32 GEMMs)
    return (reference.segment_map_op(*x, a, recurrence=chunk_recurrence if fla else None),)


def segment_replay(x, a):
    h, conv_state, state = x[0], x[1], x[2]
    if h.device.type == "meta":
        return _meta(h.shape, conv_state.shape, state.shape)
    return reference.replay(*x, a)


_DEVICES = ("cuda", "cpu")
CUDA = {
    "KDAConvTail": Kernel(conv_tail, devices=_DEVICES, name="torch.kda_conv_tail"),
    "KDASegmentMap": Kernel(segment_map, devices=_DEVICES, name="fla.chunk_kda_augmented"),
    "KDASegmentReplay": Kernel(segment_replay, devices=_DEVICES, name="kda.fla_chunk_replay"),
}
