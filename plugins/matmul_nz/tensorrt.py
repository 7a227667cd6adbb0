"""TensorRT lowering of kimi.MatMulNZ: native on both flavours.

The NZ fractal layout is an Ascend cube-unit layout with no benefit on NVIDIA GPUs. The body restores the plain
[K, N] weight with Transpose/Reshape/Slice of an initializer, which TensorRT constant-folds at build time, then runs
one MatMul (IMatrixMultiplyLayer): the engine holds the plain weight.
"""

from __future__ import annotations

from kimi_compile.lowering import Native

TENSORRT = {"MatMulNZ": {f: Native("NZ -> plain weight folded at build time (Transpose/Reshape/Slice of a constant), "
                                   "then MatMul") for f in ("tensorrt", "tensorrt_rtx")}}
