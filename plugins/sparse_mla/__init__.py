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

from onnx import TensorProto, helper

from kimi_compile.onnx_body import attr_const
from kimi_compile.ops import DOMAIN, ONNX_OPSET, OpDef, TensorType, register
from kimi_compile.plugins.indexer_topk import MASKED, _c, dequant_nodes, paged_keys_nodes

from . import reference

NAME = "SparseMLA"


_ref_const = attr_const


_KIND = {"mxfp8": "mx", "fp8_tile": "tile"}


def overload_name(kv_format: str = "float", rope_format: str = "float", elem: str = "e4m3") -> str:
    return "" if kv_format == "float" else f"{kv_format}_{elem}.rope_{rope_format}"


def _rows(pool: str, out: str) -> list:
    """The selected rows [B,T,k,.] of a paged pool (flat_idx, sel_shape from the body)."""
    n = helper.make_node
    return [*paged_keys_nodes(pool, "block_table", out + "_all"),
            n("GatherND", [out + "_all", "flat_idx"], [out + "_flat"], batch_dims=1),
            n("Reshape", [out + "_flat", "sel_shape"], [out])]


def function(kv_format: str = "float", rope_format: str = "float", elem: str = "e4m3"):
    n = helper.make_node
    if kv_format == "float":
        keys = [*paged_keys_nodes("kv_pool", "block_table", "keys"),  # [B,S,C]
                n("GatherND", ["keys", "flat_idx"], ["rows"], batch_dims=1),  # [B, T*k, C]
                n("Reshape", ["rows", "sel_shape"], ["sel"])]  # [B,T,k,C]
    elif kv_format in _KIND and rope_format in ("float", *_KIND):
        keys = [*_rows("kv_pool", "c_codes"), *_rows("kv_scale_pool", "c_scale"),
                *dequant_nodes("c_codes", "c_scale", "c_rows", _KIND[kv_format], elem, "tile"),
                *_rows("kv_rope_pool", "pe_stored")]
        if rope_format == "float":
            keys.append(n("Cast", ["pe_stored"], ["pe_rows"], to=TensorProto.FLOAT))
        else:
            keys += [*_rows("kv_rope_scale_pool", "pe_scale"),
                     *dequant_nodes("pe_stored", "pe_scale", "pe_rows", _KIND[rope_format], elem, "rope_tile")]
        keys.append(n("Concat", ["c_rows", "pe_rows"], ["sel"], axis=-1))
    else:
        raise ValueError(f"kimi.SparseMLA: unknown kv_format/rope_format {kv_format!r}/{rope_format!r}")
    nodes = [
        _c("zero", [0], dims=[]), _c("ax1", [1]), _c("axm1", [-1]), _c("big", [1 << 62]),
        n("GreaterOrEqual", ["indices", "zero"], ["valid"]),
        n("Where", ["valid", "indices", "zero"], ["safe"]),
        n("Shape", ["safe"], ["bt"], start=0, end=2),
        n("Shape", ["safe"], ["b"], start=0, end=1),
        n("Concat", ["b", "axm1", "ax1"], ["flat_shape"], axis=0),
        n("Reshape", ["safe", "flat_shape"], ["flat_idx"]),  # [B, T*k, 1]
        n("Shape", ["safe"], ["k"], start=2, end=3),
        n("Concat", ["bt", "k", "axm1"], ["sel_shape"], axis=0),
        *keys,
        _ref_const("R0", "kv_lora_rank", "value_int"),
        n("Reshape", ["R0", "axm1"], ["R"]),
        n("Slice", ["sel", "zero1", "R", "axm1"], ["c"]),
        n("Slice", ["sel", "R", "big", "axm1"], ["pe"]),
        n("Einsum", ["q_nope", "w_uk"], ["q_lat"], equation="bthd,hdr->bthr"),
        n("Einsum", ["q_lat", "c"], ["s_lat"], equation="bthr,btkr->bhtk"),
        n("Einsum", ["q_pe", "pe"], ["s_pe"], equation="bthd,btkd->bhtk"),
        n("Add", ["s_lat", "s_pe"], ["s_raw"]),
        _ref_const("scale", "scale", "value_float"),
        n("Mul", ["s_raw", "scale"], ["s"]),
        n("Unsqueeze", ["valid", "ax1"], ["valid_h"]),
        _c("masked", [MASKED], TensorProto.FLOAT, dims=[]),
        n("Where", ["valid_h", "s", "masked"], ["s_masked"]),
        n("Softmax", ["s_masked"], ["p"], axis=-1),
        n("Einsum", ["p", "c"], ["o_lat"], equation="bhtk,btkr->bthr"),
        n("Einsum", ["o_lat", "w_uv"], ["o"], equation="bthr,hvr->bthv"),
    ]
    nodes.insert(0, _c("zero1", [0]))
    if kv_format == "float":
        return helper.make_function(DOMAIN, NAME, ["q_nope", "q_pe", "kv_pool", "block_table", "indices", "w_uk",
                                                   "w_uv"], ["o"], nodes, [helper.make_opsetid("", ONNX_OPSET)],
                                    attributes=["scale", "kv_lora_rank"])
    return helper.make_function(DOMAIN, NAME, list(INPUTS), ["o"], nodes,
                                [helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, 1)],
                                attributes=["scale", "kv_lora_rank", "kv_format", "rope_format", "elem", "tile",
                                            "rope_tile"], overload=overload_name(kv_format, rope_format, elem))


def infer(types, attrs):
    q, w_uv = types[0], types[6]
    shape = None
    if q and q.shape and w_uv and w_uv.shape:
        shape = (*q.shape[:3], w_uv.shape[1])
    return [TensorType(shape, TensorProto.FLOAT)]


INPUTS = ("q_nope", "q_pe", "kv_pool", "block_table", "indices", "w_uk", "w_uv", "kv_scale_pool", "kv_rope_pool",
          "kv_rope_scale_pool")
OP = register(OpDef(NAME, INPUTS, ("o",),
                    {"scale": 1.0, "kv_lora_rank": 512, "kv_format": "float", "rope_format": "float", "elem": "e4m3",
                     "tile": 128, "rope_tile": 128}, function=function, infer=infer, reference=reference.sparse_mla,
                    doc=__doc__))
