"""Triton quantize kernels that write the paged caches in place (semantics: plugins/quant/reference.py).

- `mxfp8_quantize_to_cache`: x [N, D] -> MXFP8 E4M3 codes [NB, BS, D] u8 + E8M0 scales [NB, BS, D/32] u8 at the flat
  slots slot_mapping[n] (< 0 = skip). rounding "floor" (OCP, saturating) or "ceil" (DeepSeek ue8m0), the exponent
  taken exactly from the bits of amax; a block with NaN/Inf stores scale 0xFF and codes 0x7F. The index-K cache.
- `mla_fp8_quantize_to_cache`: c_kv [N, 512] + k_pe [N, 64] -> the 656-byte FlashMLA row (512 E4M3 codes, 4 fp32
  ue8m0 tile scales 2^ceil(log2(max(amax, 1e-4) / 448)), 64 bf16) at slot_mapping[n].
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
    def _mx_quant_kernel(X, SLOT, CODES, SCALES, N, stride_x, D: tl.constexpr, BR: tl.constexpr,
                         CEIL: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = rows < N
        slot = tl.load(SLOT + rows, mask=rm, other=-1).to(tl.int64)
        ok = rm & (slot >= 0)
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + tl.arange(0, D)[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        xb = tl.reshape(x, [BR, D // 32, 32])
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
        tl.store(SCALES + slot[:, None] * (D // 32) + tl.arange(0, D // 32)[None, :], sc, mask=ok[:, None])

    @triton.jit
    def _mla_quant_kernel(CKV, KPE, SLOT, C8, C32, C16, N, stride_c, stride_p, BR: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = rows < N
        slot = tl.load(SLOT + rows, mask=rm, other=-1).to(tl.int64)
        ok = rm & (slot >= 0)
        r64 = rows.to(tl.int64)
        x = tl.load(CKV + r64[:, None] * stride_c + tl.arange(0, 512)[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        xb = tl.reshape(x, [BR, 4, 128])
        ax = tl.abs(xb)
        fin = ax < float("inf")
        amax = tl.maximum(tl.max(tl.where(fin, ax, 0.0), 2), 1e-4)
        bad = tl.min(fin.to(tl.int32), 2) == 0
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 255) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        v = tl.minimum(tl.maximum(xb * _pow2(-e)[:, :, None], -448.0), 448.0)
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(bad[:, :, None], 0x7F, code).to(tl.uint8)
        scale = tl.where(bad, float("nan"), _pow2(e))
        tl.store(C8 + slot[:, None] * 656 + tl.arange(0, 512)[None, :], tl.reshape(code, [BR, 512]), mask=ok[:, None])
        tl.store(C32 + slot[:, None] * 164 + 128 + tl.arange(0, 4)[None, :], scale, mask=ok[:, None])
        pe = tl.load(KPE + r64[:, None] * stride_p + tl.arange(0, 64)[None, :], mask=ok[:, None], other=0.0)
        tl.store(C16 + slot[:, None] * 328 + 264 + tl.arange(0, 64)[None, :], pe.to(tl.bfloat16), mask=ok[:, None])


def _need_triton():
    if triton is None:
        raise RuntimeError("quant Triton kernels need triton and a CUDA GPU")


def mxfp8_quantize_to_cache(x: torch.Tensor, slot_mapping: torch.Tensor, codes_cache: torch.Tensor,
                            scales_cache: torch.Tensor, rounding: str = "floor", br: int = 16) -> None:
    """x [N, D] (D % 32 == 0, unit last stride) -> codes_cache [NB, BS, D] u8 and scales_cache [NB, BS, D/32] u8,
    written in place at flat slots slot_mapping [N] (negative = skip)."""
    _need_triton()
    if rounding not in ("floor", "ceil"):
        raise ValueError(f"rounding must be 'floor' or 'ceil', got {rounding!r}")
    N, D = x.shape
    assert x.stride(1) == 1 and D % 32 == 0 and codes_cache.shape[-1] == D and scales_cache.shape[-1] == D // 32
    if N == 0:
        return
    _mx_quant_kernel[(triton.cdiv(N, br),)](x, slot_mapping, codes_cache, scales_cache, N, x.stride(0), D=D, BR=br,
                                            CEIL=rounding == "ceil", num_warps=4)


def mxfp8_quantize(x: torch.Tensor, rounding: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] u8, scales [..., D/32] u8)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    n = x2.shape[0]
    codes = torch.empty(n, 1, D, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, 1, D // 32, dtype=torch.uint8, device=x.device)
    mxfp8_quantize_to_cache(x2, torch.arange(n, device=x.device), codes, scales, rounding)
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], D // 32)


def mla_fp8_quantize_to_cache(c_kv: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
                              kv_cache: torch.Tensor, br: int = 8) -> None:
    """c_kv [N, 512], k_pe [N, 64] -> kv_cache [NB, BS, 656] u8 rows at flat slots slot_mapping [N] (negative = skip)."""
    _need_triton()
    N = c_kv.shape[0]
    assert c_kv.shape[1] == 512 and k_pe.shape[1] == 64 and kv_cache.shape[-1] == 656 and kv_cache.is_contiguous()
    assert c_kv.stride(1) == 1 and k_pe.stride(1) == 1
    if N == 0:
        return
    flat = kv_cache.view(-1, 656)
    _mla_quant_kernel[(triton.cdiv(N, br),)](c_kv, k_pe, slot_mapping, flat, flat.view(torch.float32),
                                             flat.view(torch.bfloat16), N, c_kv.stride(0), k_pe.stride(0), BR=br,
                                             num_warps=4)
