"""ONNX function body of kimi.IndexerTopK (standard ops, attached as a local function; ONNX Runtime inlines it).

Float keys: paged gather -> Einsum q.k -> Relu -> weighted head sum -> causal mask (MASKED) -> pad to k -> TopK
(ties to the lower position) -> indices -1 / scores MASKED where fewer than k positions are visible.
A quantized format (k_format mxfp8) is the overload `overload_name(k_format, elem)`: the codes and E8M0 scales are
gathered per row and dequantized as kimi.DequantizeMX (plugins/quant/body.py `dequant_nodes`).
"""

from __future__ import annotations

from onnx import FunctionProto, TensorProto, helper

from kimi_compile.onnx_body import MASKED, attr_const, causal_mask_nodes, const, function, paged_keys_nodes
from kimi_compile.plugins.quant.body import dequant_nodes

NAME = "IndexerTopK"
INPUTS = ("q", "w", "index_pool", "block_table", "start", "lengths", "index_scale_pool")
OUTPUTS = ("indices", "scores")
SORTED = {"sorted": 1}  # the attribute with a default (the op's order; the relax_topk_order pass sets 0)


def overload_name(k_format: str = "float", elem: str = "e4m3") -> str:
    return "" if k_format == "float" else f"{k_format}_{elem}"


def indexer_topk(k_format: str = "float", elem: str = "e4m3") -> FunctionProto:
    n = helper.make_node
    if k_format == "float":
        keys = paged_keys_nodes("index_pool", "block_table", "keys")
    elif k_format == "mxfp8":
        keys = [*paged_keys_nodes("index_pool", "block_table", "kcodes"),
                *paged_keys_nodes("index_scale_pool", "block_table", "kscale"),
                *dequant_nodes("kcodes", "kscale", "keys", "mx", elem, "block")]
    else:
        raise ValueError(f"kimi.IndexerTopK: k_format must be float or mxfp8, got {k_format!r}")
    nodes = [
        *keys,
        n("Einsum", ["q", "keys"], ["dots"], equation="bthd,bsd->bths"),
        n("Relu", ["dots"], ["relu"]),
        const("axm1", [-1]), const("ax2", [2]), const("ax0", [0]),
        n("Unsqueeze", ["w", "axm1"], ["w4"]),
        n("Mul", ["relu", "w4"], ["weighted"]),
        n("ReduceSum", ["weighted", "ax2"], ["raw"], keepdims=0),
        *causal_mask_nodes("q", "keys", "start", "lengths", "allowed"),
        const("masked", [MASKED], TensorProto.FLOAT, dims=[]),
        n("Where", ["allowed", "raw", "masked"], ["score"]),
        attr_const("k0", "topk", "value_int"),
        n("Reshape", ["k0", "axm1"], ["k"]),
        n("Shape", ["q"], ["bt"], start=0, end=2),
        n("Concat", ["bt", "k"], ["pad_shape"], axis=0),
        n("Expand", ["masked", "pad_shape"], ["pad"]),
        n("Concat", ["score", "pad"], ["padded"], axis=-1),
        n("TopK", ["padded", "k"], ["vals", "idx"], axis=-1, largest=1, sorted=1),
        n("ConstantOfShape", ["pad_shape"], ["nopad"], value=helper.make_tensor("f", TensorProto.BOOL, [1], [0])),
        n("Concat", ["allowed", "nopad"], ["allowed_p"], axis=-1),
        n("GatherElements", ["allowed_p", "idx"], ["valid"], axis=-1),
        const("minus1", [-1], dims=[]),
        n("Where", ["valid", "idx", "minus1"], ["indices"]),
        n("Where", ["valid", "vals", "masked"], ["scores"]),
    ]
    # sorted (1, the default): indices by score descending then position ascending; 0 allows any order (a set-reading
    # consumer such as kimi.SparseMLA). The body sorts either way: a sorted selection is also a valid unsorted one.
    if k_format == "float":
        return function(NAME, INPUTS[:6], OUTPUTS, nodes, ["topk"], defaults=SORTED)
    return function(NAME, INPUTS, OUTPUTS, nodes, ["topk", "k_format", "block", "elem"], defaults=SORTED,
                    overload=overload_name(k_format, elem), calls_kimi=True)
