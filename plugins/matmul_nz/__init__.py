"""kimi.MatMulNZ: y = x @ W with the weight stored in the NZ fractal layout (reference.py has the layout).

Inputs: x [..., K] (float32/float16/bfloat16), w_nz [N1, K', n0] = nd_to_nz(W) of the plain weight W [K, N]
(W = torch Linear weight.T), same dtype as x. Attributes K, N: the plain weight's dims (required, positive).
Output: y [..., N], dtype of x. The ONNX body restores W with Transpose/Reshape/Slice and runs MatMul, so the result
equals x @ W computed by ONNX Runtime's MatMul.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference
from .reference import matmul_nz, nd_to_nz, nz_block, nz_shape, nz_to_nd

__all__ = ["matmul_nz", "nd_to_nz", "nz_block", "nz_shape", "nz_to_nd"]

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_ATTRS = {"K": 0, "N": 0}  # 0 = unset; inference rejects it


def _infer(types: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    unknown = sorted(set(attrs) - set(_ATTRS))
    if unknown:
        raise ValueError(f"kimi.MatMulNZ: unknown attribute(s) {unknown}; expected ['K', 'N']")
    k, n = attrs.get("K", 0), attrs.get("N", 0)
    for name, v in (("K", k), ("N", n)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"kimi.MatMulNZ: attribute {name} must be a positive int (plain weight dims), got {v!r}")
    x, w = types[0], types[1]
    for nm, t in (("x", x), ("w_nz", w)):
        if t is not None and t.dtype not in _FLOATS:
            raise ValueError(f"kimi.MatMulNZ: input {nm} must be float32/float16/bfloat16, "
                             f"got {TensorProto.DataType.Name(t.dtype)}")
    if x is not None and w is not None and x.dtype != w.dtype:
        raise ValueError(f"kimi.MatMulNZ: inputs x and w_nz must share a dtype, got "
                         f"{TensorProto.DataType.Name(x.dtype)} and {TensorProto.DataType.Name(w.dtype)}")
    if w is not None and w.shape is not None:
        if len(w.shape) != 3:
            raise ValueError(f"kimi.MatMulNZ: input w_nz must be 3-D [N1, K', n0], got shape {w.shape}")
        n1, kp, n0 = w.shape
        if isinstance(kp, int) and kp < k:
            raise ValueError(f"kimi.MatMulNZ: input w_nz dim 1 (K'={kp}) must be >= attribute K={k}")
        if isinstance(n1, int) and isinstance(n0, int) and not (n1 - 1) * n0 < n <= n1 * n0:
            raise ValueError(f"kimi.MatMulNZ: input w_nz [N1={n1}, K', n0={n0}] must hold N={n} columns "
                             f"(N1 = ceil(N / n0))")
    if x is None or x.shape is None:
        return [TensorType(None, x.dtype if x is not None else TensorProto.FLOAT)]
    if not x.shape:
        raise ValueError("kimi.MatMulNZ: input x must have at least one axis [..., K], got a scalar")
    if isinstance(x.shape[-1], int) and x.shape[-1] != k:
        raise ValueError(f"kimi.MatMulNZ: input x last dim {x.shape[-1]} must equal attribute K={k}")
    return [TensorType((*x.shape[:-1], n), x.dtype)]


MATMUL_NZ = register(
    OpDef("MatMulNZ", ("x", "w_nz"), ("y",), dict(_ATTRS), body.matmul_nz, _infer, reference.matmul_nz,
          doc="y = x @ W, W [K, N] given in the NZ fractal layout [ceil(N/n0), ceil(K/16)*16, n0]", kind="fused")
)
