"""Standard ONNX ops (default domain, opset 23) as torch functions: the one table the cuda backend lowers them by.

Each entry is `fn(inputs, attrs) -> tuple of outputs`, with ONNX semantics (broadcasting, negative axes, optional
inputs as None). Integer shape arithmetic (Shape, Range, Concat of shapes, ...) runs on whatever device its inputs
are on; the executor keeps such small tensors on the CPU when they feed shape arguments. `VIEWS` are the ops whose
output may share storage with input 0 (the memory plan extends that buffer's life instead of giving them one).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

import onnx_ir as ir

DTYPES: dict[int, torch.dtype] = {
    ir.DataType.FLOAT.value: torch.float32, ir.DataType.FLOAT16.value: torch.float16,
    ir.DataType.BFLOAT16.value: torch.bfloat16, ir.DataType.DOUBLE.value: torch.float64,
    ir.DataType.INT64.value: torch.int64, ir.DataType.INT32.value: torch.int32, ir.DataType.INT16.value: torch.int16,
    ir.DataType.INT8.value: torch.int8, ir.DataType.UINT8.value: torch.uint8, ir.DataType.BOOL.value: torch.bool,
    ir.DataType.FLOAT8E4M3FN.value: torch.float8_e4m3fn, ir.DataType.FLOAT8E5M2.value: torch.float8_e5m2,
}
F8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def torch_dtype(dt: ir.DataType | int) -> torch.dtype:
    code = dt.value if isinstance(dt, ir.DataType) else int(dt)
    if code not in DTYPES:
        raise NotImplementedError(f"cuda backend: ONNX element type {ir.DataType(code).name} is not supported")
    return DTYPES[code]


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


def _ints(t: torch.Tensor | None) -> list[int]:
    return [] if t is None else [int(v) for v in t.reshape(-1).tolist()]


# ---- elementwise --------------------------------------------------------------------------------------------------

def _binary(f: Callable) -> Callable:
    return lambda x, a: (f(x[0], x[1]),)


def _unary(f: Callable) -> Callable:
    return lambda x, a: (f(x[0]),)


def _div(x, a):
    p, q = x
    if p.dtype.is_floating_point:
        return (p / q,)
    return (torch.div(p, q, rounding_mode="trunc"),)


def _mod(x, a):
    if a.get("fmod", 0):
        return (torch.fmod(x[0], x[1]),)
    return (torch.remainder(x[0], x[1]),)


def _pow(x, a):
    base, e = x  # the exponent is a host constant (HOST_INPUTS): read without a device sync
    if e.numel() == 1 and e.dtype.is_floating_point and float(e.reshape(-1)[0]) == 2.0:
        return (base * base,)
    if e.numel() == 1:
        return (torch.pow(base, e.reshape(()).item()),)
    return (torch.pow(base, e.to(base.device, base.dtype) if base.dtype.is_floating_point else e.to(base.device)),)


def _clip(x, a):
    y = x[0]
    lo = x[1] if len(x) > 1 else None
    hi = x[2] if len(x) > 2 else None
    if lo is not None:
        y = torch.maximum(y, lo.to(y.dtype))
    if hi is not None:
        y = torch.minimum(y, hi.to(y.dtype))
    return (y,)


def _where(x, a):
    c, p, q = x
    return (torch.where(c, p, q),)


def _cast_source(v: torch.Tensor, t: torch.dtype, a) -> torch.Tensor:
    """What Cast converts to dtype t: saturated for float8, bool as uint8 for floats."""
    if t in F8_MAX and a.get("saturate", 1):
        m = F8_MAX[t]
        v = v.float().clamp(-m, m)  # ONNX saturate: out-of-range finite values go to the largest code
    if v.dtype == torch.bool and t.is_floating_point:
        v = v.to(torch.uint8)
    return v


def _cast(x, a):
    t = torch_dtype(a["to"])
    return (_cast_source(x[0], t, a).to(t),)


# ---- shape ops ----------------------------------------------------------------------------------------------------

def _shape(x, a):
    s = list(x[0].shape)
    start, end = a.get("start", 0), a.get("end", None)
    return (torch.tensor(s[slice(start, end)], dtype=torch.int64),)


def _reshape(x, a):
    data, shape = x[0], _ints(x[1])
    if not a.get("allowzero", 0):
        shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return (data.reshape(shape),)


def _squeeze(x, a):
    axes = _ints(x[1]) if len(x) > 1 and x[1] is not None else None
    if axes is None:
        return (x[0].squeeze(),)
    r = x[0].dim()
    return (x[0].squeeze(tuple(_axis(i, r) for i in axes)),)


def _unsqueeze(x, a):
    y = x[0]
    axes = sorted(_axis(i, y.dim() + len(_ints(x[1]))) for i in _ints(x[1]))
    for ax in axes:
        y = y.unsqueeze(ax)
    return (y,)


def _concat(x, a):
    parts = [t for t in x if t is not None]
    dev = next((t.device for t in parts if t.device.type != "cpu"), parts[0].device)
    return (torch.cat([t.to(dev) for t in parts], dim=a["axis"]),)


def _slice(x, a):
    data = x[0]
    starts, ends = _ints(x[1]), _ints(x[2])
    axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = _ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    idx: list = [slice(None)] * data.dim()
    flips = []
    for s, e, ax, st in zip(starts, ends, axes, steps):
        ax = _axis(ax, data.dim())
        n = data.shape[ax]
        if st > 0:
            s = max(0, min(n, s + n if s < 0 else s))
            e = max(0, min(n, e + n if e < 0 else e))
            idx[ax] = slice(s, max(s, e), st)
        else:  # negative step: flip then slice forward
            s = max(-1, min(n - 1, s + n if s < 0 else s))
            e = max(-1, min(n - 1, e + n if e < 0 else e))
            cnt = max(0, (s - e + (-st) - 1) // (-st))
            idx[ax] = slice(n - 1 - s, n - 1 - s + cnt * (-st), -st)
            flips.append(ax)
    y = data.flip(flips) if flips else data
    return (y[tuple(idx)],)


def _split(x, a):
    data = x[0]
    ax = _axis(a.get("axis", 0), data.dim())
    if len(x) > 1 and x[1] is not None:
        sizes = _ints(x[1])
    else:
        n = a.get("num_outputs")
        sizes = [math.ceil(data.shape[ax] / n)] * n
        sizes[-1] = data.shape[ax] - sum(sizes[:-1])
    return tuple(torch.split(data, sizes, dim=ax))


def _expand(x, a):
    data, shape = x[0], _ints(x[1])
    r = max(data.dim(), len(shape))
    shape = [1] * (r - len(shape)) + shape
    ds = [1] * (r - data.dim()) + list(data.shape)
    target = [max(s, d) if s != 1 or d != 1 else 1 for s, d in zip(shape, ds)]
    return (data.reshape(ds).expand(target),)


def _transpose(x, a):
    perm = a.get("perm") or list(range(x[0].dim() - 1, -1, -1))
    return (x[0].permute(*perm),)


def _range(x, a):
    s, e, d = (float(t.reshape(-1)[0]) if t.dtype.is_floating_point else int(t.reshape(-1)[0]) for t in x)
    return (torch.arange(s, e, d, dtype=x[0].dtype, device=x[0].device),)


def _constant(x, a):
    return (a["value"],)


def _constant_of_shape(x, a):
    v = a.get("value")
    shape = _ints(x[0])
    if v is None:
        return (torch.zeros(shape, dtype=torch.float32),)
    return (v.reshape(-1)[0].expand(shape).clone(),)


# ---- indexing -----------------------------------------------------------------------------------------------------

def _gather(x, a):
    data, idx = x
    ax = _axis(a.get("axis", 0), data.dim())
    idx = idx.to(data.device)
    idx = torch.where(idx < 0, idx + data.shape[ax], idx)
    out = torch.index_select(data, ax, idx.reshape(-1))
    return (out.reshape(*data.shape[:ax], *idx.shape, *data.shape[ax + 1:]),)


def _gather_elements(x, a):
    data, idx = x
    ax = _axis(a.get("axis", 0), data.dim())
    idx = idx.to(data.device)
    idx = torch.where(idx < 0, idx + data.shape[ax], idx)
    return (torch.gather(data, ax, idx),)


def _gather_nd(x, a):
    data, idx = x
    bd = a.get("batch_dims", 0)
    idx = idx.to(data.device)
    m = idx.shape[-1]
    bshape = data.shape[:bd]
    nb = int(math.prod(bshape))
    d = data.reshape(nb, *data.shape[bd:])
    i = idx.reshape(nb, -1, m)
    sizes = d.shape[1:1 + m]
    flat = torch.zeros(i.shape[:2], dtype=torch.int64, device=data.device)
    for k in range(m):
        v = i[..., k]
        v = torch.where(v < 0, v + sizes[k], v)
        flat = flat * sizes[k] + v
    rest = d.shape[1 + m:]
    dd = d.reshape(nb, -1, *rest)
    out = torch.gather(dd, 1, flat.reshape(nb, -1, *([1] * len(rest))).expand(nb, flat.shape[1], *rest))
    return (out.reshape(*bshape, *idx.shape[bd:-1], *rest),)


def _scatter_nd(x, a):
    data, idx, upd = x
    if a.get("reduction", "none") != "none":
        raise NotImplementedError("ScatterND with a reduction")
    out = data.clone()
    m = idx.shape[-1]
    flat_idx = idx.reshape(-1, m)
    sizes = data.shape[:m]
    lin = torch.zeros(flat_idx.shape[0], dtype=torch.int64, device=data.device)
    for k in range(m):
        lin = lin * sizes[k] + flat_idx[:, k]
    out.reshape(-1, *data.shape[m:]).index_copy_(0, lin, upd.reshape(-1, *data.shape[m:]).to(out.dtype))
    return (out,)


def _scatter_elements(x, a):
    data, idx, upd = x
    ax = _axis(a.get("axis", 0), data.dim())
    idx = torch.where(idx < 0, idx + data.shape[ax], idx).to(data.device)
    red = a.get("reduction", "none")
    if red == "none":
        return (data.scatter(ax, idx, upd.to(data.dtype)),)
    return (data.scatter_reduce(ax, idx, upd.to(data.dtype), {"add": "sum", "mul": "prod", "max": "amax",
                                                              "min": "amin"}[red], include_self=True),)


def _conv(x, a):
    data, w = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    nd = data.dim() - 2
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise NotImplementedError(f"Conv auto_pad={a['auto_pad']}")
    pads = a.get("pads") or [0] * (2 * nd)
    lo, hi = pads[:nd], pads[nd:]
    if lo != hi:
        data = torch.nn.functional.pad(data, [p for pair in zip(reversed(lo), reversed(hi)) for p in pair])
        lo = [0] * nd
    f = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[nd]
    return (f(data, w.to(data.dtype), None if bias is None else bias.to(data.dtype),
              stride=a.get("strides") or 1, padding=lo, dilation=a.get("dilations") or 1, groups=a.get("group", 1)),)


def _topk(x, a):
    data, k = x[0], int(_ints(x[1])[0])
    ax = _axis(a.get("axis", -1), data.dim())
    largest = bool(a.get("largest", 1))
    # ONNX: among equal values the lower index comes first; a stable sort gives exactly that order
    vals, idx = torch.sort(data, dim=ax, descending=largest, stable=True)
    return (vals.narrow(ax, 0, k), idx.narrow(ax, 0, k))


def _argmax(x, a):
    ax = a.get("axis", 0)
    y = torch.argmax(x[0], dim=ax, keepdim=bool(a.get("keepdims", 1)))
    return (y,)


def _trilu(x, a):
    k = int(_ints(x[1])[0]) if len(x) > 1 and x[1] is not None else 0
    return ((torch.triu if a.get("upper", 1) else torch.tril)(x[0], k),)


def _cumsum(x, a):
    ax = int(_ints(x[1])[0])
    y = x[0]
    if a.get("reverse", 0):
        y = y.flip(ax)
    if a.get("exclusive", 0):
        y = torch.cumsum(y, ax) - y
    else:
        y = torch.cumsum(y, ax)
    return (y.flip(ax) if a.get("reverse", 0) else y,)


# ---- reductions and normalizations --------------------------------------------------------------------------------

def _reduce(f: Callable) -> Callable:
    def run(x, a):
        data = x[0]
        axes = _ints(x[1]) if len(x) > 1 and x[1] is not None else a.get("axes")
        keep = bool(a.get("keepdims", 1))
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return (data,)
            axes = list(range(data.dim()))
        axes = tuple(_axis(i, data.dim()) for i in axes)
        return (f(data, axes, keep),)
    return run


def _softmax(x, a):
    return (torch.softmax(x[0].float(), dim=a.get("axis", -1)).to(x[0].dtype),)


def _rms_normalized(x, a) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNormalization before its scale: (y in the stash dtype, the scale in y's dtype)."""
    data, scale = x[0], x[1]
    ax = _axis(a.get("axis", -1), data.dim())
    dims = tuple(range(ax, data.dim()))
    xf = data.float() if a.get("stash_type", 1) == 1 else data
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + a.get("epsilon", 1e-5))
    return y, scale.to(y.dtype)


def _rms_norm(x, a):
    y, scale = _rms_normalized(x, a)
    return ((y * scale).to(x[0].dtype),)


def _layer_norm(x, a):
    data, scale = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    ax = _axis(a.get("axis", -1), data.dim())
    shape = data.shape[ax:]
    y = torch.nn.functional.layer_norm(data.float(), shape, scale.float(), None if bias is None else bias.float(),
                                       a.get("epsilon", 1e-5))
    return (y.to(data.dtype),)


def _matmul(x, a):
    p, q = x
    if p.dtype != q.dtype:
        q = q.to(p.dtype)
    return (torch.matmul(p, q),)


def _gemm(x, a):
    p, q = x[0], x[1]
    c = x[2] if len(x) > 2 else None
    if a.get("transA", 0):
        p = p.t()
    if a.get("transB", 0):
        q = q.t()
    y = a.get("alpha", 1.0) * (p @ q.to(p.dtype))
    if c is not None:
        y = y + a.get("beta", 1.0) * c.to(y.dtype)
    return (y,)


def _einsum(x, a):
    ops = [t.to(x[0].dtype) for t in x]
    return (torch.einsum(a["equation"], *ops),)


def _identity(x, a):
    return (x[0],)


TABLE: dict[str, Callable] = {
    "Add": _binary(torch.add), "Sub": _binary(torch.sub), "Mul": _binary(torch.mul), "Div": _div, "Mod": _mod,
    "Pow": _pow, "Max": lambda x, a: (torch.stack(torch.broadcast_tensors(*x)).amax(0),),
    "Min": lambda x, a: (torch.stack(torch.broadcast_tensors(*x)).amin(0),),
    "Equal": _binary(torch.eq), "Less": _binary(torch.lt), "LessOrEqual": _binary(torch.le),
    "Greater": _binary(torch.gt), "GreaterOrEqual": _binary(torch.ge), "And": _binary(torch.logical_and),
    "Or": _binary(torch.logical_or), "Xor": _binary(torch.logical_xor), "Not": _unary(torch.logical_not),
    "Neg": _unary(torch.neg), "Abs": _unary(torch.abs), "Sign": _unary(torch.sign), "Exp": _unary(torch.exp),
    "Log": _unary(torch.log), "Sqrt": _unary(torch.sqrt), "Reciprocal": _unary(torch.reciprocal),
    "Sigmoid": _unary(torch.sigmoid), "Tanh": _unary(torch.tanh), "Relu": _unary(torch.relu),
    "Erf": _unary(torch.erf), "Floor": _unary(torch.floor), "Ceil": _unary(torch.ceil), "Sin": _unary(torch.sin),
    "Cos": _unary(torch.cos), "IsNaN": _unary(torch.isnan), "IsInf": _unary(torch.isinf),
    "Softplus": _unary(torch.nn.functional.softplus), "Clip": _clip, "Where": _where, "Cast": _cast,
    "Shape": _shape, "Reshape": _reshape, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze, "Concat": _concat,
    "Slice": _slice, "Split": _split, "Expand": _expand, "Transpose": _transpose, "Range": _range,
    "Constant": _constant, "ConstantOfShape": _constant_of_shape, "Identity": _identity,
    "Gather": _gather, "GatherElements": _gather_elements, "GatherND": _gather_nd, "ScatterND": _scatter_nd,
    "ScatterElements": _scatter_elements, "Conv": _conv, "TopK": _topk, "ArgMax": _argmax, "Trilu": _trilu, "CumSum": _cumsum,
    "ReduceSum": _reduce(lambda d, ax, k: d.sum(dim=ax, keepdim=k)),
    "ReduceMean": _reduce(lambda d, ax, k: d.mean(dim=ax, keepdim=k)),
    "ReduceMax": _reduce(lambda d, ax, k: d.amax(dim=ax, keepdim=k)),
    "ReduceMin": _reduce(lambda d, ax, k: d.amin(dim=ax, keepdim=k)),
    "ReduceProd": _reduce(lambda d, ax, k: torch.prod(d.reshape(*d.shape), dim=ax[0], keepdim=k)
                          if len(ax) == 1 else d.prod()),
    "Softmax": _softmax, "RMSNormalization": _rms_norm, "LayerNormalization": _layer_norm,
    "MatMul": _matmul, "Gemm": _gemm, "Einsum": _einsum,
}

VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Identity"})

# ---- writing into a planned slot ----------------------------------------------------------------------------------
# Ops whose result can be computed straight into the output's planned arena slot (`out`, the shape and dtype the
# first run at this signature recorded for it), saving the copy a planned output otherwise costs: one launch each.
# Each computes what its TABLE entry computes; a test holds every entry to that on random inputs.

def _out_binary(f: Callable) -> Callable:
    return lambda x, a, out: f(x[0], x[1], out=out)


def _out_unary(f: Callable) -> Callable:
    return lambda x, a, out: f(x[0], out=out)


def _out_div(x, a, out):
    p, q = x
    if p.dtype.is_floating_point:
        torch.div(p, q, out=out)
    else:
        torch.div(p, q, rounding_mode="trunc", out=out)


def _out_matmul(x, a, out):
    p, q = x
    q = q if q.dtype == p.dtype else q.to(p.dtype)
    if p.dim() == 1 or q.dim() == 1:  # torch's out= path resizes internally for a vector operand
        out.copy_(torch.matmul(p, q))
    else:
        torch.matmul(p, q, out=out)


def _out_cast(x, a, out):
    out.copy_(_cast_source(x[0], torch_dtype(a["to"]), a))


def _out_concat(x, a, out):
    parts = [t for t in x if t is not None]
    torch.cat([t.to(out.device) for t in parts], dim=a["axis"], out=out)


def _out_rms_norm(x, a, out):
    y, scale = _rms_normalized(x, a)
    torch.mul(y, scale, out=out)  # rounded to the output's dtype as the TABLE form's .to() rounds


OUT_TABLE: dict[str, Callable] = {
    "Add": _out_binary(torch.add), "Sub": _out_binary(torch.sub), "Mul": _out_binary(torch.mul), "Div": _out_div,
    "Equal": _out_binary(torch.eq), "Less": _out_binary(torch.lt), "LessOrEqual": _out_binary(torch.le),
    "Greater": _out_binary(torch.gt), "GreaterOrEqual": _out_binary(torch.ge), "And": _out_binary(torch.logical_and),
    "Or": _out_binary(torch.logical_or), "Xor": _out_binary(torch.logical_xor), "Not": _out_unary(torch.logical_not),
    "Neg": _out_unary(torch.neg), "Abs": _out_unary(torch.abs), "Exp": _out_unary(torch.exp),
    "Log": _out_unary(torch.log), "Sqrt": _out_unary(torch.sqrt), "Reciprocal": _out_unary(torch.reciprocal),
    "Sigmoid": _out_unary(torch.sigmoid), "Tanh": _out_unary(torch.tanh), "Erf": _out_unary(torch.erf),
    "Floor": _out_unary(torch.floor), "Ceil": _out_unary(torch.ceil), "Sin": _out_unary(torch.sin),
    "Cos": _out_unary(torch.cos), "Where": lambda x, a, out: torch.where(x[0], x[1], x[2], out=out),
    "Cast": _out_cast, "Concat": _out_concat, "MatMul": _out_matmul, "RMSNormalization": _out_rms_norm,
}
# inputs that are shape arguments (read on the host): (op, input index)
HOST_INPUTS = {("Pow", 1), ("Reshape", 1), ("Squeeze", 1), ("Unsqueeze", 1), ("Slice", 1), ("Slice", 2), ("Slice", 3),
               ("Slice", 4), ("Split", 1), ("Expand", 1), ("Range", 0), ("Range", 1), ("Range", 2), ("TopK", 1),
               ("ReduceSum", 1), ("ReduceMean", 1), ("ReduceMax", 1), ("ReduceMin", 1), ("ReduceProd", 1),
               ("ConstantOfShape", 0), ("Trilu", 1), ("CumSum", 1)}
