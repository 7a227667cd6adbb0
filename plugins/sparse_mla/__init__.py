"""kimi.SparseMLA: MLA attention over the positions the indexer selected, read from the paged latent KV pool
(absorbed form: the query is folded into the latent, one 576-wide KV head shared by all query heads).

Inputs   q_nope [B,T,H,dn], q_pe [B,T,H,dr], kv_pool [NB,BS,R+dr] (normed c_kv then k_pe per token),
         block_table [B,MB] int64, indices [B,T,k] int64 (positions, -1 = none; from kimi.IndexerTopK),
         w_uk [H,dn,R], w_uv [H,dv,R] (kv_b_proj split per head)
         kv_scale_pool, kv_rope_pool, kv_rope_scale_pool (optional; a quantized latent cache, see kv_format)
Output   o [B,T,H,dv]
Attrs    scale (softmax scale, (dn+dr)^-0.5), kv_lora_rank (R);
         kv_format "float" (kv_pool holds float [c ‖ pe] rows) | "mxfp8" | "fp8_tile": kv_pool holds the uint8 FP8
         (`elem`) bit patterns of c [NB,BS,R], kv_scale_pool its scales per `tile` (E8M0 bytes for mxfp8, float32
         for fp8_tile); the RoPE part pe is in kv_rope_pool, stored per rope_format "float" (float32/float16 rows) |
         "mxfp8" | "fp8_tile" (codes, kv_rope_scale_pool scales per `rope_tile`). Only the selected rows are gathered
         and dequantized (as kimi.DequantizeMX / kimi.DequantizeFP8Tile). Quantized formats run the function
         overload `overload_name(...)`.
Math     q_lat = q_nope . w_uk;  s_j = (q_lat . c_j + q_pe . pe_j) * scale over the selected j;
         p = softmax(s);  o = (sum_j p_j c_j) . w_uv^T.  Equals dense MLA restricted to the selected set.
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference
from .body import overload_name  # noqa: F401 (the fusion pass names the overload it attaches)

NAME = body.NAME
function = body.sparse_mla  # the fusion pass builds the overloads it attaches


def infer(types, attrs):
    q, w_uv = types[0], types[6]
    shape = None
    if q and q.shape and w_uv and w_uv.shape:
        shape = (*q.shape[:3], w_uv.shape[1])
    return [TensorType(shape, q.dtype if q else TensorProto.FLOAT)]  # o in q_nope's dtype


OP = register(OpDef(NAME, body.INPUTS, body.OUTPUTS,
                    {"scale": 1.0, "kv_lora_rank": 512, "kv_format": "float", "rope_format": "float", "elem": "e4m3",
                     "tile": 128, "rope_tile": 128}, function=function, infer=infer,
                    reference=reference.sparse_mla, doc=__doc__, kind="fused"))
