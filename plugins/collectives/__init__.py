"""Collectives over the ranks of a partitioned artifact (passes/partition_tp.py inserts them; DESIGN.md §3
"Parallelism"). Each rank's graph holds explicit collective nodes; the cuda backend runs them over torch.distributed
(gloo on CPU, NCCL on GPU; plugins/collectives/cuda.py). At world size 1 each is the identity (its ONNX body and its
reference), so a partitioned graph of one rank still runs anywhere.

kimi.AllReduce      x -> y = sum over the group's ranks of x (same shape)
kimi.AllGather      x -> y = the ranks' x concatenated along `axis` in rank order (y.shape[axis] = world * x's)
kimi.ReduceScatter  x -> y = chunk `rank` along `axis` of the sum over ranks of x (y.shape[axis] = x's / world)
kimi.AllToAll       x -> y: x split into `world` chunks along `split_axis`, chunk j sent to rank j; the chunks each
                    rank receives concatenated in rank order along `concat_axis`
Attrs    group (name of the process group: "tp"), world (its size); axis / split_axis / concat_axis (may be negative)
"""

from __future__ import annotations

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference

_DOC = __doc__


def _scaled(types, axis: int, factor: float) -> list[TensorType]:
    x = types[0]
    if x is None or x.shape is None:
        return [TensorType(None, x.dtype if x else 1)]
    shape = list(x.shape)
    a = axis % len(shape)
    d = shape[a]
    shape[a] = int(d * factor) if isinstance(d, int) else None
    return [TensorType(tuple(shape), x.dtype)]


def _same(types, attrs):
    x = types[0]
    return [TensorType(x.shape if x else None, x.dtype if x else 1)]


def _gather(types, attrs):
    return _scaled(types, int(attrs.get("axis", 0)), int(attrs.get("world", 1)))


def _scatter(types, attrs):
    return _scaled(types, int(attrs.get("axis", 0)), 1 / int(attrs.get("world", 1)))


def _all_to_all(types, attrs):
    w, s, c = int(attrs.get("world", 1)), int(attrs.get("split_axis", 0)), int(attrs.get("concat_axis", 0))
    out = _scaled(types, s, 1 / w)
    return _scaled(out, c, w) if out[0].shape is not None else out


def _op(name: str, infer, ref) -> OpDef:
    return register(OpDef(name, body.INPUTS, body.OUTPUTS, dict(body.ATTRS[name]), function=body.identity(name),
                          infer=infer, reference=ref, doc=_DOC, kind="primitive"))


ALL_REDUCE = _op("AllReduce", _same, reference.all_reduce)
ALL_GATHER = _op("AllGather", _gather, reference.all_gather)
REDUCE_SCATTER = _op("ReduceScatter", _scatter, reference.reduce_scatter)
ALL_TO_ALL = _op("AllToAll", _all_to_all, reference.all_to_all)
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")
