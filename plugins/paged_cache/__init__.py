"""kimi.PagedWrite / kimi.PagedGather: writes to and reads from a paged cache pool (the `kimi::paged_*` primitives).

PagedWrite(pool [NB,BS,D], slots [N] int64, values [N,D]) -> pool' with rows `slots` (flat block*BS + row) replaced.
    Slot 0 is the null block's first row: padding tokens write there; no sequence owns block 0. Backends that own
    their buffers (CUDA, TensorRT) update in place; the ONNX body returns a new tensor (ScatterND).
PagedGather(pool [NB,BS,D], block_table [B,MB] int64) -> [B, MB*BS, D]: row s of sequence b is its position s.
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference


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


WRITE = register(OpDef("PagedWrite", ("pool", "slots", "values"), ("out",), function=body.paged_write,
                       infer=_write_infer, reference=reference.paged_write, doc=__doc__, kind="primitive"))
GATHER = register(OpDef("PagedGather", ("pool", "block_table"), ("out",), function=body.paged_gather,
                        infer=_gather_infer, reference=reference.paged_gather, doc=__doc__, kind="primitive"))
