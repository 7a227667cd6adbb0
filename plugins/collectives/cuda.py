"""cuda backend kernels of the collectives: torch.distributed calls on the group the node names (gloo on CPU, NCCL on
GPU; no home-made transport). World size 1 is the identity; meta tensors (the build's shape-only runs) get outputs
of the right shape and no communication."""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel

from . import groups


def _group(a: dict):
    import torch.distributed as dist

    g = groups.get(a["group"])
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"kimi collective over {a['world']} ranks (group {a['group']!r}): torch.distributed is not "
                           "initialized; start the ranks with torchrun -m kimi_compile run, or "
                           "kimi_compile.backends.cuda.distributed.init()")
    size = dist.get_world_size(g)
    if size != int(a["world"]):
        raise RuntimeError(f"kimi collective: the graph was partitioned for {a['world']} ranks in group "
                           f"{a['group']!r}, the process group has {size}")
    return g


def _call(new: str, old: str):
    import torch.distributed as dist

    return getattr(dist, new, None) or getattr(dist, old)


def _moved(shape, axis: int, factor: float) -> tuple:
    s = list(shape)
    s[axis] = int(s[axis] * factor)
    return tuple(s)


def all_reduce(x, a):
    (t,) = x
    if int(a["world"]) == 1:
        return (t,)
    if t.device.type == "meta":
        return (torch.empty_like(t),)
    import torch.distributed as dist

    out = t.contiguous().clone()
    dist.all_reduce(out, group=_group(a))
    return (out,)


def all_gather(x, a):
    (t,) = x
    w = int(a["world"])
    if w == 1:
        return (t,)
    axis = int(a["axis"]) % t.dim()
    if t.device.type == "meta":
        return (torch.empty(_moved(t.shape, axis, w), dtype=t.dtype, device="meta"),)
    src = t.contiguous()
    buf = torch.empty((w * src.shape[0], *src.shape[1:]), dtype=t.dtype, device=t.device)  # rank chunks on dim 0
    _call("all_gather_single", "all_gather_into_tensor")(buf, src, group=_group(a))
    if axis == 0:
        return (buf,)
    return (buf.view(w, *src.shape).movedim(0, axis).reshape(_moved(t.shape, axis, w)),)


def reduce_scatter(x, a):
    (t,) = x
    w = int(a["world"])
    if w == 1:
        return (t,)
    axis = int(a["axis"]) % t.dim()
    if t.shape[axis] % w:
        raise ValueError(f"kimi.ReduceScatter: axis {axis} of shape {list(t.shape)} does not split over {w} ranks")
    if t.device.type == "meta":
        return (torch.empty(_moved(t.shape, axis, 1 / w), dtype=t.dtype, device="meta"),)
    src = t.movedim(axis, 0).contiguous()
    out = torch.empty((src.shape[0] // w, *src.shape[1:]), dtype=t.dtype, device=t.device)
    _call("reduce_scatter_single", "reduce_scatter_tensor")(out, src, group=_group(a))
    return (out.movedim(0, axis).contiguous(),)


def all_to_all(x, a):
    (t,) = x
    w = int(a["world"])
    if w == 1:
        return (t,)
    s, c = int(a["split_axis"]) % t.dim(), int(a["concat_axis"]) % t.dim()
    shape = _moved(_moved(t.shape, s, 1 / w), c, w)
    if t.device.type == "meta":
        return (torch.empty(shape, dtype=t.dtype, device="meta"),)
    import torch.distributed as dist

    src = t.movedim(s, 0).contiguous()
    out = torch.empty_like(src)
    dist.all_to_all_single(out, src, group=_group(a))
    chunks = [c_.movedim(0, s) for c_ in out.chunk(w, 0)]  # chunk j came from rank j
    return (torch.cat(chunks, dim=c).contiguous(),)


_DEVICES = ("cuda", "cpu")
CUDA = {
    "AllReduce": Kernel(all_reduce, devices=_DEVICES, name="torch.distributed.all_reduce"),
    "AllGather": Kernel(all_gather, devices=_DEVICES, name="torch.distributed.all_gather"),
    "ReduceScatter": Kernel(reduce_scatter, devices=_DEVICES, name="torch.distributed.reduce_scatter"),
    "AllToAll": Kernel(all_to_all, devices=_DEVICES, name="torch.distributed.all_to_all"),
}
