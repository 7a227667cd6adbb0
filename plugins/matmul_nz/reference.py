"""NZ ("FRACTAL_NZ") blocked weight layout (optimizations.md §7.1) and the MatMulNZ reference.

Layout. For an ND array [..., M, N] and a fractal block (m0, n0), NZ is [..., N1, M', n0] with M' = ceil(M/m0)*m0,
N1 = ceil(N/n0): element (m, n) sits at [..., n // n0, m, n % n0]; padded positions hold zeros. Reading NZ in memory
order walks the columns of fractals in "N" order and each fractal row-major ("Z"), so every m0 x n0 fractal is one
contiguous block (512 B for 16x16 half precision). Example: ND (8, 100, 30) fp16 -> NZ (8, 2, 112, 16).

Block by dtype (nz_block): (16, 16) for 2- and 4-byte floats (fp16, bf16, fp32); (16, 32) for 1-byte types
(int8, uint8, fp8): a fractal row is always 32 bytes for the narrow types.

MatMulNZ: y = x @ W with W the plain [K, N] weight (K = in features, N = out features), i.e. W = torch Linear
``weight.T``; the NZ array is nd_to_nz(W), shape [ceil(N/n0), ceil(K/16)*16, n0].
"""

from __future__ import annotations

from typing import Any

import numpy as np

M0 = 16  # fractal rows: 16 for every dtype


def nz_block(dtype: Any) -> tuple[int, int]:
    """(m0, n0) fractal for a dtype: (16, 32) for 1-byte types, (16, 16) for 2- and 4-byte types."""
    dt = np.dtype(dtype)
    if dt.itemsize == 1:
        return (M0, 32)
    if dt.itemsize in (2, 4):
        return (M0, 16)
    raise ValueError(f"nz_block: dtype {dt} has no NZ fractal (expected 1-, 2- or 4-byte elements)")


def _check_block(block: Any) -> tuple[int, int]:
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, (int, np.integer)) and b > 0 for b in block)):
        raise ValueError(f"block must be a pair of positive ints (m0, n0), got {block!r}")
    return int(block[0]), int(block[1])


def nz_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """NZ shape of an ND shape [..., M, N]: [..., ceil(N/n0), ceil(M/m0)*m0, n0]."""
    m0, n0 = _check_block(block)
    if len(shape) < 2:
        raise ValueError(f"nz_shape: shape must have at least 2 dims [..., M, N], got {tuple(shape)}")
    *lead, m, n = shape
    return (*lead, -(-n // n0), -(-m // m0) * m0, n0)


def nd_to_nz(w: Any, block: tuple[int, int] | None = None) -> np.ndarray:
    """ND [..., M, N] -> NZ [..., N1, M', n0] (zero padded); block defaults to nz_block(w.dtype)."""
    w = np.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"nd_to_nz: w must have at least 2 dims [..., M, N], got shape {w.shape}")
    m0, n0 = _check_block(nz_block(w.dtype) if block is None else block)
    *lead, m, n = w.shape
    mp, n1 = -(-m // m0) * m0, -(-n // n0)
    padded = np.zeros((*lead, mp, n1 * n0), w.dtype)
    padded[..., :m, :n] = w
    nz = padded.reshape(*lead, mp, n1, n0)
    nz = np.moveaxis(nz, -2, -3)  # [..., N1, M', n0]
    return np.ascontiguousarray(nz)


def nz_to_nd(w_nz: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of nd_to_nz: NZ [..., N1, M', n0] -> ND `shape` [..., M, N] (padding dropped); exact."""
    w_nz = np.asarray(w_nz)
    shape = tuple(int(s) for s in shape)
    if w_nz.ndim != len(shape) + 1 or len(shape) < 2:
        raise ValueError(f"nz_to_nd: w_nz of shape {w_nz.shape} must have one more dim than shape {shape} (>= 2 dims)")
    *lead, n1, mp, n0 = w_nz.shape
    m, n = shape[-2:]
    if tuple(lead) != shape[:-2] or mp < m or not (n1 - 1) * n0 < n <= n1 * n0:
        raise ValueError(f"nz_to_nd: w_nz shape {w_nz.shape} [..., N1, M', n0] does not hold ND shape {shape}: "
                         f"expected leading dims {shape[:-2]}, M' >= {m}, N1 = ceil({n}/n0)")
    nd = np.moveaxis(w_nz, -3, -2).reshape(*lead, mp, n1 * n0)
    return np.ascontiguousarray(nd[..., : shape[-2], : shape[-1]])


def matmul_nz(x: Any, w_nz: Any, *, K: int, N: int) -> np.ndarray:
    """Reference of kimi.MatMulNZ: x [..., K] @ W [K, N] with W = nz_to_nd(w_nz, (K, N))."""
    w = nz_to_nd(w_nz, (K, N))
    x = np.asarray(x)
    if x.shape[-1] != K:
        raise ValueError(f"matmul_nz: x last dim {x.shape[-1]} must equal K={K}")
    return np.matmul(x, w)


def nd_to_nz_torch(w: Any, block: tuple[int, int] | None = None) -> Any:
    """Torch twin of nd_to_nz (same layout); block defaults by element size as nz_block."""
    import torch

    if w.dim() < 2:
        raise ValueError(f"nd_to_nz_torch: w must have at least 2 dims [..., M, N], got shape {tuple(w.shape)}")
    if block is None:
        block = (M0, 32) if w.element_size() == 1 else (M0, 16)
    m0, n0 = _check_block(block)
    *lead, m, n = w.shape
    mp, n1 = -(-m // m0) * m0, -(-n // n0)
    padded = torch.zeros((*lead, mp, n1 * n0), dtype=w.dtype, device=w.device)
    padded[..., :m, :n] = w
    return padded.reshape(*lead, mp, n1, n0).transpose(-2, -3).contiguous()
