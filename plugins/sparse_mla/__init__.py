"""kimi.SparseMLA: MLA attention over the positions the indexer selected, read from the paged latent KV pool
(absorbed form: the query is folded into the latent, one 576-wide KV head shared by all query heads).

Inputs   q_nope [B,T,H,dn], q_pe [B,T,H,dr], kv_pool [NB,BS,R+dr] (normed c_kv then k_pe per token),
         block_table [B,MB] int64, indices [B,T,k] int64 (positions, -1 = none; from kimi.IndexerTopK),
         w_uk [H,dn,R], w_uv [H,dv,R] (kv_b_proj split per head)
Output   o [B,T,H,dv]
Attrs    scale (softmax scale, (dn+dr)^-0.5), kv_lora_rank (R)
Math     q_lat = q_nope . w_uk;  s_j = (q_lat . c_j + q_pe . pe_j) * scale over the selected j;
         p = softmax(s);  o = (sum_j p_j c_j) . w_uv^T.  Equals dense MLA restricted to the selected set.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, TensorProto, helper

from kimi_compile.ops import DOMAIN, ONNX_OPSET, OpDef, TensorType, register
from kimi_compile.plugins.indexer_topk import MASKED, _c, paged_keys_nodes

NAME = "SparseMLA"


def _ref_const(name: str, attr: str, kind: str):
    node = helper.make_node("Constant", [], [name])
    a = helper.make_attribute(kind, 0 if kind == "value_int" else 0.0)
    a.ref_attr_name = attr
    a.type = AttributeProto.INT if kind == "value_int" else AttributeProto.FLOAT
    node.attribute.append(a)
    return node


def function():
    n = helper.make_node
    nodes = [
        *paged_keys_nodes("kv_pool", "block_table", "keys"),  # [B,S,C]
        _c("zero", [0], dims=[]), _c("ax1", [1]), _c("axm1", [-1]), _c("big", [1 << 62]),
        n("GreaterOrEqual", ["indices", "zero"], ["valid"]),
        n("Where", ["valid", "indices", "zero"], ["safe"]),
        n("Shape", ["safe"], ["bt"], start=0, end=2),
        n("Shape", ["safe"], ["b"], start=0, end=1),
        n("Concat", ["b", "axm1", "ax1"], ["flat_shape"], axis=0),
        n("Reshape", ["safe", "flat_shape"], ["flat_idx"]),  # [B, T*k, 1]
        n("GatherND", ["keys", "flat_idx"], ["rows"], batch_dims=1),  # [B, T*k, C]
        n("Shape", ["safe"], ["k"], start=2, end=3),
        n("Concat", ["bt", "k", "axm1"], ["sel_shape"], axis=0),
        n("Reshape", ["rows", "sel_shape"], ["sel"]),  # [B,T,k,C]
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
    return helper.make_function(DOMAIN, NAME, ["q_nope", "q_pe", "kv_pool", "block_table", "indices", "w_uk", "w_uv"],
                                ["o"], nodes, [helper.make_opsetid("", ONNX_OPSET)],
                                attributes=["scale", "kv_lora_rank"])


def reference(q_nope, q_pe, kv_pool, block_table, indices, w_uk, w_uv, scale: float, kv_lora_rank: int):
    """numpy reference in fp64, one (b, t, head) at a time."""
    B, T, H, _ = q_nope.shape
    BS, C = kv_pool.shape[1], kv_pool.shape[2]
    R = kv_lora_rank
    keys = kv_pool[block_table.reshape(-1)].reshape(B, -1, C).astype(np.float64)
    o = np.zeros((B, T, H, w_uv.shape[1]))
    for b in range(B):
        for t in range(T):
            sel = [int(j) for j in indices[b, t] if j >= 0]
            if not sel:
                continue
            rows = keys[b, sel]
            for h in range(H):
                q_lat = q_nope[b, t, h].astype(np.float64) @ w_uk[h]
                s = (rows[:, :R] @ q_lat + rows[:, R:] @ q_pe[b, t, h]) * scale
                p = np.exp(s - s.max())
                p /= p.sum()
                o[b, t, h] = w_uv[h] @ (p @ rows[:, :R])
    return o.astype(np.float32)


def infer(types, attrs):
    q, w_uv = types[0], types[6]
    shape = None
    if q and q.shape and w_uv and w_uv.shape:
        shape = (*q.shape[:3], w_uv.shape[1])
    return [TensorType(shape, TensorProto.FLOAT)]


OP = register(OpDef(NAME, ("q_nope", "q_pe", "kv_pool", "block_table", "indices", "w_uk", "w_uv"), ("o",),
                    {"scale": 1.0, "kv_lora_rank": 512}, function=function, infer=infer, reference=reference,
                    doc=__doc__))
