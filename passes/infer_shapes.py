"""infer_shapes: ONNX shape and dtype inference over the graph (local kimi functions included), then each kimi.* op's
own inference (`OpDef.infer`) where ONNX had to leave an output unknown or invent its dims; records how many values
gained a shape.

ONNX infers a kimi.* node through its function body, which gives the right dtype but, where the body loses the link
between dims (a paged gather), fresh symbols (`unk__N`) instead of the graph's `batch` / `seq` dims. The op's own
inference keeps them, and the partition passes need them (which head axis a Reshape maps to).

Invariant: the output is a function of the input graph alone (it is cached under the input's key), so ONNX must read
kimi.* nodes through their function bodies in every process: nothing may leave a kimi OpSchema registered in ONNX
(`trace` registers the primitives' schemas only while the exporter runs; docs/passes.md tells what broke before).
"""

from __future__ import annotations

import dataclasses

import onnx.defs
import onnx_ir as ir
import onnx_ir.passes.common as common

from kimi_compile import ops
from kimi_compile.passbase import KimiPass, PassStats

INVENTED = "unk__"  # the prefix of the dims ONNX's shape inference makes up for what it cannot relate


def _known(model: ir.Model) -> int:
    return sum(1 for n in model.graph for v in n.outputs if v.shape is not None and v.dtype is not None)


def _vague(shape: ir.Shape | None) -> bool:
    return shape is None or any(isinstance(d, ir.SymbolicDim) and str(d).startswith(INVENTED) for d in shape)


def _input_types(node: ir.Node) -> list[ops.TensorType | None]:
    """The node's inputs as the ops' inference reads them: None where neither shape nor dtype is known."""
    out = []
    for v in node.inputs:
        if v is None or (v.shape is None and v.dtype is None):
            out.append(None)
            continue
        shape = None if v.shape is None else tuple(d if isinstance(d, int) else str(d) for d in v.shape)
        out.append(ops.TensorType(shape, (v.dtype or ir.DataType.FLOAT).value))
    return out


def kimi_shapes(graph: ir.Graph) -> int:
    """Each kimi.* node output gets, from its op's own inference (graph order: a kimi op reads what the ones before it
    got):
    - its shape, where unknown or with invented dims;
    - its dtype, where unknown, and also where ONNX's inference says otherwise once every input's dtype is known: the
      op decides its outputs' dtypes (AttnResMerge's in partial's dtype, KDA's recurrent state float32, ...), while
      ONNX reads the function body, which is the float32 trace form and says float32 in a bfloat16 graph too.
    Returns how many outputs changed. Best effort: an op without inference, or whose inference refuses the inputs,
    is left as it is."""
    changed = 0
    for n in graph:
        if n.domain != ops.DOMAIN:
            continue
        op = ops.lookup(n.op_type)
        if op.infer is None:
            continue
        typed = all(v is None or v.dtype is not None for v in n.inputs)
        if not typed and not any(_vague(v.shape) or v.dtype is None for v in n.outputs):
            continue
        attrs = {**op.attributes, **{k: a.value for k, a in n.attributes.items()}}
        try:
            inferred = op.infer(_input_types(n), attrs)
        except Exception:  # noqa: BLE001 - inference is best effort here; shapes stay as they are
            continue
        for v, t in zip(n.outputs, inferred):
            old = (v.shape, v.dtype)
            if _vague(v.shape) and t.shape is not None and all(d is not None for d in t.shape) and \
                    not _vague(ir.Shape(list(t.shape))):
                v.shape = ir.Shape(list(t.shape))
            if v.dtype is None or (typed and t.dtype is not None):
                v.dtype = ir.DataType(t.dtype)
            changed += (v.shape, v.dtype) != old
    return changed


class InferShapesPass(KimiPass):
    name = "infer_shapes"
    version = 3

    @dataclasses.dataclass(frozen=True)
    class Options:
        strict: bool = False
        data_prop: bool = True  # propagate shape values through Shape/Gather/Concat chains

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        schemas = [op.name for op in ops.registered() if onnx.defs.has(op.name, op.domain)]
        if schemas:
            raise RuntimeError(f"infer_shapes: ONNX has schemas for kimi ops {schemas} registered in this process, "
                               "so it would not infer them through their function bodies and the graph would depend "
                               "on the process; whatever registered them must remove them when done (as trace does)")
        before = _known(model)
        kimi = kimi_shapes(model.graph)  # the ops' own dtypes first, so that ONNX propagates them to the ops after
        common.ShapeInferencePass(check_type=True, strict_mode=self.options.strict, data_prop=self.options.data_prop)(model)
        kimi += kimi_shapes(model.graph)
        after = _known(model)
        stats.counts.update({"values_typed": after - before, "values_total": sum(len(n.outputs) for n in model.graph),
                             "kimi_outputs_from_ops": kimi})
        return after != before or kimi > 0


PASS = InferShapesPass
