"""kimi.IndexerTopK: the K3.1 lightning indexer's score, ReLU, head weighting, causal mask and top-k in one op that
reads the paged index-K pool through the block table (no score tensor is written back).

Inputs   q [B,T,H,D] (index queries), w [B,T,H] (head weights, scales folded in), index_pool [NB,BS,D],
         block_table [B,MB] int64, start [B] int64 (tokens cached before this step), lengths [B] int64
Outputs  indices [B,T,k] int64: the k highest-scoring visible positions per query, ties to the lower position,
         -1 where fewer than k positions are visible, sorted by score descending, then position ascending
         (sorted=0: the same positions and scores in any order); scores [B,T,k] (fp32, -1e30 where invalid)
         index_scale_pool [NB,BS,D/block] uint8 (optional; with k_format mxfp8: one E8M0 byte per block)
Attrs    topk (k); sorted (1: the order above; 0: any order, for consumers that read the selection as a set, as
         kimi.SparseMLA does: the relax_topk_order pass sets it, and the cuda backend's kernel then skips its rank
         stage); k_format "float" (index_pool holds float keys) | "mxfp8" (index_pool holds the uint8 bit patterns
         of FP8 codes, `elem` e4m3 | e5m2, dequantized per gathered row as kimi.DequantizeMX[block]); block (32)
         A quantized format runs the function overload named by `overload_name(attrs)` ("" for float).
Score    I[b,t,s] = sum_h w[b,t,h] * relu(q[b,t,h] . K[b,s]),  K = the pool rows of sequence b (position s at block
         block_table[b, s // BS], row s % BS); visible: s <= start[b] + t and s < start[b] + lengths[b].
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference
from .body import overload_name  # noqa: F401 (the fusion pass names the overload it attaches)

NAME = body.NAME
function = body.indexer_topk  # the fusion pass builds the overloads it attaches


def infer(types, attrs):
    q = types[0]
    k = attrs.get("topk")
    shape = (q.shape[0], q.shape[1], k) if q and q.shape else None
    return [TensorType(shape, TensorProto.INT64), TensorType(shape, TensorProto.FLOAT)]


OP = register(OpDef(NAME, body.INPUTS, body.OUTPUTS,
                    {"topk": 2048, **body.SORTED, "k_format": "float", "block": 32, "elem": "e4m3"},
                    function=function, infer=infer, reference=reference.indexer_topk, doc=__doc__,
                    float32_ports=frozenset({"scores"}), kind="fused"))
