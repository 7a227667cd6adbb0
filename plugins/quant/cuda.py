"""cuda backend kernels for the quantization ops: the torch twins of the references (plugins/quant/reference.py,
bit-identical codes and scales) on any device; float8 outputs as torch float8 tensors over the same bytes."""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel

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


_ANY = ("cuda", "cpu")
CUDA = {
    "QuantizeMX": Kernel(quantize_mx, devices=_ANY, name="torch.mx_quantize"),
    "DequantizeMX": Kernel(dequantize_mx, devices=_ANY, name="torch.mx_dequantize"),
    "QDQMX": Kernel(qdq_mx, devices=_ANY, name="torch.mx_qdq"),
    "QuantizeFP8Tile": Kernel(quantize_fp8_tile, devices=_ANY, name="torch.fp8_tile_quantize"),
    "DequantizeFP8Tile": Kernel(dequantize_fp8_tile, devices=_ANY, name="torch.fp8_tile_dequantize"),
    "QDQFP8Tile": Kernel(qdq_fp8_tile, devices=_ANY, name="torch.fp8_tile_qdq"),
}
