"""Triton kernels that quantize rows and write them into the paged caches in place, in the layouts the quantize pass
gives the pools (semantics: plugins/quant/reference.py, `mx_quantize`).

- `mxfp8_quantize_to_cache(x, slot_mapping, codes, scales, rounding)`: the index-K cache (index_k_cache mxfp8,
  block 32): x [N, D] -> E4M3 codes [NB, BS, D] uint8 and E8M0 scales [NB, BS, D / 32] uint8 at the flat slots
  slot_mapping[n] (block * BS + row; < 0 = skip). rounding "floor" (OCP, saturating) or "ceil" (no saturation).
- `mxfp8_quantize(x, rounding, block)` / `mxfp8_dequantize(codes, scales, dtype, block)`: the same codes and scales
  as plain tensors (block 32 or 128), and back (kimi.QuantizeMX and kimi.QDQMX on the cuda backend, E4M3).
- `mla_fp8_quantize_to_cache(c_kv, k_pe, slot_mapping, kv_codes, kv_scales, kv_rope)`: the latent KV cache
  (latent_kv_cache fp8_tile, tile 128, scale_fmt ue8m0, latent_rope keep): c_kv [N, 512] -> E4M3 codes
  [NB, BS, 512] uint8 and one E8M0 byte per 128-element tile [NB, BS, 4] uint8 (rounding "ceil": the scale is the
  smallest power of two 2^e with amax <= 448 * 2^e), k_pe [N, 64] -> [NB, BS, 64] bf16, at slot_mapping[n].
  The pools plugins/sparse_mla/triton.py reads.
Per block of `block` elements: e = the E8M0 exponent of the block's amax, taken exactly from its bits (floor:
floor(log2 amax) - 8; ceil: + 1 when the mantissa exceeds 1.75), clamped to [-127, 127], -127 for an all-zero
block; codes = E4M3(clamp(x * 2^-e, +-448)); a block with NaN/Inf stores scale 0xFF and codes 0x7F. Slots < 0 and
slots not listed are left untouched. History: docs/kernels/quant.md.
"""

from __future__ import annotations

import torch

try:  # triton is optional: importing this module on a CPU machine without it must work
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _pow2(e):  # 2^e as float32 for integer e in [-126, 127]
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _mx_quant_kernel(X, SLOT, CODES, SCALES, KPE, ROPE, N, stride_x, stride_p, D: tl.constexpr,
                         BLOCK: tl.constexpr, BR: tl.constexpr, CEIL: tl.constexpr, PE: tl.constexpr):
        # BR rows per program: x [BR, D] -> codes [BR, D] and E8M0 scales [BR, D / BLOCK] at the rows' slots; with
        # PE > 0 also the rows' k_pe [BR, PE] -> bf16 rope pool at the same slots
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = rows < N
        slot = tl.load(SLOT + rows, mask=rm, other=-1).to(tl.int64)
        ok = rm & (slot >= 0)
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + tl.arange(0, D)[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        xb = tl.reshape(x, [BR, D // BLOCK, BLOCK])
        ax = tl.abs(xb)
        fin = ax < float("inf")  # False for NaN and +-Inf
        amax = tl.max(tl.where(fin, ax, 0.0), 2)
        bad = tl.min(fin.to(tl.int32), 2) == 0
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 255) - 127 - 8
        if CEIL:
            e += ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.where(amax > 0, e, -127)
        e = tl.minimum(tl.maximum(e, -127), 127)
        v = xb * _pow2(-e)[:, :, None]
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(bad[:, :, None], 0x7F, code).to(tl.uint8)
        sc = tl.where(bad, 255, e + 127).to(tl.uint8)
        tl.store(CODES + slot[:, None] * D + tl.arange(0, D)[None, :], tl.reshape(code, [BR, D]), mask=ok[:, None])
        tl.store(SCALES + slot[:, None] * (D // BLOCK) + tl.arange(0, D // BLOCK)[None, :], sc, mask=ok[:, None])
        if PE > 0:
            pe = tl.load(KPE + rows.to(tl.int64)[:, None] * stride_p + tl.arange(0, PE)[None, :], mask=ok[:, None],
                         other=0.0)
            tl.store(ROPE + slot[:, None] * PE + tl.arange(0, PE)[None, :], pe.to(tl.bfloat16), mask=ok[:, None])


if triton is not None:

    @triton.jit
    def _mx_dequant_kernel(CODES, SCALES, OUT, N, D: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr):
        # codes [N, D] uint8 (E4M3) and E8M0 scales [N, D / BLOCK] -> OUT [N, D] = code * 2^(scale - 127), a block
        # with scale 0xFF NaN; 2^-127 taken as 2^-126 * 0.5 (one rounding, as a float32 product with 2^-127)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = rows < N
        r64 = rows.to(tl.int64)
        code = tl.load(CODES + r64[:, None] * D + tl.arange(0, D)[None, :], mask=rm[:, None], other=0)
        v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = tl.load(SCALES + r64[:, None] * (D // BLOCK) + tl.arange(0, D // BLOCK)[None, :], mask=rm[:, None],
                     other=127).to(tl.int32)
        e = sc - 127
        f = _pow2(tl.maximum(e, -126)) * tl.where(e < -126, 0.5, 1.0)
        vb = tl.reshape(v, [BR, D // BLOCK, BLOCK]) * f[:, :, None]
        vb = tl.where((sc == 255)[:, :, None], float("nan"), vb)
        tl.store(OUT + r64[:, None] * D + tl.arange(0, D)[None, :], tl.reshape(vb, [BR, D]).to(OUT.dtype.element_ty),
                 mask=rm[:, None])


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


MX_BLOCKS = (32, 128)  # the block sizes the MX kernels are built for (index-K 32; the latent KV cache's tile 128)


def mxfp8_quantize_to_cache(x: torch.Tensor, slot_mapping: torch.Tensor, codes_cache: torch.Tensor,
                            scales_cache: torch.Tensor, rounding: str = "floor", block: int = 32) -> None:
    """x [N, D] float (D % block == 0, unit last stride) -> codes_cache [NB, BS, D] uint8 and scales_cache
    [NB, BS, D / block] uint8 (contiguous), written in place at the flat slots slot_mapping [N] (negative = skip)."""
    if triton is None:
        raise RuntimeError("quant Triton kernels need triton and a CUDA GPU")
    _need(rounding in ("floor", "ceil"),
          f"mxfp8_quantize_to_cache: rounding must be 'floor' or 'ceil', got {rounding!r}")
    _need(block in MX_BLOCKS, f"mxfp8_quantize_to_cache: block must be one of {MX_BLOCKS}, got {block}")
    N, D = x.shape
    _need(x.stride(1) == 1 and D % block == 0, f"mxfp8_quantize_to_cache: x must be [N, D] with D % {block} == 0 and "
          f"unit last stride, got {tuple(x.shape)} strides {x.stride()}")
    _need(codes_cache.dtype == torch.uint8 and codes_cache.shape[-1] == D and codes_cache.is_contiguous(),
          f"mxfp8_quantize_to_cache: codes_cache must be a contiguous uint8 [NB, BS, {D}] pool")
    _need(scales_cache.dtype == torch.uint8 and scales_cache.shape[-1] == D // block and scales_cache.is_contiguous(),
          f"mxfp8_quantize_to_cache: scales_cache must be a contiguous uint8 [NB, BS, {D // block}] pool")
    if N == 0:
        return
    br = 16
    _mx_quant_kernel[(triton.cdiv(N, br),)](x, slot_mapping, codes_cache, scales_cache, x, x, N, x.stride(0), 0,
                                            D=D, BLOCK=block, BR=br, CEIL=rounding == "ceil", PE=0, num_warps=4)


def _out(out: torch.Tensor | None, shape: tuple, dtypes: tuple, like: torch.Tensor, name: str) -> torch.Tensor:
    """out (checked: contiguous, this shape, one of dtypes, like's device), or a new tensor of dtypes[0]."""
    if out is None:
        return torch.empty(shape, dtype=dtypes[0], device=like.device)
    fits = tuple(out.shape) == tuple(shape) and out.dtype in dtypes and out.is_contiguous()
    _need(fits and out.device == like.device,
          f"{name} must be a contiguous {' or '.join(map(str, dtypes))} {tuple(shape)} tensor on {like.device}, got "
          f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def mxfp8_quantize(x: torch.Tensor, rounding: str = "floor", block: int = 32, *,
                   out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] uint8, scales [..., D / block] uint8); out: (codes, scales) to write instead
    (contiguous; codes uint8 or float8_e4m3fn), those very tensors returned."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(1) != 1:  # a strided view (a Slice with a step): the kernel reads unit-stride rows
        x2 = x2.contiguous()
    n = x2.shape[0]
    oc, os_ = out if out is not None else (None, None)
    codes = _out(oc, x.shape, (torch.uint8, torch.float8_e4m3fn), x, "mxfp8_quantize: out codes")
    scales = _out(os_, (*x.shape[:-1], D // block), (torch.uint8,), x, "mxfp8_quantize: out scales")
    mxfp8_quantize_to_cache(x2, torch.arange(n, device=x.device), codes.view(torch.uint8).view(n, 1, D),
                            scales.view(n, 1, D // block), rounding, block)
    return codes, scales


def mxfp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = 32, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """codes [..., D] (E4M3 bytes: uint8 or float8_e4m3fn) and E8M0 scales [..., D / block] uint8 -> values [..., D]
    in `dtype`: code * 2^(scale - 127), NaN where the scale byte is 0xFF (kimi.DequantizeMX's semantics); out: a
    contiguous `dtype` tensor of codes' shape to write instead (and return)."""
    if triton is None:
        raise RuntimeError("quant Triton kernels need triton and a CUDA GPU")
    D = codes.shape[-1]
    _need(D % block == 0 and tuple(scales.shape) == (*codes.shape[:-1], D // block),
          f"mxfp8_dequantize: scales must be {(*codes.shape[:-1], D // block)} for codes {tuple(codes.shape)}, "
          f"got {tuple(scales.shape)}")
    _need(D & (D - 1) == 0 and D >= block, f"mxfp8_dequantize: the last dim must be a power of two, got {D}")
    _need(scales.dtype == torch.uint8 and codes.dtype in (torch.uint8, torch.float8_e4m3fn),
          f"mxfp8_dequantize: codes must be uint8 or float8_e4m3fn and scales uint8, got {codes.dtype}, {scales.dtype}")
    c = codes.reshape(-1, D).contiguous().view(torch.uint8)
    sc = scales.reshape(-1, D // block).contiguous()
    n = c.shape[0]
    res = _out(out, codes.shape, (dtype,), codes, "mxfp8_dequantize: out")
    if n:
        br = 16
        _mx_dequant_kernel[(triton.cdiv(n, br),)](c, sc, res.view(n, D), n, D=D, BLOCK=block, BR=br, num_warps=4)
    return res


def mla_fp8_quantize_to_cache(c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
                              kv_codes: torch.Tensor, kv_scales: torch.Tensor, kv_rope: torch.Tensor) -> None:
    """c_kv [N, 512], k_pe [N, 64] (unit last strides) -> kv_codes [NB, BS, 512] uint8, kv_scales [NB, BS, 4] uint8
    (E8M0, ceil rule) and kv_rope [NB, BS, 64] bf16 (contiguous pools), written in place at the flat slots
    slot_mapping [N] (negative = skip)."""
    if triton is None:
        raise RuntimeError("quant Triton kernels need triton and a CUDA GPU")
    N = c_kv.shape[0]
    _need(c_kv.dim() == 2 and c_kv.shape[1] == 512 and c_kv.stride(1) == 1,
          f"mla_fp8_quantize_to_cache: c_kv must be [N, 512] with unit last stride, got {tuple(c_kv.shape)}")
    _need(tuple(k_pe.shape) == (N, 64) and k_pe.stride(1) == 1,
          f"mla_fp8_quantize_to_cache: k_pe must be [N={N}, 64] with unit last stride, got {tuple(k_pe.shape)}")
    for name, t, dt, d in (("kv_codes", kv_codes, torch.uint8, 512), ("kv_scales", kv_scales, torch.uint8, 4),
                           ("kv_rope", kv_rope, torch.bfloat16, 64)):
        _need(t.dtype == dt and t.shape[-1] == d and t.is_contiguous() and t.shape[:2] == kv_codes.shape[:2],
              f"mla_fp8_quantize_to_cache: {name} must be a contiguous {dt} [NB, BS, {d}] pool like kv_codes, "
              f"got {t.dtype} {tuple(t.shape)}")
    if N == 0:
        return
    br = 8
    _mx_quant_kernel[(triton.cdiv(N, br),)](c_kv, slot_mapping, kv_codes, kv_scales, k_pe, kv_rope, N, c_kv.stride(0),
                                            k_pe.stride(0), D=512, BLOCK=128, BR=br, CEIL=True, PE=64, num_warps=4)
