"""fuse_indexer: the K3.1 indexer triad (score, ReLU + head weighting + sum, causal mask, top-k) -> kimi.IndexerTopK.

    before (per indexed MLA layer, prefill and decode alike):
        keys  = kimi.PagedGather(index_pool, block_table)
        dots  = Einsum["bthd,bsd->bths"](q, keys);  r = Relu(dots)
        raw   = ReduceSum[axes=2](Mul(r, Unsqueeze[-1](w)))
        score = Where(Not(allowed), -1e30, raw)          allowed = And(s <= start+t, s < start+lengths)
        _, idx = TopK[k](Concat(score, Expand(-1e30)))   valid = GatherElements(Concat(allowed, 0), idx)
        (quantized index-K cache, from `quantize`: keys = kimi.DequantizeMX(bits_fp8(kimi.PagedGather(index_pool,
         block_table)), kimi.PagedGather(index_pool.scale, block_table)), q = kimi.QDQMX(q_I))
    after:
        indices, scores = kimi.IndexerTopK[topk=k](q, w, index_pool, block_table, start, lengths)
        (quantized: kimi.IndexerTopK[topk, k_format=mxfp8, block, elem](..., index_pool.scale), overload
         mxfp8_<elem>: the op reads the code and scale pools and dequantizes the gathered rows itself)
        valid = indices >= 0;  idx = Where(valid, indices, S)      (for the consumers that remain)

Refusals (counted as `refused.<reason>`): non_constant_k, no_padded_score_row, no_mask, mask_fill, non_causal_mask,
no_head_sum, reduce_axis, no_head_weighting, weight_broadcast, no_relu, no_score_contraction, score_equation,
keys_not_paged.
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.plugins.indexer_topk import function as indexer_function
from kimi_compile.plugins.indexer_topk import overload_name
from kimi_compile.rewrite import (Builder, FusionPass, Refuse, attach_overload, attr, const, consumers, is_graph_input,
                                  producer, quantized_read)


def causal_inputs(graph: ir.Graph, allowed: ir.Value) -> tuple[ir.Value, ir.Value]:
    """allowed == And(LessOrEqual(spos, start + t), Less(spos, start + lengths)) -> (start, lengths)."""
    r = "non_causal_mask"
    a = producer(allowed, "And", r)
    le = producer(a.inputs[0], "LessOrEqual", r)
    lt = producer(a.inputs[1], "Less", r)
    if le.inputs[0] is not lt.inputs[0]:
        raise Refuse(r, "key positions of the two comparisons differ")
    end = lt.inputs[1]
    while end.producer() is not None and end.producer().op_type in ("Reshape", "Unsqueeze"):
        end = end.producer().inputs[0]
    add = producer(end, "Add", r)
    start, lengths = add.inputs
    if not (is_graph_input(start, graph, "start") and is_graph_input(lengths, graph, "lengths")):
        raise Refuse(r, "sequence end is not start + lengths")
    qpos = le.inputs[1]
    while qpos.producer() is not None and qpos.producer().op_type in ("Reshape", "Unsqueeze"):
        qpos = qpos.producer().inputs[0]
    qadd = producer(qpos, "Add", r)
    roots = []
    for v in qadd.inputs:
        while v.producer() is not None and v.producer().op_type in ("Reshape", "Unsqueeze"):
            v = v.producer().inputs[0]
        roots.append(v)
    if start not in roots:
        raise Refuse(r, "query positions do not start at `start`")
    return start, lengths


class FuseIndexerPass(FusionPass):
    name = "fuse_indexer"
    version = 1
    rule = "fuse_indexer"

    def anchors(self, model):
        return [n for n in model.graph if n.op_type == "TopK" and n.domain == ""]

    def match(self, model, topk):
        g = model.graph
        k = const(topk.inputs[1])
        if k is None:
            raise Refuse("non_constant_k")
        padded = producer(topk.inputs[0], "Concat", "no_padded_score_row")
        if len(padded.inputs) != 2 or attr(padded, "axis") not in (-1, 2):
            raise Refuse("no_padded_score_row")
        producer(padded.inputs[1], "Expand", "no_padded_score_row")
        where = producer(padded.inputs[0], "Where", "no_mask")
        fill = const(where.inputs[1])
        if fill is None or not np.all(fill <= -1e29):
            raise Refuse("mask_fill", "masked scores are not filled with -1e30")
        allowed = producer(where.inputs[0], "Not", "no_mask").inputs[0]
        start, lengths = causal_inputs(g, allowed)
        red = producer(where.inputs[2], "ReduceSum", "no_head_sum")
        axes = const(red.inputs[1]) if len(red.inputs) > 1 else None
        if axes is None or list(np.ravel(axes)) != [2] or attr(red, "keepdims", 1) != 0:
            raise Refuse("reduce_axis", f"ReduceSum over {axes} keepdims={attr(red, 'keepdims', 1)}")
        mul = producer(red.inputs[0], "Mul", "no_head_weighting")
        relu_v, w_v = mul.inputs
        if w_v.producer() is None or w_v.producer().op_type != "Unsqueeze":
            relu_v, w_v = w_v, relu_v
        unsq = producer(w_v, "Unsqueeze", "weight_broadcast")
        if list(np.ravel(const(unsq.inputs[1]))) not in ([-1], [3]):
            raise Refuse("weight_broadcast", "head weights are not broadcast over the key axis")
        relu = producer(relu_v, "Relu", "no_relu")
        ein = producer(relu.inputs[0], "Einsum", "no_score_contraction")
        if attr(ein, "equation").replace(" ", "") != "bthd,bsd->bths":
            raise Refuse("score_equation", attr(ein, "equation"))
        q, keys = ein.inputs
        quant = quantized_read(keys)
        if quant is not None:
            if quant["kind"] != "mx":
                raise Refuse("keys_not_paged", "index keys are quantized in a format other than mxfp8")
            pool, bt = quant["pool"], quant["bt"]
        else:
            gather = producer(keys, "PagedGather", "keys_not_paged", domain=DOMAIN)
            pool, bt = gather.inputs
        if int(np.ravel(k)[0]) <= 0:
            raise Refuse("non_constant_k", "k must be positive")
        return dict(k=int(np.ravel(k)[0]), q=q, w=unsq.inputs[0], pool=pool, bt=bt, start=start, lengths=lengths,
                    allowed=allowed, quant=quant)

    def rewrite(self, model, topk, m):
        b = Builder(model.graph, topk, self.rule)
        inputs, attrs, overload = [m["q"], m["w"], m["pool"], m["bt"], m["start"], m["lengths"]], {"topk": m["k"]}, ""
        q = m["quant"]
        if q is not None:
            inputs.append(q["scale_pool"])
            attrs.update(k_format="mxfp8", block=q["block"], elem=q["elem"])
            overload = overload_name("mxfp8", q["elem"])
            attach_overload(model, indexer_function("mxfp8", q["elem"]))
        indices, scores = b.op("IndexerTopK", inputs, attrs, domain=DOMAIN, num_outputs=2, overload=overload)
        valid = b.op("GreaterOrEqual", [indices, b.const(0, np.int64)])
        mb = b.op("Shape", [m["bt"]], {"start": 1, "end": 2})
        bs = b.op("Shape", [m["pool"]], {"start": 1, "end": 2})
        idx = b.op("Where", [valid, indices, b.op("Mul", [mb, bs])])
        vals, idx_old = topk.outputs
        for c in consumers(idx_old):  # valid = GatherElements(Concat(allowed, zeros), idx) becomes indices >= 0
            if c.op_type == "GatherElements" and c.inputs[1] is idx_old:
                src = c.inputs[0].producer()
                if src is not None and src.op_type == "Concat" and src.inputs[0] is m["allowed"]:
                    ir.convenience.replace_all_uses_with(c.outputs[0], valid)
        ir.convenience.replace_all_uses_with(idx_old, idx)
        ir.convenience.replace_all_uses_with(vals, scores)


PASS = FuseIndexerPass
