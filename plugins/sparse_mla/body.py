"""ONNX function body of kimi.SparseMLA (standard ops, attached as a local function; ONNX Runtime inlines it).

The selected rows [B,T,k,.] are gathered from the paged pools (GatherND over the flattened indices), the latent
query is q_nope . w_uk, masked scores (MASKED where the index is -1) go through Softmax, and o = (p . c) . w_uv^T.
A quantized latent cache (kv_format mxfp8 | fp8_tile) is the overload `overload_name(...)`: codes and scales of the
selected rows only are dequantized (plugins/quant/body.py `dequant_nodes`).
"""

from __future__ import annotations

from onnx import FunctionProto, NodeProto, TensorProto, helper

from kimi_compile.onnx_body import MASKED, attr_const, const, function, paged_keys_nodes
from kimi_compile.plugins.quant.body import dequant_nodes

NAME = "SparseMLA"
INPUTS = ("q_nope", "q_pe", "kv_pool", "block_table", "indices", "w_uk", "w_uv", "kv_scale_pool", "kv_rope_pool",
          "kv_rope_scale_pool")
OUTPUTS = ("o",)
_KIND = {"mxfp8": "mx", "fp8_tile": "tile"}


def overload_name(kv_format: str = "float", rope_format: str = "float", elem: str = "e4m3") -> str:
    return "" if kv_format == "float" else f"{kv_format}_{elem}.rope_{rope_format}"


def _rows(pool: str, out: str) -> list[NodeProto]:
    """The selected rows [B,T,k,.] of a paged pool (flat_idx, sel_shape from the body)."""
    n = helper.make_node
    return [*paged_keys_nodes(pool, "block_table", out + "_all"),
            n("GatherND", [out + "_all", "flat_idx"], [out + "_flat"], batch_dims=1),
            n("Reshape", [out + "_flat", "sel_shape"], [out])]


def sparse_mla(kv_format: str = "float", rope_format: str = "float", elem: str = "e4m3") -> FunctionProto:
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
        const("zero", [0], dims=[]), const("ax1", [1]), const("axm1", [-1]), const("big", [1 << 62]),
        n("GreaterOrEqual", ["indices", "zero"], ["valid"]),
        n("Where", ["valid", "indices", "zero"], ["safe"]),
        n("Shape", ["safe"], ["bt"], start=0, end=2),
        n("Shape", ["safe"], ["b"], start=0, end=1),
        n("Concat", ["b", "axm1", "ax1"], ["flat_shape"], axis=0),
        n("Reshape", ["safe", "flat_shape"], ["flat_idx"]),  # [B, T*k, 1]
        n("Shape", ["safe"], ["k"], start=2, end=3),
        n("Concat", ["bt", "k", "axm1"], ["sel_shape"], axis=0),
        *keys,
        attr_const("R0", "kv_lora_rank", "value_int"),
        n("Reshape", ["R0", "axm1"], ["R"]),
        n("Slice", ["sel", "zero1", "R", "axm1"], ["c"]),
        n("Slice", ["sel", "R", "big", "axm1"], ["pe"]),
        n("Einsum", ["q_nope", "w_uk"], ["q_lat"], equation="bthd,hdr->bthr"),
        n("Einsum", ["q_lat", "c"], ["s_lat"], equation="bthr,btkr->bhtk"),
        n("Einsum", ["q_pe", "pe"], ["s_pe"], equation="bthd,btkd->bhtk"),
        n("Add", ["s_lat", "s_pe"], ["s_raw"]),
        attr_const("scale", "scale", "value_float"),
        n("Mul", ["s_raw", "scale"], ["s"]),
        n("Unsqueeze", ["valid", "ax1"], ["valid_h"]),
        const("masked", [MASKED], TensorProto.FLOAT, dims=[]),
        n("Where", ["valid_h", "s", "masked"], ["s_masked"]),
        n("Softmax", ["s_masked"], ["p"], axis=-1),
        n("Einsum", ["p", "c"], ["o_lat"], equation="bhtk,btkr->bthr"),
        n("Einsum", ["o_lat", "w_uv"], ["o"], equation="bthr,hvr->bthv"),
    ]
    nodes.insert(0, const("zero1", [0]))
    if kv_format == "float":
        return function(NAME, INPUTS[:7], OUTPUTS, nodes, ["scale", "kv_lora_rank"])
    return function(NAME, INPUTS, OUTPUTS, nodes, ["scale", "kv_lora_rank", "kv_format", "rope_format", "elem", "tile",
                                                   "rope_tile"], overload=overload_name(kv_format, rope_format, elem),
                    calls_kimi=True)
