"""TensorRT lowering of kimi.IndexerTopK (indexer scores over the paged index-K pool + causal mask + top-k).

tensorrt_rtx: native: paged Gather, Einsum/ReLU/weighted ReduceSum, mask, ITopKLayer. ONNX TopK imports only with
K < 3840 and sorted=1 (onnx-tensorrt operator table); the lowering refuses a larger topk with the node named.
tensorrt: a `kimi::IndexerTopK` plugin (fused score + radix top-k that never writes the [B,T,S] scores), planned (not
implemented here): used only when a creator is registered; otherwise the same native network.
"""

from __future__ import annotations

import onnx
from onnx import helper

from kimi_compile.lowering import LoweringError, Native, Plugin

TOPK_LIMIT = 3840  # TensorRT's ITopKLayer / ONNX TopK import: K < 3840


def check_topk(call: onnx.NodeProto, body: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    k = next((helper.get_attribute_value(a) for a in call.attribute if a.name == "topk"), None)
    if isinstance(k, int) and k >= TOPK_LIMIT:
        raise LoweringError(f"kimi.IndexerTopK (node {call.name!r}): topk={k} >= {TOPK_LIMIT}, beyond TensorRT's "
                            f"TopK layer; register the kimi::IndexerTopK plugin or lower the indexer topk")
    return body


_NATIVE = Native("scores (paged Gather, Einsum, ReLU, weighted ReduceSum), causal mask, TopK -> ITopKLayer "
                 "(K < 3840, sorted)", rewrite=check_topk)

TENSORRT = {"IndexerTopK": {
    "tensorrt_rtx": _NATIVE,
    "tensorrt": Plugin("IndexerTopK", "fused score + radix top-k (no [B,T,S] score tensor) as a quickly-deployable "
                       "AOT plugin", otherwise=_NATIVE, status="planned"),
}}
