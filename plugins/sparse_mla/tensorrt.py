"""TensorRT lowering of kimi.SparseMLA (absorbed MLA over the indexer-selected positions of the paged latent pool).

tensorrt_rtx: native: GatherND of the selected latent rows, MatMuls, masked Softmax (the ONNX body). TensorRT's
IAttention layer takes dense or ragged K/V, not an index list, so it does not host this op.
tensorrt: a `kimi::SparseMLA` plugin (sparse FlashMLA-style kernel), planned (not implemented here): used only when a
creator is registered; otherwise native.
"""

from __future__ import annotations

from kimi_compile.lowering import Native, Plugin

_NATIVE = Native("gather of the selected latent rows + MatMul/Softmax/MatMul from the ONNX body (IAttention takes no "
                 "index list)")

TENSORRT = {"SparseMLA": {
    "tensorrt_rtx": _NATIVE,
    "tensorrt": Plugin("SparseMLA", "sparse MLA decode/prefill kernel as a quickly-deployable AOT plugin",
                       otherwise=_NATIVE, status="planned"),
}}
