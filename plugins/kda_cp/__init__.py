"""Context-parallel KDA (issue 18; docs/context_parallel.md): a kimi.KDA layer of a prefill split along the sequence
over `world` ranks, exactly. passes/partition_cp.py replaces each kimi.KDA node of a rank's prefill graph by

    tail  = kimi.KDAConvTail(x, lengths, w_q, w_k, w_v, conv_q)            # [R, W-1, 3P]: last pre-conv inputs
    tails = kimi.AllGather(tail)        lens = kimi.AllGather(lengths)      # every rank's pieces, rank order
    map   = kimi.KDASegmentMap(x, conv_state, lengths, tails, lens, ...)    # [R, H, Dk, Dk+Dv]: S -> A S + B
    maps  = kimi.AllGather(map)
    out, new_conv_state, new_state = kimi.KDASegmentReplay(x, conv_state, state, lengths, tails, lens, maps, ...)

A rank's rows are its pieces (kimi_compile/cp_layout.py: piece-major, zigzag or contiguous), each row's conv_state
and state inputs its sequence's before the prefill. KDASegmentMap computes its pieces' affine state maps from their
true conv windows (the sequence's window advanced by the tails of the earlier chunks); KDASegmentReplay applies the
maps of the earlier chunks in order to the initial state (the prefix combine) and replays its pieces from their true
window and state with the kimi.KDA kernel; new_conv_state / new_state are the sequence's after its last chunk.
Semantics in reference.py. Attrs: world, rank, layout (the partition), and kimi.KDA's (lower_bound, scale, l2_eps,
eps, chunk_size). Kind "partition": per-rank graphs only (no ONNX body; ONNX Runtime refuses those artifacts).
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import reference

KDA_ATTRS = {"lower_bound": -5.0, "scale": 1.0, "l2_eps": 1e-6, "eps": 1e-5, "chunk_size": 0}
ATTRS = {"world": 1, "rank": 0, "layout": "zigzag", **KDA_ATTRS}
PREP = ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_f_a", "w_f_b", "w_b")
TAIL_IN = ("x", "lengths", "w_q", "w_k", "w_v", "conv_q")
MAP_IN = ("x", "conv_state", "lengths", "tails", "lengths_all", *PREP, "A_log", "dt_bias")
REPLAY_IN = ("x", "conv_state", "state", "lengths", "tails", "lengths_all", "maps", *PREP, "w_g", "A_log", "dt_bias",
             "o_norm", "w_o")


def _dim(t, i):
    return t.shape[i] if t is not None and t.shape is not None and len(t.shape) > i else None


def _infer_tail(types, attrs):
    x, conv_q = types[0], types[5]
    P, W = _dim(conv_q, 0), _dim(conv_q, 2)
    return [TensorType((_dim(x, 0), None if W is None else W - 1, None if P is None else 3 * P), TensorProto.FLOAT)]


def _infer_map(types, attrs):
    x, conv_q, A_log = types[0], types[8], types[14]
    P, H = _dim(conv_q, 0), _dim(A_log, 0)
    D = P // H if isinstance(P, int) and isinstance(H, int) else None
    return [TensorType((_dim(x, 0), H, D, None if D is None else 2 * D), TensorProto.FLOAT)]


def _infer_replay(types, attrs):
    x, conv_state, state = types[0], types[1], types[2]
    return [TensorType(x.shape if x else None, x.dtype if x else TensorProto.FLOAT),  # as kimi.KDA's
            TensorType(conv_state.shape if conv_state else None, conv_state.dtype if conv_state else TensorProto.FLOAT),
            TensorType(state.shape if state else None, TensorProto.FLOAT)]


CONV_TAIL = register(OpDef("KDAConvTail", TAIL_IN, ("tail",), dict(ATTRS), infer=_infer_tail,
                           reference=reference.kda_conv_tail, doc=__doc__, kind="partition"))
SEGMENT_MAP = register(OpDef("KDASegmentMap", MAP_IN, ("map",), dict(ATTRS), infer=_infer_map,
                             reference=reference.kda_segment_map, doc=__doc__, kind="partition",
                             float32_ports=frozenset({"map"})))
SEGMENT_REPLAY = register(OpDef("KDASegmentReplay", REPLAY_IN, ("out", "new_conv_state", "new_state"), dict(ATTRS),
                                infer=_infer_replay, reference=reference.kda_segment_replay, doc=__doc__,
                                kind="partition", float32_ports=frozenset({"state", "maps", "new_state"})))
