"""convert_dtype: the graph in the recipe's model dtype (bfloat16 or float16) end to end.

Every float32 tensor becomes `dtype` (initializers rounded to nearest even, Constant/ConstantOfShape values, Cast
targets, value types), except the ones that must stay float32:
    - the ports each kimi.* op declares in `OpDef.float32_ports` (recurrent states and the like),
    - graph inputs/outputs feeding or fed by such ports (the KDA state caches),
    - the `logits` output (cast back to float32 at the end, so sampling and comparisons see float32).
Where a converted value meets a float32 port (or the reverse) a Cast is inserted, tagged `kimi.rule=convert_dtype`.

    before: x f32 -> MatMul(x, W f32) -> kimi.KDA(h, conv f32, state f32, ...) -> new_state f32
    after:  x bf16 -> MatMul(x, W bf16) -> kimi.KDA(h, conv bf16, state f32, ...) -> new_state f32
Counts: `initializers_converted`, `bytes_saved`, `casts_inserted`, `values_converted`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import ml_dtypes
import numpy as np
import onnx_ir as ir

from kimi_compile import ops
from kimi_compile.passbase import KimiPass, PassStats

RULE = "convert_dtype"
_TARGET = {"bfloat16": (ir.DataType.BFLOAT16, ml_dtypes.bfloat16), "float16": (ir.DataType.FLOAT16, np.float16)}
F32 = ir.DataType.FLOAT


class ConvertDtypePass(KimiPass):
    name = "convert_dtype"
    version = 1
    changes_signature = True  # cache inputs/outputs change dtype

    @dataclasses.dataclass(frozen=True)
    class Options:
        dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the build fills it from model.dtype

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        if self.options.dtype == "float32":
            return False
        dt, np_dt = _TARGET[self.options.dtype]
        g = model.graph
        keep = self._float32_values(g)
        stats.counts.update({"initializers_converted": 0, "bytes_saved": 0, "casts_inserted": 0,
                             "values_converted": 0})
        for name, v in list(g.initializers.items()):
            if v.dtype == F32 and v not in keep and v.const_value is not None:
                arr = v.const_value.numpy().astype(np_dt)
                v.const_value = ir.tensor(arr, name=name)
                v.dtype = dt
                stats.add("initializers_converted")
                stats.add("bytes_saved", arr.size * 2)
        for v in g.inputs:
            if v.dtype == F32 and v not in keep:
                v.dtype = dt
                stats.add("values_converted")
        for node in list(g):
            self._node(g, node, dt, np_dt, keep, stats)
        self._logits_f32(g, dt, stats)
        g.sort()
        return True

    @staticmethod
    def _float32_values(g: ir.Graph) -> set[ir.Value]:
        keep: set[ir.Value] = set()
        for node in g:
            if node.domain != ops.DOMAIN:
                continue
            op = ops.lookup(node.op_type, node=node.name)
            for port, v in zip(op.inputs, node.inputs):
                if v is not None and port in op.float32_ports and (v.is_graph_input() or v.is_initializer()):
                    keep.add(v)
            for port, v in zip(op.outputs, node.outputs):
                if port in op.float32_ports:
                    keep.add(v)
        return keep

    def _node(self, g, node: ir.Node, dt, np_dt, keep: set, stats: PassStats) -> None:
        if node.op_type == "Cast" and node.domain == "" and node.attributes["to"].as_int() == F32.value \
                and node.outputs[0] not in keep:
            node.attributes["to"] = ir.AttrInt64("to", dt.value)
        if node.op_type in ("Constant", "ConstantOfShape") and node.domain == "":
            for key in ("value", "value_float", "value_floats"):
                a = node.attributes.get(key)
                if a is None:
                    continue
                if key == "value":
                    t = a.as_tensor()
                    if t.dtype == F32:
                        node.attributes["value"] = ir.AttrTensor("value", ir.tensor(t.numpy().astype(np_dt)))
                else:
                    arr = np.asarray(a.value, dtype=np.float32).astype(np_dt)
                    del node.attributes[key]
                    node.attributes["value"] = ir.AttrTensor("value", ir.tensor(arr if key == "value_floats"
                                                                               else arr.reshape(())))
        ports = set()
        if node.domain == ops.DOMAIN:
            op = ops.lookup(node.op_type, node=node.name)
            ports = op.float32_ports
            for i, (port, v) in enumerate(zip(op.inputs, node.inputs)):
                want = F32 if port in ports else dt
                if v is not None and v.dtype in (F32, dt) and v.dtype != want:
                    node.replace_input_with(i, self._cast(g, node, v, want, stats))
        elif not _float_inputs_convert(node, keep):  # a standard op over float32-kept values only stays float32
            keep.update(node.outputs)
            return
        else:  # a standard op: float inputs must agree; float32-kept values entering it are cast down
            for i, v in enumerate(node.inputs):
                if v is not None and v in keep and v.dtype == F32:
                    node.replace_input_with(i, self._cast(g, node, v, dt, stats))
        names = ops.lookup(node.op_type).outputs if node.domain == ops.DOMAIN else [None] * len(node.outputs)
        for port, v in zip(names, node.outputs):
            if v.dtype == F32 and v not in keep and port not in ports:
                v.dtype = dt
                stats.add("values_converted")

    @staticmethod
    def _cast(g: ir.Graph, before: ir.Node, v: ir.Value, to: ir.DataType, stats: PassStats) -> ir.Value:
        c = ir.node("Cast", [v], {"to": to.value}, outputs=[ir.Value(name=f"{v.name}.{to.name.lower()}")],
                    name=f"{RULE}.{v.name}.{to.name.lower()}", metadata_props={"kimi.rule": RULE})
        c.outputs[0].dtype, c.outputs[0].shape = to, v.shape
        g.insert_before(before, c)
        stats.add("casts_inserted")
        return c.outputs[0]

    @staticmethod
    def _logits_f32(g: ir.Graph, dt, stats: PassStats) -> None:
        for i, out in enumerate(list(g.outputs)):
            if out.name != "logits" or out.dtype != dt:
                continue
            out.name = "logits.low"
            c = ir.node("Cast", [out], {"to": F32.value}, outputs=[ir.Value(name="logits")],
                        name=f"{RULE}.logits", metadata_props={"kimi.rule": RULE})
            c.outputs[0].dtype, c.outputs[0].shape = F32, out.shape
            g.append(c)
            g.outputs[i] = c.outputs[0]
            stats.add("casts_inserted")


def _float_inputs_convert(node: ir.Node, keep: set) -> bool:
    """A standard op converts (its outputs go low precision) unless all its float inputs are float32-kept."""
    floats = [v for v in node.inputs if v is not None and v.dtype is not None and v.dtype.is_floating_point()]
    return not floats or not all(v in keep for v in floats)


PASS = ConvertDtypePass
