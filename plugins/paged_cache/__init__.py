"""kimi.PagedWrite / kimi.PagedGather: writes to and reads from a paged cache pool (the `kimi::paged_*` primitives).

PagedWrite(pool [NB,BS,D], slots [N] int64, values [N,D]) -> pool' with rows `slots` (flat block*BS + row) replaced.
    Slot 0 is the null block's first row: padding tokens write there; no sequence owns block 0. Backends that own
    their buffers (CUDA, TensorRT) update in place; the ONNX body returns a new tensor (ScatterND).
PagedGather(pool [NB,BS,D], block_table [B,MB] int64) -> [B, MB*BS, D]: row s of sequence b is its position s.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from kimi_compile.ops import DOMAIN, ONNX_OPSET, OpDef, TensorType, register


def _const(name, vals):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))


def write_function():
    n = helper.make_node
    nodes = [
        n("Shape", ["pool"], ["pshape"]),
        _const("flat_shape", [-1, 0]),
        _const("ax1", [1]),
        n("Shape", ["pool"], ["d_shape"], start=-1),
        n("Concat", ["neg1", "d_shape"], ["flat2"], axis=0),
        n("Reshape", ["pool", "flat2"], ["flat"]),
        n("Unsqueeze", ["slots", "ax1"], ["idx"]),
        n("Reshape", ["values", "flat2"], ["vals2"]),
        n("ScatterND", ["flat", "idx", "vals2"], ["flat_out"]),
        n("Reshape", ["flat_out", "pshape"], ["out"]),
    ]
    nodes.insert(0, _const("neg1", [-1]))
    return helper.make_function(DOMAIN, "PagedWrite", ["pool", "slots", "values"], ["out"], nodes,
                                [helper.make_opsetid("", ONNX_OPSET)])


def gather_function():
    n = helper.make_node
    nodes = [
        _const("neg1", [-1]),
        n("Reshape", ["block_table", "neg1"], ["flat_bt"]),
        n("Gather", ["pool", "flat_bt"], ["blocks"], axis=0),  # [B*MB, BS, D]
        n("Shape", ["block_table"], ["b_shape"], start=0, end=1),
        n("Shape", ["pool"], ["d_shape"], start=-1),
        n("Concat", ["b_shape", "neg1", "d_shape"], ["out_shape"], axis=0),
        n("Reshape", ["blocks", "out_shape"], ["out"]),
    ]
    return helper.make_function(DOMAIN, "PagedGather", ["pool", "block_table"], ["out"], nodes,
                                [helper.make_opsetid("", ONNX_OPSET)])


def _write_ref(pool, slots, values):
    out = np.array(pool, copy=True)
    out.reshape(-1, pool.shape[-1])[np.asarray(slots).reshape(-1)] = np.asarray(values).reshape(-1, pool.shape[-1])
    return out


def _gather_ref(pool, block_table):
    B, MB = block_table.shape
    return pool[block_table.reshape(-1)].reshape(B, MB * pool.shape[1], pool.shape[2])


def _write_infer(types, attrs):
    return [TensorType(types[0].shape if types[0] else None, types[0].dtype if types[0] else TensorProto.FLOAT)]


def _gather_infer(types, attrs):
    pool, bt = types
    shape = None
    if pool and bt and pool.shape and bt.shape:
        mb, bs = bt.shape[1], pool.shape[1]
        s = mb * bs if isinstance(mb, int) and isinstance(bs, int) else None
        shape = (bt.shape[0], s, pool.shape[2])
    return [TensorType(shape, pool.dtype if pool else TensorProto.FLOAT)]


WRITE = register(OpDef("PagedWrite", ("pool", "slots", "values"), ("out",), function=write_function,
                       infer=_write_infer, reference=_write_ref, doc=__doc__))
GATHER = register(OpDef("PagedGather", ("pool", "block_table"), ("out",), function=gather_function,
                        infer=_gather_infer, reference=_gather_ref, doc=__doc__))
