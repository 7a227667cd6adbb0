"""partition_cp on small graphs (the tiny presets' rank graphs are checked end to end in tests/test_context_parallel.py):
a decode graph stays whole, a paged write gets its slots and values gathered (one gather per value), the logits
output is gathered under its name, and each refusal names what to change."""

import onnx_ir as ir
import pytest

from kimi_compile import ops
from kimi_compile.passes.partition_cp import PartitionCPError, PartitionCPPass


def _graph(seq, kimi_op="PagedWrite", lengths=True, logits="logits"):
    ids = ir.Value(name="input_ids", shape=ir.Shape(["batch", seq]), type=ir.TensorType(ir.DataType.INT64))
    lens = ir.Value(name="lengths", shape=ir.Shape(["batch"]), type=ir.TensorType(ir.DataType.INT64))
    pool = ir.Value(name="kv.0", shape=ir.Shape(["num_blocks", 16, 8]), type=ir.TensorType(ir.DataType.FLOAT))
    flat = ir.node("Reshape", [ids, ir.node("Constant", [], {"value": ir.tensor([-1])}).outputs[0]])
    vals = ir.node("Cast", [flat.outputs[0]], {"to": ir.DataType.FLOAT})
    nodes = [flat.inputs[1].producer(), flat, vals]
    if kimi_op == "PagedWrite":
        w = ir.node("PagedWrite", [pool, flat.outputs[0], vals.outputs[0]], domain=ops.DOMAIN)
        w2 = ir.node("PagedWrite", [pool, flat.outputs[0], vals.outputs[0]], domain=ops.DOMAIN)
        nodes += [w, w2]
        outs = [w.outputs[0], w2.outputs[0]]
    else:
        r = ir.node(kimi_op, [vals.outputs[0]], domain=ops.DOMAIN, num_outputs=1)
        nodes.append(r)
        outs = [r.outputs[0]]
    out = ir.node("Identity", [vals.outputs[0]])
    out.outputs[0].name = logits
    nodes.append(out)
    inputs = [ids, *([lens] if lengths else []), pool]
    return ir.Model(ir.Graph(inputs, [out.outputs[0], *outs], nodes=nodes,
                             opset_imports={"": ops.ONNX_OPSET, ops.DOMAIN: 1}), ir_version=10)


def _run(m, rank=0):
    return PartitionCPPass(PartitionCPPass.Options(cp=2, rank=rank))(m)


def test_prefill_gathers_pool_writes_and_logits():
    m = _graph("seq")
    res = _run(m)
    assert res.modified and res.counts["paged_writes"] == 2
    gathers = [n for n in m.graph if n.op_type == "AllGather"]
    assert len(gathers) == 3  # slots and values once each (shared by both writes), the logits
    assert all(n.attributes["group"].value == "cp" and n.attributes["world"].value == 2 for n in gathers)
    for w in (n for n in m.graph if n.op_type == "PagedWrite"):
        assert w.inputs[1].producer().op_type == "AllGather" and w.inputs[2].producer().op_type == "AllGather"
    out = m.graph.outputs[0]
    assert out.name == "logits_last" and out.producer().op_type == "AllGather"  # each row's last token only
    picked = [n for n in m.graph if n.op_type == "GatherElements"]
    assert len(picked) == 1 and picked[0].attributes["axis"].value == 1


def test_decode_stays_whole():
    m = _graph(1)
    before = [n.op_type for n in m.graph]
    res = _run(m, rank=1)
    assert not res.modified and res.counts["replicated"] == 1
    assert [n.op_type for n in m.graph] == before


def test_cp1_is_a_no_op():
    m = _graph("seq")
    assert not PartitionCPPass(PartitionCPPass.Options(cp=1))(m).modified


def test_refusals_name_the_fix():
    with pytest.raises(PartitionCPError, match="unfused KDA recurrence.*enable fuse_kda"):
        _run(_graph("seq", kimi_op="KDARecurrence"))
    with pytest.raises(PartitionCPError, match="no `lengths` input"):
        _run(_graph("seq", lengths=False))
    with pytest.raises(PartitionCPError, match="no `logits` output"):
        _run(_graph("seq", logits="hidden"))
    with pytest.raises(ValueError, match="rank 2 is outside cp=2"):
        PartitionCPPass.Options(cp=2, rank=2)
