"""kimi.IndexerTopK: the K3.1 lightning indexer's score, ReLU, head weighting, causal mask and top-k in one op that
reads the paged index-K pool through the block table (no score tensor is written back).

Inputs   q [B,T,H,D] (index queries), w [B,T,H] (head weights, scales folded in), index_pool [NB,BS,D],
         block_table [B,MB] int64, start [B] int64 (tokens cached before this step), lengths [B] int64
Outputs  indices [B,T,k] int64: the k highest-scoring visible positions per query, ties to the lower position,
         -1 where fewer than k positions are visible; scores [B,T,k] (fp32, -1e30 where invalid)
         index_scale_pool [NB,BS,D/block] uint8 (optional; with k_format mxfp8: one E8M0 byte per block)
Attrs    topk (k); k_format "float" (index_pool holds float keys) | "mxfp8" (index_pool holds the uint8 bit patterns
         of FP8 codes, `elem` e4m3 | e5m2, dequantized per gathered row as kimi.DequantizeMX[block]); block (32)
         A quantized format runs the function overload named by `overload_name(attrs)` ("" for float).
Score    I[b,t,s] = sum_h w[b,t,h] * relu(q[b,t,h] . K[b,s]),  K = the pool rows of sequence b (position s at block
         block_table[b, s // BS], row s % BS); visible: s <= start[b] + t and s < start[b] + lengths[b].
"""

from __future__ import annotations

from onnx import AttributeProto, TensorProto, helper

from kimi_compile.onnx_body import attr_const, const
from kimi_compile.ops import DOMAIN, ONNX_OPSET, OpDef, TensorType, register

from . import reference
from .reference import MASKED

NAME = "IndexerTopK"


_c = const


def causal_mask_nodes(q: str, keys: str, start: str, lengths: str, out: str) -> list:
    """ONNX nodes computing allowed[b,t,s] = s <= start[b]+t and s < start[b]+lengths[b] (shared with SparseMLA)."""
    n = helper.make_node
    p = out + "_"
    return [
        _c(p + "zero", [0], dims=[]), _c(p + "one", [1], dims=[]), _c(p + "ax0", [0]), _c(p + "ax1", [1]),
        _c(p + "axm1", [-1]), _c(p + "ax01", [0, 1]),
        n("Shape", [q], [p + "tshape"], start=1, end=2), n("Squeeze", [p + "tshape", p + "ax0"], [p + "T"]),
        n("Shape", [keys], [p + "sshape"], start=1, end=2), n("Squeeze", [p + "sshape", p + "ax0"], [p + "S"]),
        n("Range", [p + "zero", p + "T", p + "one"], [p + "tpos"]),
        n("Range", [p + "zero", p + "S", p + "one"], [p + "spos"]),
        n("Unsqueeze", [start, p + "ax1"], [p + "start2"]),
        n("Unsqueeze", [p + "tpos", p + "ax0"], [p + "tpos2"]),
        n("Add", [p + "start2", p + "tpos2"], [p + "qpos"]),  # [B,T]
        n("Unsqueeze", [p + "qpos", p + "axm1"], [p + "qpos3"]),  # [B,T,1]
        n("Unsqueeze", [p + "spos", p + "ax01"], [p + "spos3"]),  # [1,1,S]
        n("Add", [start, lengths], [p + "end"]),
        n("Unsqueeze", [p + "end", p + "ax1"], [p + "end2"]),
        n("Unsqueeze", [p + "end2", p + "ax1"], [p + "end3"]),  # [B,1,1]
        n("LessOrEqual", [p + "spos3", p + "qpos3"], [p + "causal"]),
        n("Less", [p + "spos3", p + "end3"], [p + "inseq"]),
        n("And", [p + "causal", p + "inseq"], [out]),
    ]


def paged_keys_nodes(pool: str, block_table: str, out: str) -> list:
    """ONNX nodes gathering a sequence-major view [B, MB*BS, D] of a paged pool."""
    n = helper.make_node
    p = out + "_"
    return [
        _c(p + "neg1", [-1]),
        n("Reshape", [block_table, p + "neg1"], [p + "flat_bt"]),
        n("Gather", [pool, p + "flat_bt"], [p + "blocks"], axis=0),
        n("Shape", [block_table], [p + "b"], start=0, end=1),
        n("Shape", [pool], [p + "d"], start=-1),
        n("Concat", [p + "b", p + "neg1", p + "d"], [p + "shape"], axis=0),
        n("Reshape", [p + "blocks", p + "shape"], [out]),
    ]


def overload_name(k_format: str = "float", elem: str = "e4m3") -> str:
    return "" if k_format == "float" else f"{k_format}_{elem}"


def dequant_nodes(codes: str, scale: str, out: str, kind: str, elem: str, block_attr: str) -> list:
    """ONNX nodes dequantizing gathered rows exactly as `quantize` reads its pools: uint8 bits -> FP8 codes (table
    lookup, Cast) -> kimi.DequantizeMX (kind mx, E8M0 scales) | kimi.DequantizeFP8Tile (kind tile, float32 scales)."""
    from kimi_compile.plugins.quant.reference import code_table, elem_format

    n = helper.make_node
    p = out + "_"
    table = code_table(elem)
    deq = n("DequantizeMX" if kind == "mx" else "DequantizeFP8Tile", [p + "q", scale], [out], domain=DOMAIN)
    a = helper.make_attribute("block" if kind == "mx" else "tile", 0)
    a.ref_attr_name = block_attr
    a.type = AttributeProto.INT
    deq.attribute.append(a)
    return [
        n("Cast", [codes], [p + "i"], to=TensorProto.INT32),
        _c(p + "table", table.tolist(), TensorProto.FLOAT, dims=[256]),
        n("Gather", [p + "table", p + "i"], [p + "v"], axis=0),
        n("Cast", [p + "v"], [p + "q"], to=elem_format(elem).onnx_type),
        deq,
    ]


def function(k_format: str = "float", elem: str = "e4m3"):
    n = helper.make_node
    if k_format == "float":
        keys = paged_keys_nodes("index_pool", "block_table", "keys")
    elif k_format == "mxfp8":
        keys = [*paged_keys_nodes("index_pool", "block_table", "kcodes"),
                *paged_keys_nodes("index_scale_pool", "block_table", "kscale"),
                *dequant_nodes("kcodes", "kscale", "keys", "mx", elem, "block")]
    else:
        raise ValueError(f"kimi.IndexerTopK: k_format must be float or mxfp8, got {k_format!r}")
    k_node = attr_const("k0", "topk", "value_int")
    nodes = [
        *keys,
        n("Einsum", ["q", "keys"], ["dots"], equation="bthd,bsd->bths"),
        n("Relu", ["dots"], ["relu"]),
        _c("axm1", [-1]), _c("ax2", [2]), _c("ax0", [0]),
        n("Unsqueeze", ["w", "axm1"], ["w4"]),
        n("Mul", ["relu", "w4"], ["weighted"]),
        n("ReduceSum", ["weighted", "ax2"], ["raw"], keepdims=0),
        *causal_mask_nodes("q", "keys", "start", "lengths", "allowed"),
        _c("masked", [MASKED], TensorProto.FLOAT, dims=[]),
        n("Where", ["allowed", "raw", "masked"], ["score"]),
        k_node,
        n("Reshape", ["k0", "axm1"], ["k"]),
        n("Shape", ["q"], ["bt"], start=0, end=2),
        n("Concat", ["bt", "k"], ["pad_shape"], axis=0),
        n("Expand", ["masked", "pad_shape"], ["pad"]),
        n("Concat", ["score", "pad"], ["padded"], axis=-1),
        n("TopK", ["padded", "k"], ["vals", "idx"], axis=-1, largest=1, sorted=1),
        n("ConstantOfShape", ["pad_shape"], ["nopad"], value=helper.make_tensor("f", TensorProto.BOOL, [1], [0])),
        n("Concat", ["allowed", "nopad"], ["allowed_p"], axis=-1),
        n("GatherElements", ["allowed_p", "idx"], ["valid"], axis=-1),
        _c("minus1", [-1], dims=[]),
        n("Where", ["valid", "idx", "minus1"], ["indices"]),
        n("Where", ["valid", "vals", "masked"], ["scores"]),
    ]
    if k_format == "float":
        return helper.make_function(DOMAIN, NAME, ["q", "w", "index_pool", "block_table", "start", "lengths"],
                                    ["indices", "scores"], nodes, [helper.make_opsetid("", ONNX_OPSET)],
                                    attributes=["topk"])
    return helper.make_function(DOMAIN, NAME, ["q", "w", "index_pool", "block_table", "start", "lengths",
                                               "index_scale_pool"], ["indices", "scores"], nodes,
                                [helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, 1)],
                                attributes=["topk", "k_format", "block", "elem"], overload=overload_name(k_format, elem))


def infer(types, attrs):
    q = types[0]
    k = attrs.get("topk")
    shape = (q.shape[0], q.shape[1], k) if q and q.shape else None
    return [TensorType(shape, TensorProto.INT64), TensorType(shape, TensorProto.FLOAT)]


OP = register(OpDef(NAME, ("q", "w", "index_pool", "block_table", "start", "lengths", "index_scale_pool"),
                    ("indices", "scores"), {"topk": 2048, "k_format": "float", "block": 32, "elem": "e4m3"},
                    function=function, infer=infer, reference=reference.indexer_topk, doc=__doc__,
                    float32_ports=frozenset({"scores"})))
