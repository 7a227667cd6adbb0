"""cuda backend kernels for the quantization ops: the torch twins of the references (plugins/quant/reference.py,
bit-identical codes and scales) on any device; float8 outputs as torch float8 tensors over the same bytes.

kimi.QuantizeMX and kimi.QDQMX (blocks of 32 or 128, E4M3, floor or ceil rounding: the indexer's MXFP8 Q and K, the
latent KV cache's tiles) run Triton kernels on the GPU by default (plugins/quant/triton.py: one launch to quantize,
one to dequantize, where the torch twins issue 37 and 44 operations), written into the executor's slots; their torch
twins are the one fallback and what the CPU runs."""

from __future__ import annotations

import torch

from kimi_compile.lowering import FP8_CAPABILITY, Kernel, out_slot, warn_fallback_once

_F8 = {17: torch.float8_e4m3fn, 19: torch.float8_e5m2}
_ELEM = {17: "e4m3", 19: "e5m2"}


def _scale_e8m0(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(s - 127) (0xFF = NaN)."""
    v = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.to(torch.int32) - 127)
    return torch.where(s == 0xFF, torch.full_like(v, float("nan")), v)


def _blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // n, n)


def quantize_mx(x, a):
    from kimi_compile.plugins.quant.reference import mx_quantize_torch

    q, s = mx_quantize_torch(x[0], block=a["block"], elem=_ELEM[a["elem_type"]], rounding=a["rounding"])
    return q.view(_F8[a["elem_type"]]), s


def dequantize_mx(x, a):
    q, s = x
    v = _blocks(q.float(), a["block"]) * _scale_e8m0(s).unsqueeze(-1)
    return (v.reshape(q.shape),)


def qdq_mx(x, a):
    q, s = quantize_mx(x, a)
    return (dequantize_mx([q, s], a)[0].to(x[0].dtype),)


def quantize_fp8_tile(x, a):
    from kimi_compile.plugins.quant.reference import fp8_tile_quantize_torch

    q, s = fp8_tile_quantize_torch(x[0], tile=a["tile"], scale_fmt=a["scale_fmt"])
    return q.view(torch.float8_e4m3fn), s


def dequantize_fp8_tile(x, a):
    q, s = x
    v = _blocks(q.float(), a["tile"]) * s.float().unsqueeze(-1)
    return (v.reshape(q.shape),)


def qdq_fp8_tile(x, a):
    q, s = quantize_fp8_tile(x, a)
    return (dequantize_fp8_tile([q, s], a)[0].to(x[0].dtype),)


def _mx_triton_supports(values, attrs) -> str | None:
    """Build-time check: the Triton MX kernels take blocks of 32 or 128, E4M3 and floor / ceil rounding (the
    shape's last dim is checked when they run)."""
    from kimi_compile.plugins.quant import triton as tk

    if tk.triton is None:
        return "triton is not installed"
    if int(attrs.get("block", 32)) not in tk.MX_BLOCKS or int(attrs.get("elem_type", 17)) != 17:
        return f"block / elem_type: the Triton MX kernels take blocks of {' or '.join(map(str, tk.MX_BLOCKS))} and " \
               f"E4M3 (17), got block {attrs.get('block')} and elem_type {attrs.get('elem_type')}"
    if attrs.get("rounding", "floor") not in ("floor", "ceil"):
        return f"rounding: the Triton MX kernels round floor or ceil, got {attrs.get('rounding')!r}"
    return None


def _mx_triton_refuses(x: torch.Tensor, block: int) -> str | None:
    if not x.is_cuda:
        return f"x is on {x.device}, not a CUDA device"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"x must be float32, bfloat16 or float16, got {x.dtype}"
    D = x.shape[-1] if x.dim() else 0
    if D < block or D & (D - 1):
        return f"x's last dim must be a power of two of at least the block ({block}), got shape {tuple(x.shape)}"
    return None


def _triton_codes(x, a, op: str, fallback: str, out=None):
    """(codes, scales) from the Triton quantize kernel (into `out` where it fits), or None after saying once why
    `fallback` runs instead."""
    block = int(a.get("block", 32))
    why = _mx_triton_refuses(x[0], block)
    if why is not None:
        warn_fallback_once(op, why, fallback)
        return None
    from kimi_compile.plugins.quant import triton as tk

    D = x[0].shape[-1]
    slots = (out_slot(out, 0, x[0].shape, torch.float8_e4m3fn), out_slot(out, 1, (*x[0].shape[:-1], D // block),
                                                                          torch.uint8))
    return tk.mxfp8_quantize(x[0], a["rounding"], block, out=slots if None not in slots else None)


def quantize_mx_triton(x, a, out=None):
    """out: the executor's (codes, scales) slots, written in place where they fit."""
    qs = _triton_codes(x, a, "kimi.QuantizeMX", "torch.mx_quantize", out)
    if qs is None:
        return quantize_mx(x, a)
    codes = qs[0] if qs[0].dtype == torch.float8_e4m3fn else qs[0].view(torch.float8_e4m3fn)
    return codes, qs[1]


def qdq_mx_triton(x, a, out=None):
    """out: the executor's slot for the values, written in place where it fits."""
    qs = _triton_codes(x, a, "kimi.QDQMX", "torch.mx_qdq")
    if qs is None:
        return qdq_mx(x, a)
    from kimi_compile.plugins.quant import triton as tk

    return (tk.mxfp8_dequantize(qs[0], qs[1], x[0].dtype, int(a.get("block", 32)),
                                out=out_slot(out, 0, x[0].shape, x[0].dtype)),)


_ANY = ("cuda", "cpu")
CUDA = {
    "QuantizeMX": Kernel(quantize_mx_triton, supports=_mx_triton_supports, name="triton.mx_quantize", out=True,
                         min_capability=FP8_CAPABILITY,
                         fallback=Kernel(quantize_mx, devices=_ANY, name="torch.mx_quantize")),
    "DequantizeMX": Kernel(dequantize_mx, devices=_ANY, name="torch.mx_dequantize"),
    "QDQMX": Kernel(qdq_mx_triton, supports=_mx_triton_supports, name="triton.mx_qdq", out=True,
                    min_capability=FP8_CAPABILITY,
                    fallback=Kernel(qdq_mx, devices=_ANY, name="torch.mx_qdq")),
    "QuantizeFP8Tile": Kernel(quantize_fp8_tile, devices=_ANY, name="torch.fp8_tile_quantize"),
    "DequantizeFP8Tile": Kernel(dequantize_fp8_tile, devices=_ANY, name="torch.fp8_tile_dequantize"),
    "QDQFP8Tile": Kernel(qdq_fp8_tile, devices=_ANY, name="torch.fp8_tile_qdq"),
}
