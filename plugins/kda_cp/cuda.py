"""cuda backend kernels of the context-parallel KDA ops: the torch functions of reference.py (GEMMs, the conv, the
chunked delta rule of the reference model for the maps, the kimi.KDA kernel for the replay). Meta tensors (the
build's shape-only runs) get outputs of the right shapes. Not Triton kernels yet (docs/context_parallel.md)."""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel

from . import reference


def _meta(*shapes):
    return tuple(torch.empty(s, dtype=torch.float32, device="meta") for s in shapes)


def conv_tail(x, a):
    h, lengths, w_q, w_k, w_v, conv_q = x
    W = conv_q.shape[-1]
    if h.device.type == "meta":
        return _meta((h.shape[0], W - 1, 3 * conv_q.shape[0]))
    return (reference.conv_tail(h, lengths, w_q, w_k, w_v, W),)


def segment_map(x, a):
    h, conv_q, A_log = x[0], x[8], x[14]
    H = A_log.numel()
    D = conv_q.shape[0] // H
    if h.device.type == "meta":
        return _meta((h.shape[0], H, D, 2 * D))
    return (reference.segment_map_op(*x, a),)


def segment_replay(x, a):
    h, conv_state, state = x[0], x[1], x[2]
    if h.device.type == "meta":
        return _meta(h.shape, conv_state.shape, state.shape)
    return reference.replay(*x, a)


_DEVICES = ("cuda", "cpu")
CUDA = {
    "KDAConvTail": Kernel(conv_tail, devices=_DEVICES, name="torch.kda_conv_tail"),
    "KDASegmentMap": Kernel(segment_map, devices=_DEVICES, name="torch.kda_segment_map"),
    "KDASegmentReplay": Kernel(segment_replay, devices=_DEVICES, name="torch.kda_segment_replay+kda"),
}
