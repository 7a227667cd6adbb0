"""The FP8 / MXFP8 / E8M0 formats, defined once: their code tables, and the numpy references (with torch twins) of
MXFP8 and FP8 tile quantization (optimizations.md §5). Every other module (the quant ONNX bodies, the quantize pass,
the fusion matchers, the other ops' references and bodies) reads its format facts from here.

Inputs may be float16/bfloat16/float32 (upcast exactly) or float64 (rounded to float32 first); all arithmetic is float32.
These functions are the numerical oracle of the `kimi.QuantizeMX` / `kimi.QuantizeFP8Tile` family: the ONNX lowerings
in body.py must match them bit for bit. Codes are returned as uint8 arrays holding the raw FP8 / E8M0 bytes.

MXFP8 (OCP MX v1.0): every `block` consecutive elements of the last axis share one E8M0 scale X = 2^e (byte e+127).
- ``rounding="floor"`` (OCP rule): e = floor(log2(amax)) - emax_elem (emax 8 for E4M3, 15 for E5M2); elements whose
  scaled value exceeds the element max are saturated to ±max_normal (448 / 57344).
- ``rounding="ceil"`` (DeepSeek "ue8m0", torchao RCEIL): e = ceil(log2(amax / max_elem)), computed exactly from the
  bits of amax (the smallest e with amax <= max_elem * 2^e), so no element ever saturates. For every amax whose
  quotient amax/max_elem is a normal float32 (amax >= 2^-117 for E4M3) this equals the float32 formula
  ``ceil(log2(amax / max_elem))``; below that the float32 quotient is subnormal and may round onto a power of two.
- Elements: x / X computed exactly in float32 (a power-of-two scaling; only values that would become float32
  subnormals round, and those are far below the smallest FP8 subnormal), clipped to ±max_normal, then converted with
  round-to-nearest-even, FP8 subnormals included (E4M3: 2^-9 is the smallest; a scaled 2^-10 ties to +0).
- e is clamped to the E8M0 range [-127, 127]. With float32 input only the lower clamp can act (tiny blocks): their
  elements are scaled by 2^127 and may become FP8 subnormals or signed zeros.
- All-zero block (amax == 0, including -0.0): log2(0) = -inf clamps to e = -127, so the stored byte is 0x00; every
  element code is a signed zero (0x00 or 0x80) and dequantizes to the same signed zero exactly.
- Non-finite input: any NaN or ±Inf in a block makes the whole block NaN: scale byte 0xFF (E8M0 NaN) and every
  element code the positive NaN of the element format (0x7F for E4M3FN, 0x7E for E5M2); it dequantizes to NaN. (E8M0
  and E4M3FN have no Inf, so Inf is treated as NaN; E5M2 follows the same rule for uniformity.)

FP8 tile (DeepSeek act_quant / FlashMLA KV cache): per row, per `tile` consecutive elements of the last axis,
amax' = max(amax, 1e-4 as float32); scale = amax'/448 rounded to float32 (``scale_fmt="fp32"``) or the exact power of
two 2^ceil(log2(amax'/448)) (``"ue8m0"``, rule as the MX ceil rule above; equal to DeepSeek's fast_round_scale, the
ceil taken from the bits of float32 amax * (1/448), for every amax >= 1e-4, while a float32 ceil(log2(.)) is off by one
just above a power-of-two boundary); q = e4m3(clip(x / scale, ±448)) with x / scale a float32 division (correctly
rounded) followed by round-to-nearest-even. An all-zero tile stores scale = 1e-4/448
(fp32) or 2^-22 (ue8m0) and zero codes. A tile holding NaN or ±Inf stores scale NaN and NaN codes (0x7F).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
FP8_TILE_AMAX_FLOOR = np.float32(1e-4)  # DeepSeek clamps amax below at 1e-4 before computing the scale
FP8_TILE_MAX = 448.0

ROUNDINGS = ("floor", "ceil")
SCALE_FMTS = ("fp32", "ue8m0")


@dataclasses.dataclass(frozen=True)
class ElemFormat:
    """An FP8 element format: numpy dtype (ml_dtypes), max normal value, emax, ONNX TensorProto type."""

    name: str
    dtype: Any
    max_normal: float
    emax: int
    onnx_type: int
    nan_code: int  # the byte a positive float32 NaN converts to


ELEM_FORMATS = {
    "e4m3": ElemFormat("e4m3", ml_dtypes.float8_e4m3fn, 448.0, 8, 17, 0x7F),  # TensorProto.FLOAT8E4M3FN
    "e5m2": ElemFormat("e5m2", ml_dtypes.float8_e5m2, 57344.0, 15, 19, 0x7E),  # TensorProto.FLOAT8E5M2
}


ELEM_BY_ONNX_TYPE = {f.onnx_type: name for name, f in ELEM_FORMATS.items()}  # {17: "e4m3", 19: "e5m2"}


def elem_format(elem: str) -> ElemFormat:
    try:
        return ELEM_FORMATS[elem]
    except KeyError:
        raise ValueError(f"elem must be one of {sorted(ELEM_FORMATS)}, got {elem!r}") from None


# ---- code tables (the ONNX bodies and the quantize pass compute with them: no Log/Pow/BitCast at opset 23) ----


def code_table(elem: str) -> np.ndarray:
    """float32[256]: the value of every FP8 code byte of `elem` (NaN codes NaN)."""
    return np.arange(256, dtype=np.uint8).view(elem_format(elem).dtype).astype(np.float32)


def search_table(elem: str) -> np.ndarray:
    """float32[128]: nonneg code c -> its value, +inf past the largest finite code except the inf code (e5m2): the
    code of a nonneg FP8 value a is max{c : a >= T[c]}."""
    t = code_table(elem)[:128].copy()
    t[np.isnan(t)] = np.inf
    return t


def _f32(v: float) -> np.float32:
    return np.float32(v) if abs(v) <= float(np.finfo(np.float32).max) else np.float32(math.inf)


def pow2_table() -> np.ndarray:
    """float32[256]: entry b = 2^(b-127) for b < 255, NaN for 255 (the E8M0 decoding table)."""
    t = np.array([math.ldexp(1.0, b - E8M0_BIAS) for b in range(255)] + [math.nan], np.float64)
    return t.astype(np.float32)


def threshold_table(elem: str, rounding: str) -> np.ndarray:
    """float32[256]: byte(amax) = max{c : amax >= T[c]} (0 if none) is the E8M0 byte of the scale rule."""
    fmt = elem_format(elem)
    t = np.full(256, np.inf, np.float32)
    t[0] = 0.0  # never consulted: the search only probes c >= 1
    for c in range(1, 255):
        if rounding == "floor":
            t[c] = _f32(math.ldexp(1.0, c - E8M0_BIAS + fmt.emax))
        else:
            edge = _f32(fmt.max_normal * math.ldexp(1.0, c - E8M0_BIAS - 1))
            t[c] = np.nextafter(edge, np.float32(np.inf))
    return t


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _as_f32(x: Any, name: str) -> np.ndarray:
    x = np.asarray(x)
    if not (x.dtype.kind == "f" or x.dtype == ml_dtypes.bfloat16):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one axis, got a scalar")
    return x.astype(np.float32)


def _blocked(x: np.ndarray, block: int, name: str, what: str = "block") -> np.ndarray:
    if not isinstance(block, (int, np.integer)) or block <= 0:
        raise ValueError(f"{what} must be a positive int, got {block!r}")
    if x.shape[-1] % block:
        raise ValueError(f"{name}: last dim {x.shape[-1]} (shape {x.shape}) must be divisible by {what}={block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2(a)) for positive finite float32 a, exact (subnormals included)."""
    _, e = np.frexp(a.astype(np.float64))  # a = m * 2^e, m in [0.5, 1): exact in float64
    return e.astype(np.int64) - 1


def _ceil_exponent(amax: np.ndarray, max_normal: float) -> np.ndarray:
    """Smallest integer e with amax <= max_normal * 2^e (exact), for positive finite float32 amax.

    max_normal = 1.75 * 2^emax for every format used here, so with amax = m * 2^E (m in [1, 2)):
    e = E - emax + (m > 1.75).
    """
    m, e = np.frexp(amax.astype(np.float64))
    emax = int(np.log2(max_normal / 1.75))
    assert max_normal == 1.75 * 2.0**emax
    return (e.astype(np.int64) - 1) - emax + (2.0 * m > 1.75)


def mx_scale_exponent(amax: Any, *, elem: str = "e4m3", rounding: str = "floor") -> np.ndarray:
    """Unbiased E8M0 exponent (int64, clamped to [-127, 127]) of finite block maxima `amax` >= 0; amax == 0 -> -127."""
    fmt = elem_format(elem)
    _check_choice("rounding", rounding, ROUNDINGS)
    amax = np.asarray(amax, np.float32)
    pos = amax > 0
    safe = np.where(pos, amax, np.float32(1))
    if rounding == "floor":
        e = _floor_log2(safe) - fmt.emax
    else:
        e = _ceil_exponent(safe, fmt.max_normal)
    e = np.where(pos, e, E8M0_MIN_EXP)
    return np.clip(e, E8M0_MIN_EXP, E8M0_MAX_EXP)


def e8m0_to_float(scale: Any) -> np.ndarray:
    """E8M0 bytes -> float32: 2^(b - 127) for b < 255 (exact; 2^-127 is a float32 subnormal), NaN for 0xFF."""
    b = np.asarray(scale)
    if b.dtype != np.uint8:
        raise ValueError(f"scale must be uint8 E8M0 bytes, got dtype {b.dtype}")
    nan = b == E8M0_NAN
    v = np.ldexp(np.float32(1), np.where(nan, 0, b.astype(np.int32) - E8M0_BIAS)).astype(np.float32)
    return np.where(nan, np.float32(np.nan), v)


def _to_codes(v: np.ndarray, fmt: ElemFormat) -> np.ndarray:
    return np.clip(v, -fmt.max_normal, fmt.max_normal).astype(np.float32).astype(fmt.dtype).view(np.uint8)


def mx_quantize(
    x: Any, *, block: int = 32, elem: str = "e4m3", rounding: str = "floor"
) -> tuple[np.ndarray, np.ndarray]:
    """MX-quantize `x` along its last axis.

    Returns (q, scale): q uint8 FP8 codes with x's shape, scale uint8 E8M0 bytes of shape x.shape[:-1] + (K // block,).
    Invariants: mx_dequantize(q, scale) == fp8(x / 2^e) * 2^e exactly; with rounding="ceil" no element saturates.
    The edge cases (zero block, NaN/Inf, clamping, saturation) are defined in the module docstring.
    """
    fmt = elem_format(elem)
    _check_choice("rounding", rounding, ROUNDINGS)
    xb = _blocked(_as_f32(x, "x"), block, "x")
    bad = ~np.isfinite(xb).all(axis=-1)
    amax = np.abs(np.where(np.isfinite(xb), xb, 0)).max(axis=-1)
    e = mx_scale_exponent(amax, elem=elem, rounding=rounding)
    v = np.ldexp(xb, -e[..., None].astype(np.int32)).astype(np.float32)
    q = _to_codes(v, fmt)
    q = np.where(bad[..., None], np.uint8(fmt.nan_code), q)
    scale = np.where(bad, np.uint8(E8M0_NAN), (e + E8M0_BIAS).astype(np.uint8)).astype(np.uint8)
    return q.reshape(np.shape(x)), scale


def _code_bytes(q: Any, fmt) -> np.ndarray:
    """uint8 codes from uint8 or from a float8 array of the format's own type (a float8-typed pool's bytes)."""
    q = np.asarray(q)
    if q.dtype == np.uint8:
        return q
    if q.dtype == fmt.dtype:
        return q.view(np.uint8)
    raise ValueError(f"q must be uint8 FP8 codes or a {np.dtype(fmt.dtype).name} array, got dtype {q.dtype}")


def mx_dequantize(q: Any, scale: Any, *, block: int = 32, elem: str = "e4m3") -> np.ndarray:
    """Inverse of mx_quantize: float32 value of each code times its block's 2^(scale - 127); scale 0xFF -> NaN block.

    Arbitrary codes with large scale bytes can exceed float32 and give ±inf (never for mx_quantize output)."""
    fmt = elem_format(elem)
    q = _code_bytes(q, fmt)
    qb = _blocked(q, block, "q")
    scale = np.asarray(scale)
    if scale.shape != qb.shape[:-1]:
        raise ValueError(f"scale shape {scale.shape} must be q.shape[:-1] + (K // block,) = {qb.shape[:-1]}")
    vals = qb.view(fmt.dtype).astype(np.float32)
    with np.errstate(over="ignore"):
        return (vals * e8m0_to_float(scale)[..., None]).astype(np.float32).reshape(q.shape)


def mx_qdq(x: Any, *, block: int = 32, elem: str = "e4m3", rounding: str = "floor") -> np.ndarray:
    """Fake quantization: mx_dequantize(mx_quantize(x)), float32 result."""
    q, s = mx_quantize(x, block=block, elem=elem, rounding=rounding)
    return mx_dequantize(q, s, block=block, elem=elem)


def fp8_tile_quantize(x: Any, *, tile: int = 128, scale_fmt: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """Per-row, per-`tile` FP8 E4M3 quantization of the last axis (DeepSeek act_quant, FlashMLA FP8 KV cache).

    Returns (q, scale): q uint8 E4M3FN codes with x's shape, scale float32 of shape x.shape[:-1] + (K // tile,).
    Dequantization is q * scale. Edge cases are defined in the module docstring.
    """
    _check_choice("scale_fmt", scale_fmt, SCALE_FMTS)
    fmt = ELEM_FORMATS["e4m3"]
    xb = _blocked(_as_f32(x, "x"), tile, "x", what="tile")
    bad = ~np.isfinite(xb).all(axis=-1)
    amax = np.abs(np.where(np.isfinite(xb), xb, 0)).max(axis=-1)
    amax = np.maximum(amax, FP8_TILE_AMAX_FLOOR)
    if scale_fmt == "fp32":
        scale = (amax / np.float32(FP8_TILE_MAX)).astype(np.float32)
    else:
        scale = np.ldexp(np.float32(1), _ceil_exponent(amax, FP8_TILE_MAX).astype(np.int32)).astype(np.float32)
    scale = np.where(bad, np.float32(np.nan), scale).astype(np.float32)
    with np.errstate(invalid="ignore"):
        v = (xb / scale[..., None]).astype(np.float32)
    q = _to_codes(v, fmt)
    q = np.where(bad[..., None], np.uint8(fmt.nan_code), q)
    return q.reshape(np.shape(x)), scale


def fp8_tile_dequantize(q: Any, scale: Any, *, tile: int = 128) -> np.ndarray:
    """Inverse of fp8_tile_quantize: float32(e4m3 code) * scale (float32 product)."""
    q = _code_bytes(q, ELEM_FORMATS["e4m3"])
    qb = _blocked(q, tile, "q", what="tile")
    scale = np.asarray(scale, np.float32)
    if scale.shape != qb.shape[:-1]:
        raise ValueError(f"scale shape {scale.shape} must be q.shape[:-1] + (K // tile,) = {qb.shape[:-1]}")
    vals = qb.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (vals * scale[..., None]).astype(np.float32).reshape(q.shape)


def fp8_tile_qdq(x: Any, *, tile: int = 128, scale_fmt: str = "fp32") -> np.ndarray:
    """Fake quantization: fp8_tile_dequantize(fp8_tile_quantize(x)), float32 result."""
    q, s = fp8_tile_quantize(x, tile=tile, scale_fmt=scale_fmt)
    return fp8_tile_dequantize(q, s, tile=tile)


# ---- torch twins (same semantics; torch imported lazily so the numpy path never pulls it in) ----


def _exponent_torch(amax: Any, emax: int, ceil: bool) -> Any:
    """Torch twin of the exponent rules for positive amax: floor(log2(amax)) - emax, or the smallest e with
    amax <= 1.75 * 2^emax * 2^e (max_normal = 1.75 * 2^emax), exact from the bits (frexp)."""
    import torch

    m, ex = torch.frexp(amax.double())  # amax = m * 2^ex, m in [0.5, 1)
    e = ex.long() - 1 - emax
    return e + (2 * m > 1.75).long() if ceil else e


def _torch_fp8(elem: str) -> Any:
    import torch

    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[elem_format(elem).name]


def mx_quantize_torch(x: Any, *, block: int = 32, elem: str = "e4m3", rounding: str = "floor") -> tuple[Any, Any]:
    """Torch twin of mx_quantize: returns (q uint8 codes, scale uint8 E8M0 bytes) as torch tensors, bit-identical."""
    import torch

    fmt = elem_format(elem)
    _check_choice("rounding", rounding, ROUNDINGS)
    x = torch.as_tensor(x).to(torch.float32)
    if x.shape[-1] % block:
        raise ValueError(f"x: last dim {x.shape[-1]} (shape {tuple(x.shape)}) must be divisible by block={block}")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    fin = torch.isfinite(xb)
    bad = ~fin.all(dim=-1)
    amax = torch.where(fin, xb, torch.zeros_like(xb)).abs().amax(dim=-1)
    e = _exponent_torch(amax, fmt.emax, rounding == "ceil")
    e = torch.where(amax > 0, e, torch.full_like(e, E8M0_MIN_EXP)).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    v = torch.ldexp(xb.double(), -e[..., None].double()).float()  # exact power-of-two scaling
    v = v.clamp(-fmt.max_normal, fmt.max_normal)
    q = v.to(_torch_fp8(elem)).view(torch.uint8)
    q = torch.where(bad[..., None], torch.full_like(q, fmt.nan_code), q)
    scale = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)
    return q.reshape(x.shape), scale


def mx_dequantize_torch(q: Any, scale: Any, *, block: int = 32, elem: str = "e4m3") -> Any:
    """Torch twin of mx_dequantize in float64 (exact for every code and scale byte, no float32 overflow): code value
    times 2^(scale - 127) per block; scale 0xFF -> NaN block."""
    import torch

    v = q.contiguous().view(_torch_fp8(elem)).double()
    s = torch.ldexp(torch.ones_like(scale, dtype=torch.float64), scale.long().double() - E8M0_BIAS)
    s = torch.where(scale == E8M0_NAN, torch.full_like(s, float("nan")), s)
    return (v.reshape(*v.shape[:-1], -1, block) * s[..., None]).reshape(v.shape)


def fp8_tile_quantize_torch(x: Any, *, tile: int = 128, scale_fmt: str = "fp32") -> tuple[Any, Any]:
    """Torch twin of fp8_tile_quantize: (q uint8 E4M3FN codes, scale float32) as torch tensors, bit-identical."""
    import torch

    _check_choice("scale_fmt", scale_fmt, SCALE_FMTS)
    x = torch.as_tensor(x).to(torch.float32)
    if x.shape[-1] % tile:
        raise ValueError(f"x: last dim {x.shape[-1]} (shape {tuple(x.shape)}) must be divisible by tile={tile}")
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // tile, tile)
    fin = torch.isfinite(xb)
    bad = ~fin.all(dim=-1)
    amax = torch.where(fin, xb, torch.zeros_like(xb)).abs().amax(dim=-1).clamp_min(float(FP8_TILE_AMAX_FLOOR))
    if scale_fmt == "fp32":
        scale = amax / FP8_TILE_MAX
    else:
        e = _exponent_torch(amax, ELEM_FORMATS["e4m3"].emax, ceil=True)
        scale = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), e.double()).float()
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    v = (xb / scale[..., None]).clamp(-FP8_TILE_MAX, FP8_TILE_MAX)
    q = v.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(bad[..., None], torch.full_like(q, ELEM_FORMATS["e4m3"].nan_code), q)
    return q.reshape(x.shape), scale
