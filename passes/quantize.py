"""quantize: layered quantization from the recipe's precision rules, roles found structurally (never by node name).

Roles, from the graph signature (trace_spec: cache inputs `index_k.i`, `kv.i`) and the kimi.Paged* ops:
    index_k_cache     the pool of a PagedWrite into an `index_k.*` graph input
    latent_kv_cache   the pool of a PagedWrite into a `kv.*` graph input
    indexer_k         the `values` of that index-K PagedWrite (k_I)
    indexer_q         the other operand of the Einsum/MatMul that consumes PagedGather(index-K pool) (q_I)
    projection_weight 2-D float initializers feeding MatMul/Gemm as the weight operand, and the absorbed MLA
                      projections of decode (W_UK / W_UV: 3-D initializers of Einsum bthd,hdr->bthr / bthr,hvr->bthv;
                      slices of the kv_b weight that prefill reads through a MatMul, so both phases round alike)
    projection_activation the activation operand of those MatMul/Gemm

A quantized cache becomes one pool per stored part (graph inputs and `<pool>.out` outputs):

    before:  kv.3 f32[NB,BS,24] -> PagedWrite(kv.3, slots, v) -> kv.3.out -> PagedGather(kv.3.out, bt) -> y -> ...
    after (latent_kv_cache fp8_tile tile 16, scale_fmt fp32, latent_rope keep; v = Concat(latent[16], rope[8])):
        v16 = Slice(v, 0:16)                v8 = Slice(v, 16:24)
        q, s = kimi.QuantizeFP8Tile(v16)    kv.3 u8[NB,BS,16] <- PagedWrite(kv.3, slots, fp8_bits(q))
                                            kv.3.scale f32[NB,BS,1] <- PagedWrite(kv.3.scale, slots, s)
                                            kv.3.rope f32[NB,BS,8] <- PagedWrite(kv.3.rope, slots, v8)
        y = Concat(kimi.DequantizeFP8Tile(bits_fp8(PagedGather(kv.3.out, bt)), PagedGather(kv.3.scale.out, bt)),
                   PagedGather(kv.3.rope.out, bt), axis=-1)
    index_k_cache mxfp8 block 32: index_k.3 u8[NB,BS,32] codes + index_k.3.scale u8[NB,BS,1] E8M0,
        y = kimi.DequantizeMX(bits_fp8(PagedGather(index_k.3.out, bt)), PagedGather(index_k.3.scale.out, bt))

Codes pools are uint8 (the E4M3/E5M2 bit patterns): ONNX ScatterND/Gather (the PagedWrite/PagedGather bodies) take
no float8 types at opset 23 and ONNX Runtime's Python API cannot feed float8 or bfloat16 arrays, while the kimi
Dequantize* ops take float8-typed codes. The pass therefore emits two exact bit conversions tagged
`kimi.rule=quantize.fp8_bits`: write side `fp8_bits(q)` = Cast(q, FLOAT) + an 7-step binary search over the code
table + sign -> Cast(UINT8); read side `bits_fp8(c)` = Cast(c, INT32) -> Gather(code table) -> Cast(float8).
A backend that stores float8 natively drops both (they are a bitcast).

Scales: mxfp8 stores one E8M0 byte per block (uint8). fp8_tile with scale_fmt fp32 stores one float32 per tile;
with scale_fmt ue8m0 the scale is a power of two and is stored as one E8M0 byte: it is quantized with
kimi.QuantizeMX(rounding=ceil, block=tile) (the RCEIL rule 2^ceil(log2(amax/448)) of FP8 tile ue8m0, without
DeepSeek's amax >= 1e-4 clamp, which only makes tiles with amax < 1e-4 coarser) and read with kimi.DequantizeMX.
Kept (unquantized) parts, such as the latent's RoPE dims with latent_rope=keep, are stored in `keep_dtype`
(float32 by default: ORT CPU cannot be fed bfloat16; the GPU layout keeps them in bf16).

projection_weight bf16/fp16: the initializer is stored as BFLOAT16/FLOAT16 and a Cast back to float32 feeds the
MatMul/Gemm (bytes saved counted). projection_activation bf16/fp16: Cast to the format and back on the activation.
indexer_q / indexer_k mxfp8: kimi.QDQMX on q_I and on k_I before the write.
Counts: `role.<role>` per tensor matched, `refused.<reason>` per refusal, `bytes_saved` (weights + cache bytes per
token x block_size x 1 block, see cache_bytes_per_token), `nodes_added`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import ml_dtypes
import numpy as np
import onnx_ir as ir

from kimi_compile.functions import attach_functions
from kimi_compile.ops import DOMAIN
from kimi_compile.passbase import KimiPass, PassStats
from kimi_compile.plugins.quant.reference import code_table, elem_format, search_table
from kimi_compile.rewrite import static_last

RULE = "quantize"
_CACHE_ROLE = {"index_k": "index_k_cache", "kv": "latent_kv_cache"}
_SIM_DTYPE = {"bf16": ir.DataType.BFLOAT16, "fp16": ir.DataType.FLOAT16}


def _f8_type(elem: str) -> ir.DataType:
    """The ONNX float8 type of an element format ("e4m3" | "e5m2")."""
    return ir.DataType(elem_format(elem).onnx_type)


@dataclasses.dataclass(frozen=True)
class Part:
    """One stored slice [lo, hi) of a cache row: quantized (`kind` mx | tile) or kept."""

    lo: int
    hi: int
    kind: str  # mx | tile | keep
    block: int = 0
    elem: str = "e4m3"
    rounding: str = "floor"
    pool: str = ""

    @property
    def dim(self) -> int:
        return self.hi - self.lo


class _Emit:
    """Creates named nodes/constants for one rewrite; nodes are appended to the graph and sorted at the end."""

    def __init__(self, graph: ir.Graph, prefix: str, rule: str):
        self.graph, self.prefix, self.rule, self.n, self.nodes = graph, prefix, rule, 0, []

    def name(self, what: str) -> str:
        self.n += 1
        return f"{self.prefix}.{what}_{self.n}"

    def op(self, op_type: str, inputs, attrs=None, *, domain: str = "", outs: int = 1, what: str = ""):
        names = [self.name(what or op_type.lower()) for _ in range(outs)]
        node = ir.node(op_type, inputs, attrs or {}, domain=domain, outputs=[ir.Value(name=n) for n in names],
                       name=self.name("n_" + op_type), metadata_props={"kimi.rule": self.rule})
        self.graph.append(node)
        self.nodes.append(node)
        return node.outputs if outs > 1 else node.outputs[0]

    def const(self, array: np.ndarray, what: str) -> ir.Value:
        name = self.name(what)
        v = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        v.dtype, v.shape = v.const_value.dtype, ir.Shape(array.shape)
        self.graph.register_initializer(v)
        return v


def fp8_bits(e: _Emit, q: ir.Value, elem: str) -> ir.Value:
    """uint8 bit pattern of float8 codes q (exact): sign | max{c : |v| >= T[c]}, NaN -> 0x7F."""
    old = e.rule
    e.rule = "quantize.fp8_bits"
    v = e.op("Cast", [q], {"to": ir.DataType.FLOAT})
    nan = e.op("IsNaN", [v])
    zero_f = e.const(np.array(0.0, np.float32), "zero")
    a = e.op("Where", [nan, zero_f, e.op("Abs", [v])])
    neg = e.op("Or", [e.op("Less", [v, zero_f]),
                      e.op("And", [e.op("Equal", [v, zero_f]),
                                   e.op("Less", [e.op("Reciprocal", [v]), zero_f])])])
    table = e.const(search_table(elem), "f8_search")
    b = e.op("ConstantOfShape", [e.op("Shape", [a])], {"value": ir.tensor(np.array([0], np.int64))})
    for step in (64, 32, 16, 8, 4, 2, 1):
        c = e.op("Add", [b, e.const(np.array(step, np.int64), "step")])
        b = e.op("Where", [e.op("GreaterOrEqual", [a, e.op("Gather", [table, c], {"axis": 0})]), c, b])
    b = e.op("Where", [nan, e.const(np.array(127, np.int64), "nan_code"), b])
    b = e.op("Where", [neg, e.op("Add", [b, e.const(np.array(128, np.int64), "sign")]), b])
    out = e.op("Cast", [b], {"to": ir.DataType.UINT8}, what="bits")
    e.rule = old
    return out


def bits_fp8(e: _Emit, bits: ir.Value, elem: str) -> ir.Value:
    """float8 codes from their uint8 bit pattern (exact): a table lookup then Cast."""
    old = e.rule
    e.rule = "quantize.fp8_bits"
    idx = e.op("Cast", [bits], {"to": ir.DataType.INT32})
    val = e.op("Gather", [e.const(code_table(elem), "f8_codes"), idx], {"axis": 0})
    out = e.op("Cast", [val], {"to": _f8_type(elem)}, what="codes")
    e.rule = old
    return out


def _split_of(values: ir.Value) -> list[int]:
    """Widths of the Concat (last axis) that builds the written rows, seen through Reshape; [] if none."""
    p = values.producer()
    while p is not None and p.op_type in ("Reshape", "Identity") and p.domain == "":
        p = p.inputs[0].producer() if p.inputs[0] is not None else None
    if p is None or p.op_type != "Concat" or p.domain != "":
        return []
    axis = p.attributes.get_int("axis", 0)
    rank = len(p.inputs[0].shape) if p.inputs[0] is not None and p.inputs[0].shape is not None else None
    if axis != -1 and (rank is None or axis != rank - 1):
        return []
    widths = [static_last(x) for x in p.inputs]
    return [] if any(w is None for w in widths) else widths


_KEEP = {"float32": ir.DataType.FLOAT, "float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}
_ABSORBED_MLA = ("bthd,hdr->bthr", "bthr,hvr->bthv")  # decode's q_nope @ W_UK and o_latent @ W_UV^T


class QuantizePass(KimiPass):
    name = "quantize"
    version = 1
    changes_signature = True  # quantized caches become new graph inputs/outputs (codes, scale and kept pools)

    @dataclasses.dataclass(frozen=True)
    class Options:
        rules: tuple[dict, ...] = ()  # recipe precision rules [{role, format, options}]; the build fills them
        latent_rope: Literal["keep", "fp8"] = "keep"  # the latent's trailing Concat part (RoPE dims)
        keep_dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # storage of kept cache parts
        # uint8: pools hold the FP8 codes' bit patterns (ONNX Runtime can feed and scatter them; fp8_bits/bits_fp8
        # convert); float8: pools are float8-typed and written/read directly (backends that store float8: cuda)
        code_storage: Literal["uint8", "float8"] = "uint8"
        min_weight_elements: int = dataclasses.field(default=1024, metadata={"min": 0})

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        return _Quantizer(self.options, stats).run(model)


class _Quantizer:
    """One run of the quantize pass: the rules, and the counts and refusals it records."""

    def __init__(self, options: QuantizePass.Options, stats: PassStats):
        self.options, self.stats = options, stats

    # ---- rules ----------------------------------------------------------------------------------------------

    def _rule(self, role: str) -> dict | None:
        for r in self.options.rules:
            if r.get("role") == role or (r.get("role") == "indexer_qk" and role in ("indexer_q", "indexer_k")):
                return r
        return None

    def _count(self, key: str, n: int = 1) -> None:
        self.stats.add(key, n)

    def _refuse(self, reason: str, where: str) -> None:
        self.stats.refuse(reason, where=where)

    # ---- run ------------------------------------------------------------------------------------------------

    def run(self, model: ir.Model) -> bool:
        g = model.graph
        before = len(g)
        self.stats.counts.update({"bytes_saved": 0, "cache_bytes_per_token_saved": 0})
        for inp in list(g.inputs):
            kind = inp.name.split(".", 1)[0]
            if kind in _CACHE_ROLE and "." in inp.name:
                self._cache(g, inp, kind)
        self._projections(g)
        if len(g) != before:
            g.sort()
            attach_functions(model)
        self.stats.counts["nodes_added"] = len(g) - before
        return len(g) != before or self.stats.counts["bytes_saved"] != 0

    # ---- caches and the indexer --------------------------------------------------------------------------

    def _cache(self, g: ir.Graph, pool: ir.Value, kind: str) -> None:
        writes = [(n, i) for n, i in pool.uses()]
        if len(writes) != 1 or writes[0][1] != 0 or writes[0][0].op_type != "PagedWrite" or \
                writes[0][0].domain != DOMAIN:
            self._refuse("pool_not_paged_write", pool.name)
            return
        write = writes[0][0]
        out = write.outputs[0]
        gathers = [n for n, i in out.uses() if n.op_type == "PagedGather" and n.domain == DOMAIN and i == 0]
        if kind == "index_k":
            self._indexer(g, write, gathers)
        role = _CACHE_ROLE[kind]
        rule = self._rule(role)
        if rule is None or rule["format"] == "fp32":
            return
        D = static_last(pool)
        if D is None or pool.shape is None or len(pool.shape) != 3:
            self._refuse("pool_shape_unknown", pool.name)
            return
        parts = self._parts(rule, D, _split_of(write.inputs[2]) if kind == "kv" else [], pool.name)
        if parts is None:
            return
        self._rewrite_cache(g, pool, write, gathers, parts, role, rule)
        self._count(f"role.{role}")

    def _parts(self, rule: dict, D: int, split: list[int], where: str) -> list[Part] | None:
        fmt, opts = rule["format"], rule.get("options", {})
        if fmt in ("bf16",):
            self._refuse("unsupported_format", f"{where}: bf16 pools cannot be fed by ORT's Python API")
            return None
        if fmt == "fp16":
            return [Part(0, D, "keep", pool=where)]
        if fmt == "mxfp8":
            kind, block, elem, rounding = "mx", int(opts.get("block", 32)), opts.get("elem", "e4m3"), \
                opts.get("rounding", "floor")
        elif fmt == "fp8_tile":
            ue8m0 = opts.get("scale_fmt", "fp32") == "ue8m0"
            kind, block, elem, rounding = ("mx" if ue8m0 else "tile"), int(opts.get("tile", 128)), "e4m3", "ceil"
        else:
            self._refuse("unsupported_format", f"{where}: {fmt}")
            return None
        bounds = [(0, D)]
        if len(split) >= 2 and sum(split) == D:
            lo = D - split[-1]
            bounds = [(0, lo), (lo, D)]
        parts = []
        for i, (lo, hi) in enumerate(bounds):
            name = where if i == 0 else f"{where}.rope"
            if i == 1 and self.options.latent_rope == "keep":
                parts.append(Part(lo, hi, "keep", pool=name))
                continue
            b = block if i == 0 else min(block, hi - lo)
            if (hi - lo) % b:
                self._refuse("dim_not_divisible", f"{where}: dims {lo}:{hi} by block/tile {b}")
                return None
            parts.append(Part(lo, hi, kind, b, elem, rounding, pool=name))
        return parts

    def _new_pool(self, g: ir.Graph, like: ir.Value, name: str, dtype: ir.DataType, dim: int,
                  after: ir.Value) -> ir.Value:
        v = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([*like.shape[:2], dim]))
        g.inputs.insert(list(g.inputs).index(after) + 1, v)
        return v

    def _rewrite_cache(self, g: ir.Graph, pool: ir.Value, write: ir.Node, gathers: list[ir.Node], parts: list[Part],
                       role: str, rule: dict) -> None:
        e = _Emit(g, f"{RULE}.{pool.name}", f"{RULE}.{role}")
        slots, values = write.inputs[1], write.inputs[2]
        D = static_last(pool)
        bytes_before = int(D * pool.dtype.itemsize)
        out_name = write.outputs[0].name
        reads: dict[str, list[ir.Value]] = {id(gn): [] for gn in gathers}
        last_in, last_out = pool, write.outputs[0]
        fmt_name = rule["format"]
        bytes_after = 0
        for i, part in enumerate(parts):
            x = values
            if len(parts) > 1:
                x = e.op("Slice", [values, e.const(np.array([part.lo], np.int64), "lo"),
                                   e.const(np.array([part.hi], np.int64), "hi"),
                                   e.const(np.array([-1], np.int64), "axis")])
            stored: list[tuple[str, ir.Value, ir.DataType, int, str]] = []  # (pool name, value, dtype, dim, format)
            if part.kind == "keep":
                dt = ir.DataType.FLOAT16 if fmt_name == "fp16" else _KEEP[self.options.keep_dtype]
                xs = e.op("Cast", [x], {"to": dt}) if dt != ir.DataType.FLOAT else x
                stored.append((part.pool, xs, dt, part.dim, f"{dt.name.lower()}"))
            else:
                elem_t = _f8_type(part.elem)
                if part.kind == "mx":
                    q, s = e.op("QuantizeMX", [x], {"block": part.block, "elem_type": int(elem_t),
                                                    "rounding": part.rounding}, domain=DOMAIN, outs=2)
                    sdt, sfmt = ir.DataType.UINT8, f"e8m0/{part.block}"
                else:
                    q, s = e.op("QuantizeFP8Tile", [x], {"tile": part.block, "scale_fmt": "fp32"}, domain=DOMAIN,
                                outs=2)
                    sdt, sfmt = ir.DataType.FLOAT, f"fp32/{part.block}"
                if self.options.code_storage == "float8":
                    stored.append((part.pool, q, elem_t, part.dim, f"{part.elem}.codes"))
                else:
                    stored.append((part.pool, fp8_bits(e, q, part.elem), ir.DataType.UINT8, part.dim,
                                   f"{part.elem}.codes"))
                stored.append((part.pool + ".scale", s, sdt, part.dim // part.block, sfmt))
            gathered = []
            for j, (pname, val, dt, dim, f) in enumerate(stored):
                if i == 0 and j == 0:  # the original pool, write and gathers are reused
                    pv = pool
                    pv.type, pv.shape = ir.TensorType(dt), ir.Shape([*pool.shape[:2], dim])
                    write.replace_input_with(2, val)
                    wo = write.outputs[0]
                    wo.type, wo.shape = ir.TensorType(dt), ir.Shape([*pool.shape[:2], dim])
                    outs = [gn.outputs[0] for gn in gathers]
                    for gn in gathers:
                        o = gn.outputs[0]
                        o.type = ir.TensorType(dt)
                        if o.shape is not None:
                            o.shape = ir.Shape([*o.shape[:2], dim])
                else:
                    pv = self._new_pool(g, pool, pname, dt, dim, last_in)
                    wo = e.op("PagedWrite", [pv, slots, val], domain=DOMAIN, what="pool_out")
                    wo.name = pname + ".out"
                    wo.type, wo.shape = ir.TensorType(dt), ir.Shape([*pool.shape[:2], dim])
                    g.outputs.insert(list(g.outputs).index(last_out) + 1, wo)
                    outs = [e.op("PagedGather", [wo, gn.inputs[1]], domain=DOMAIN, what="gather")
                            for gn in gathers]
                pv.metadata_props.update({"kimi.role": role, "kimi.format": f, "kimi.cache": pool.name,
                                          "kimi.dims": f"{part.lo}:{part.hi}"})
                bytes_after += int(dim * dt.itemsize)
                last_in, last_out = pv, wo
                gathered.append(outs)
            for k, gn in enumerate(gathers):
                if part.kind == "keep":
                    y = gathered[0][k]
                    if stored[0][2] != ir.DataType.FLOAT:
                        y = e.op("Cast", [y], {"to": ir.DataType.FLOAT})
                else:
                    codes = gathered[0][k] if self.options.code_storage == "float8" else \
                        bits_fp8(e, gathered[0][k], part.elem)
                    deq = "DequantizeMX" if part.kind == "mx" else "DequantizeFP8Tile"
                    key = "block" if part.kind == "mx" else "tile"
                    y = e.op(deq, [codes, gathered[1][k]], {key: part.block}, domain=DOMAIN, what="deq")
                reads[id(gn)].append(y)
        for gn in gathers:
            ys = reads[id(gn)]
            old_uses = [(n, idx) for n, idx in gn.outputs[0].uses() if n not in e.nodes]
            y = ys[0] if len(ys) == 1 else e.op("Concat", ys, {"axis": -1}, what="kv")
            for n, idx in old_uses:
                n.replace_input_with(idx, y)
        assert out_name == write.outputs[0].name
        self._count("cache_bytes_per_token_saved", bytes_before - bytes_after)

    def _indexer(self, g: ir.Graph, write: ir.Node, gathers: list[ir.Node]) -> None:
        rk, rq = self._rule("indexer_k"), self._rule("indexer_q")
        if rk is not None and rk["format"] != "fp32":
            k = write.inputs[2]
            y = self._qdq(g, k, rk, "indexer_k", f"{write.inputs[0].name}.k")
            if y is not None:
                write.replace_input_with(2, y)
                self._count("role.indexer_k")
        if rq is not None and rq["format"] != "fp32":
            for gn in gathers:
                scores = [(n, i) for n, i in gn.outputs[0].uses() if n.op_type in ("Einsum", "MatMul")
                          and n.domain == "" and len(n.inputs) == 2]
                if not scores:
                    self._refuse("no_score_contraction", gn.name or write.inputs[0].name)
                    continue
                for n, i in scores:
                    q = n.inputs[1 - i]
                    y = self._qdq(g, q, rq, "indexer_q", f"{write.inputs[0].name}.q")
                    if y is not None:
                        n.replace_input_with(1 - i, y)
                        self._count("role.indexer_q")

    def _qdq(self, g: ir.Graph, x: ir.Value, rule: dict, role: str, prefix: str) -> ir.Value | None:
        opts = rule.get("options", {})
        D = static_last(x)
        e = _Emit(g, f"{RULE}.{prefix}", f"{RULE}.{role}")
        if rule["format"] == "mxfp8":
            block = int(opts.get("block", 32))
            if D is None or D % block:
                self._refuse("dim_not_divisible", f"{prefix}: last dim {D} by block {block}")
                return None
            return e.op("QDQMX", [x], {"block": block, "elem_type": int(_f8_type(opts.get("elem", "e4m3"))),
                                       "rounding": opts.get("rounding", "floor")}, domain=DOMAIN, what="qdq")
        if rule["format"] == "fp8_tile":
            tile = int(opts.get("tile", 128))
            if D is None or D % tile:
                self._refuse("dim_not_divisible", f"{prefix}: last dim {D} by tile {tile}")
                return None
            return e.op("QDQFP8Tile", [x], {"tile": tile, "scale_fmt": opts.get("scale_fmt", "fp32")},
                        domain=DOMAIN, what="qdq")
        if rule["format"] in _SIM_DTYPE:
            c = e.op("Cast", [x], {"to": _SIM_DTYPE[rule["format"]]})
            return e.op("Cast", [c], {"to": ir.DataType.FLOAT}, what="qdq")
        self._refuse("unsupported_format", f"{prefix}: {rule['format']}")
        return None

    # ---- projections ---------------------------------------------------------------------------------------

    def _projections(self, g: ir.Graph) -> None:
        rw, ra = self._rule("projection_weight"), self._rule("projection_activation")
        if rw is None and ra is None:
            return
        done_w: dict[str, ir.Value] = {}
        self._dead: list[ir.Value] = []
        for node in list(g):
            absorbed = node.op_type == "Einsum" and node.domain == "" and len(node.inputs) == 2 and \
                getattr(node.attributes.get("equation"), "value", None) in _ABSORBED_MLA
            if not absorbed and (node.domain != "" or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2):
                continue
            w = node.inputs[1]
            if w is None or not w.is_initializer() or w.const_value is None or w.shape is None \
                    or len(w.shape) != (3 if absorbed else 2) or w.dtype != ir.DataType.FLOAT \
                    or w.const_value.size * (2 if absorbed else 1) < self.options.min_weight_elements:
                continue  # (W_UK and W_UV together are the kv_b weight that prefill's MatMul reads; dn == dv in K3)
            if absorbed:  # weights only: the activations of these einsums are attention's, not a projection's
                if rw is not None and rw["format"] in _SIM_DTYPE:
                    if w.name not in done_w:
                        done_w[w.name] = self._store_weight(g, w, _SIM_DTYPE[rw["format"]])
                    node.replace_input_with(1, done_w[w.name])
                continue
            if rw is not None and rw["format"] != "fp32":
                if rw["format"] not in _SIM_DTYPE:
                    self._refuse("unsupported_format", f"projection_weight {w.name}: {rw['format']}")
                    rw = None
                else:
                    if w.name not in done_w:
                        done_w[w.name] = self._store_weight(g, w, _SIM_DTYPE[rw["format"]])
                    node.replace_input_with(1, done_w[w.name])
            if ra is not None and ra["format"] != "fp32" and node.inputs[0] is not None:
                y = self._qdq(g, node.inputs[0], ra, "projection_activation", f"act.{w.name}")
                if y is not None:
                    node.replace_input_with(0, y)
                    self._count("role.projection_activation")
        for w in self._dead:
            if not w.uses() and not w.is_graph_output():
                g.initializers.pop(w.name)

    def _store_weight(self, g: ir.Graph, w: ir.Value, dt: ir.DataType) -> ir.Value:
        """Store W in `dt` (round to nearest even) and feed Cast(W, FLOAT) to its users."""
        arr = w.const_value.numpy()
        np_dt = ml_dtypes.bfloat16 if dt == ir.DataType.BFLOAT16 else np.float16
        name = f"{w.name}.{dt.name.lower()}"
        low = ir.Value(name=name, const_value=ir.tensor(arr.astype(np_dt), name=name))
        low.dtype, low.shape = dt, ir.Shape(arr.shape)
        low.metadata_props.update({"kimi.role": "projection_weight", "kimi.format": dt.name.lower()})
        g.register_initializer(low)
        e = _Emit(g, f"{RULE}.{w.name}", f"{RULE}.projection_weight")
        y = e.op("Cast", [low], {"to": ir.DataType.FLOAT}, what="w")
        y.dtype, y.shape = ir.DataType.FLOAT, ir.Shape(arr.shape)
        self._count("role.projection_weight")
        self._count("bytes_saved", int(arr.size * (4 - dt.itemsize)))
        self._dead.append(w)
        return y


PASS = QuantizePass
