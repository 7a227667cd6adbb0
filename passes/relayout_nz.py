"""relayout_nz: large 2-D projection weights stored in the NZ fractal layout, consumed by kimi.MatMulNZ.

    before: y = MatMul(x, W[K,N])                       W an initializer
            y = Gemm(x, B, C?, transB=t)                W = B (t=0) or B^T (t=1); alpha = beta = 1, transA = 0
            y = MatMul(x, Cast(W_low, FLOAT))           W_low a bf16/fp16 initializer (after quantize)
    after:  y = kimi.MatMulNZ(x, W_nz, K=K, N=N)        (+ Add(C) for a Gemm with a bias)
            y = kimi.MatMulNZ(x, Cast(W_low_nz, FLOAT)) the relayout commutes with the elementwise Cast

W_nz = nd_to_nz(W, block) [ceil(N/n0), ceil(K/m0)*m0, n0], computed once here, at build time; block (m0, n0) is
`block` when set, else plugins.matmul_nz.nz_block of the stored dtype (16x16 for 16/32-bit types). An initializer
shared by several MatMuls is relaid out once; the plain one is dropped when nothing else reads it. The ONNX body of
MatMulNZ restores W exactly, so the result is bit-identical to the MatMul it replaces on ONNX Runtime.
Refusals (counted as `refused.<reason>`): weight_not_initializer, not_2d, too_small, dtype, gemm_attrs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from kimi_compile.functions import attach_functions
from kimi_compile.ops import DOMAIN
from kimi_compile.passbase import KimiPass, PassStats
from kimi_compile.plugins.matmul_nz import nd_to_nz, nz_block

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


class RelayoutNZPass(KimiPass):
    name = "relayout_nz"
    version = 1

    @dataclasses.dataclass(frozen=True)
    class Options:
        min_elements: int = dataclasses.field(default=4096, metadata={"min": 0})
        block: tuple[int, ...] = ()  # (m0, n0); () = by dtype (nz_block)

        def __post_init__(self):
            if self.block and (len(self.block) != 2 or min(self.block) <= 0):
                raise ValueError(f"block must be () or two positive ints (m0, n0), got {list(self.block)}")

    def _weight(self, node: ir.Node) -> tuple[ir.Value | None, ir.Node | None, str | None]:
        """(stored initializer, Cast between it and the node or None, refusal reason or None)."""
        w = node.inputs[1]
        cast = None
        p = w.producer() if w is not None else None
        if p is not None and p.op_type == "Cast" and p.domain == "" and p.inputs[0] is not None \
                and p.inputs[0].is_initializer():
            cast, w = p, p.inputs[0]
        if w is None or not w.is_initializer() or w.const_value is None:
            return None, None, "weight_not_initializer"
        if w.shape is None or len(w.shape) != 2:
            return None, None, "not_2d"
        if w.dtype not in _FLOATS:
            return None, None, "dtype"
        if w.const_value.size < self.options.min_elements:
            return None, None, "too_small"
        return w, cast, None

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        g = model.graph
        counts = stats.counts
        counts.update({"matches": 0, "weights_relaid": 0, "padding_bytes": 0})
        done: dict[tuple[str, bool], ir.Value] = {}  # (initializer, transposed) -> NZ initializer
        casts: dict[tuple[str, bool], ir.Value] = {}
        touched: set[str] = set()
        for node in list(g):
            if node.domain != "" or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
                continue
            trans = False
            if node.op_type == "Gemm":
                a = node.attributes
                trans = bool(a.get_int("transB", 0))
                if a.get_int("transA", 0) or a.get_float("alpha", 1.0) != 1.0 or a.get_float("beta", 1.0) != 1.0:
                    stats.add("refused.gemm_attrs")
                    continue
            w, cast, why = self._weight(node)
            if why is not None:
                stats.add(f"refused.{why}")
                continue
            arr = w.const_value.numpy()
            plain = arr.T if trans else arr
            K, N = plain.shape
            key = (w.name, trans)
            if key not in done:
                block = tuple(self.options.block) or nz_block(arr.dtype)
                nz = nd_to_nz(np.ascontiguousarray(plain), block)
                name = f"{w.name}.nz" + (".t" if trans else "")
                v = ir.Value(name=name, const_value=ir.tensor(nz, name=name))
                v.dtype, v.shape = w.dtype, ir.Shape(nz.shape)
                v.metadata_props.update({**w.metadata_props, "kimi.layout": f"nz{block[0]}x{block[1]}",
                                         "kimi.nd_shape": f"{K}x{N}"})
                g.register_initializer(v)
                done[key] = v
                counts["weights_relaid"] += 1
                counts["padding_bytes"] += (nz.size - plain.size) * arr.dtype.itemsize
                if cast is not None:
                    c = ir.node("Cast", [v], {"to": ir.DataType.FLOAT}, outputs=[ir.Value(name=name + ".f32")],
                                name=f"{name}.cast", metadata_props={"kimi.rule": "relayout_nz"})
                    c.outputs[0].dtype, c.outputs[0].shape = ir.DataType.FLOAT, ir.Shape(nz.shape)
                    g.insert_before(node, c)
                    casts[key] = c.outputs[0]
            w_in = casts.get(key, done[key])
            y = node.outputs[0]
            mm = ir.node("MatMulNZ", [node.inputs[0], w_in], {"K": int(K), "N": int(N)}, domain=DOMAIN,
                         outputs=[ir.Value(name=y.name + ".nz")],
                         name=(node.name or y.name) + ".nz", metadata_props={"kimi.rule": "relayout_nz"})
            new = [mm]
            out = mm.outputs[0]
            if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
                add = ir.node("Add", [out, node.inputs[2]], name=(node.name or y.name) + ".bias",
                              outputs=[ir.Value(name=y.name + ".nz_bias")],
                              metadata_props={"kimi.rule": "relayout_nz"})
                new.append(add)
                out = add.outputs[0]
            g.insert_before(node, new)
            name, shape, dtype = y.name, y.shape, y.dtype
            y.replace_all_uses_with(out, replace_graph_outputs=True)
            g.remove(node, safe=True)
            out.name, out.shape, out.dtype = name, shape, dtype
            counts["matches"] += 1
            touched.add(w.name)
            if cast is not None:
                touched.add(cast.outputs[0].name)
                if not cast.outputs[0].uses():
                    g.remove(cast, safe=True)
        for name in touched:
            v = g.initializers.get(name)
            if v is not None and not v.uses() and not v.is_graph_output():
                g.initializers.pop(name)
        if counts["matches"]:
            attach_functions(model)
        return counts["matches"] > 0


PASS = RelayoutNZPass
