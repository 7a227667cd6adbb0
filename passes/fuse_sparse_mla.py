"""fuse_sparse_mla: MLA attention restricted to the indexer's selection -> kimi.SparseMLA over the paged latent KV.

    before, decode (absorbed, gathered):
        q_lat = Einsum["bthd,hdr->bthr"](q_nope, w_uk)
        sel   = GatherElements(Expand(keys), Expand(Clip(idx)))         keys = kimi.PagedGather(kv_pool, block_table)
        s     = (Einsum(q_lat, sel[..., :R]) + Einsum(q_pe, sel[..., R:])) * scale
        p     = Softmax(Where(Not(valid), -1e30, s));  o = Einsum(Einsum(p, sel[..., :R]), w_uv)
    before, prefill (expanded, masked):
        kv = Reshape(MatMul(keys[..., :R], W_kvb^T));  k_nope, v = kv[..., :dn], kv[..., dn:]
        s  = (Einsum(q_nope, k_nope) + Einsum(q_pe, keys[..., R:])) * scale
        p  = Softmax(Where(Not(selected & allowed), -1e30, s));  o = Einsum(p, v)
        (selected = ScatterElements of the indexer's idx/valid)
    after (both):
        o = kimi.SparseMLA[scale, kv_lora_rank](q_nope, q_pe, kv_pool, block_table, indices, w_uk, w_uv)
    where `indices` is the output of kimi.IndexerTopK (run fuse_indexer first).
    quantized latent cache (from `quantize`): keys = Concat(deq(kv_pool, kv_pool.scale), rope, axis=-1) with
    deq = kimi.DequantizeMX|DequantizeFP8Tile(bits_fp8(PagedGather(codes, bt)), PagedGather(scales, bt)) and rope
    = PagedGather(kv_pool.rope, bt) [Cast] or deq(kv_pool.rope, kv_pool.rope.scale) ->
        o = kimi.SparseMLA[..., kv_format, tile, rope_format, rope_tile, elem](..., w_uv, kv_pool.scale, kv_pool.rope,
            kv_pool.rope.scale | "")    (overload: it gathers the selected rows of each pool and dequantizes them)

Refusals: no_mask, mask_fill, no_scale, no_score_sum, score_equation, not_indexed, keys_not_paged,
weights_not_constant, no_output_projection.
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.plugins.sparse_mla import function as sparse_mla_function
from kimi_compile.plugins.sparse_mla import overload_name
from kimi_compile.rewrite import (Builder, FusionPass, Refuse, attach_overload, attr, const, consumers, producer,
                                  quantized_read, static_last, weight_like)


def _eq(n: ir.Node) -> str:
    return (attr(n, "equation") or "").replace(" ", "")


def _through(v: ir.Value, *ops: str) -> ir.Value:
    while v.producer() is not None and v.producer().op_type in ops:
        v = v.producer().inputs[0]
    return v


def _indices_from_idx(idx: ir.Value) -> ir.Value:
    """idx = Where(valid, indices, S) with indices from kimi.IndexerTopK -> indices."""
    w = producer(idx, "Where", "not_indexed")
    src = w.inputs[1].producer()
    if src is None or src.domain != DOMAIN or src.op_type != "IndexerTopK":
        raise Refuse("not_indexed", "selection does not come from kimi.IndexerTopK")
    return w.inputs[1]


def _slice_bounds(n: ir.Node) -> tuple[int, int]:
    s, e = const(n.inputs[1]), const(n.inputs[2])
    if s is None or e is None:
        raise Refuse("score_equation", "non-constant slice of the latent")
    return int(np.ravel(s)[0]), int(np.ravel(e)[0])


_FMT = {"mx": "mxfp8", "tile": "fp8_tile"}


def _quantized_keys(keys: ir.Value, R: int) -> dict | None:
    """keys = Concat[-1](quantized latent read, rope read) (see the module docstring) -> the pools and formats;
    None when the keys are not a concat of a quantized read; Refuse(keys_not_paged) on a partial match."""
    cat = keys.producer()
    if cat is None or cat.op_type != "Concat" or cat.domain != "" or len(cat.inputs) != 2:
        return None
    lat = quantized_read(cat.inputs[0])
    if lat is None:
        return None
    if attr(cat, "axis") not in (-1, 3) and not (attr(cat, "axis") == 2 and len(keys.shape or ()) == 3):
        raise Refuse("keys_not_paged", "latent and RoPE parts are not concatenated on the last axis")
    if static_last(lat["pool"]) != R:
        raise Refuse("keys_not_paged", f"quantized latent has {static_last(lat['pool'])} dims, expected {R}")
    m = dict(pool=lat["pool"], bt=lat["bt"], scale_pool=lat["scale_pool"], kv_format=_FMT[lat["kind"]],
             tile=lat["block"], elem=lat["elem"], rope_scale_pool=None, rope_tile=lat["block"])
    rope = quantized_read(cat.inputs[1])
    if rope is not None:
        if rope["elem"] != lat["elem"]:
            raise Refuse("keys_not_paged", "latent and RoPE parts use different FP8 elements")
        m.update(rope_pool=rope["pool"], rope_scale_pool=rope["scale_pool"], rope_format=_FMT[rope["kind"]],
                 rope_tile=rope["block"], rope_bt=rope["bt"])
    else:
        v = cat.inputs[1]
        c = v.producer()
        if c is not None and c.op_type == "Cast" and c.domain == "" and attr(c, "to") == ir.DataType.FLOAT:
            v = c.inputs[0]
        g = producer(v, "PagedGather", "keys_not_paged", domain=DOMAIN)
        m.update(rope_pool=g.inputs[0], rope_format="float", rope_bt=g.inputs[1])
    if m.pop("rope_bt") is not m["bt"]:
        raise Refuse("keys_not_paged", "latent and RoPE parts are read through different block tables")
    return m


class FuseSparseMLAPass(FusionPass):
    name = "fuse_sparse_mla"
    version = 1
    rule = "fuse_sparse_mla"

    def anchors(self, model):
        return [n for n in model.graph if n.op_type == "Softmax" and n.domain == "" and attr(n, "axis", -1) in (-1, 3)]

    def match(self, model, sm):
        where = producer(sm.inputs[0], "Where", "no_mask")
        fill = const(where.inputs[1])
        if fill is None or not np.all(fill <= -1e29):
            raise Refuse("mask_fill")
        mask = producer(producer(where.inputs[0], "Not", "no_mask").inputs[0], "Unsqueeze", "no_mask").inputs[0]
        mul = producer(where.inputs[2], "Mul", "no_scale")
        scale = const(mul.inputs[1])
        add_v = mul.inputs[0]
        if scale is None:
            scale, add_v = const(mul.inputs[0]), mul.inputs[1]
        if scale is None or np.size(scale) != 1:
            raise Refuse("no_scale")
        add = producer(add_v, "Add", "no_score_sum")
        e1 = producer(add.inputs[0], "Einsum", "no_score_sum")
        e2 = producer(add.inputs[1], "Einsum", "no_score_sum")
        outs = consumers(sm.outputs[0])
        if len(outs) != 1 or outs[0].op_type != "Einsum":
            raise Refuse("no_output_projection")
        pv = outs[0]
        m = dict(scale=float(np.ravel(scale)[0]), q_pe=e2.inputs[0])
        if _eq(e1) == "bthr,btkr->bhtk" and _eq(e2) == "bthd,btkd->bhtk":  # decode, absorbed + gathered
            qlat = producer(e1.inputs[0], "Einsum", "score_equation")
            if _eq(qlat) != "bthd,hdr->bthr":
                raise Refuse("score_equation", _eq(qlat))
            m["q_nope"], w_uk = qlat.inputs
            c_slice = producer(e1.inputs[1], "Slice", "score_equation")
            m["R"] = _slice_bounds(c_slice)[1]
            gat = producer(c_slice.inputs[0], "GatherElements", "not_indexed")
            keys = _through(gat.inputs[0], "Expand", "Unsqueeze")
            idx = _through(gat.inputs[1], "Expand", "Unsqueeze", "Clip")
            m["indices"] = _indices_from_idx(idx)
            ge = producer(mask, "GreaterOrEqual", "not_indexed")
            if ge.inputs[0] is not m["indices"]:
                raise Refuse("not_indexed", "mask is not the selection's validity")
            if _eq(pv) != "bhtk,btkr->bthr":
                raise Refuse("no_output_projection", _eq(pv))
            proj = consumers(pv.outputs[0])
            if len(proj) != 1 or proj[0].op_type != "Einsum" or _eq(proj[0]) != "bthr,hvr->bthv":
                raise Refuse("no_output_projection")
            w_uv = proj[0].inputs[1]
            wk, wv = const(w_uk), const(w_uv)
            if wk is None or wv is None:
                raise Refuse("weights_not_constant")
            m.update(w_uk=wk, w_uv=wv, uk_like=w_uk, uv_like=w_uv, out=proj[0].outputs[0])
        elif _eq(e1) == "bthd,bshd->bhts" and _eq(e2) == "bthd,bsd->bhts":  # prefill, expanded + masked
            m["q_nope"] = e1.inputs[0]
            kn_slice = producer(e1.inputs[1], "Slice", "score_equation")
            dn = _slice_bounds(kn_slice)[1]
            view = producer(kn_slice.inputs[0], "Reshape", "score_equation")
            mm = producer(view.inputs[0], "MatMul", "score_equation")
            c_slice = producer(mm.inputs[0], "Slice", "score_equation")
            m["R"] = _slice_bounds(c_slice)[1]
            keys = c_slice.inputs[0]
            w_v = mm.inputs[1]
            w = const(w_v)  # [R, H*(dn+dv)]
            if w is None:
                raise Refuse("weights_not_constant")
            H = int(e1.inputs[0].shape[2]) if e1.inputs[0].shape is not None and isinstance(
                e1.inputs[0].shape[2], int) else None
            if H is None:
                raise Refuse("score_equation", "unknown head count")
            wt = w.T.reshape(H, -1, m["R"])
            m.update(w_uk=wt[:, :dn], w_uv=wt[:, dn:], uk_like=w_v, uv_like=w_v)
            andn = producer(mask, "And", "not_indexed")
            sl = producer(andn.inputs[0], "Slice", "not_indexed")
            sc = producer(sl.inputs[0], "ScatterElements", "not_indexed")
            m["indices"] = _indices_from_idx(sc.inputs[1])
            if _eq(pv) != "bhts,bshd->bthd":
                raise Refuse("no_output_projection", _eq(pv))
            m["out"] = pv.outputs[0]
        else:
            raise Refuse("score_equation", f"{_eq(e1)} + {_eq(e2)}")
        m["quant"] = _quantized_keys(keys, m["R"])
        if m["quant"] is None:
            g = producer(keys, "PagedGather", "keys_not_paged", domain=DOMAIN)
            m["pool"], m["bt"] = g.inputs
        else:
            m["pool"], m["bt"] = m["quant"]["pool"], m["quant"]["bt"]
        return m

    def rewrite(self, model, sm, m):
        b = Builder(model.graph, sm, self.rule)
        # a bf16-stored source keeps W_UK / W_UV bf16 in both phases (same content, same initializer name)
        w_uk = weight_like(model, m["uk_like"], m["w_uk"], "w_uk")
        w_uv = weight_like(model, m["uv_like"], m["w_uv"], "w_uv")
        inputs = [m["q_nope"], m["q_pe"], m["pool"], m["bt"], m["indices"], w_uk, w_uv]
        attrs, overload, q = {"scale": m["scale"], "kv_lora_rank": m["R"]}, "", m["quant"]
        if q is not None:
            inputs += [q["scale_pool"], q["rope_pool"], q["rope_scale_pool"]]
            attrs.update({k: q[k] for k in ("kv_format", "rope_format", "elem", "tile", "rope_tile")})
            overload = overload_name(q["kv_format"], q["rope_format"], q["elem"])
            attach_overload(model, sparse_mla_function(q["kv_format"], q["rope_format"], q["elem"]))
        o = b.op("SparseMLA", inputs, attrs, domain=DOMAIN, overload=overload)
        ir.convenience.replace_all_uses_with(m["out"], o)


PASS = FuseSparseMLAPass
