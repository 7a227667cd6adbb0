"""infer_shapes on the fused k31 graph: every kimi.* output gets a shape in the graph's own dims (the op's inference
where ONNX, reading the function body, has to invent dims), and the result is the same in any process: a process that
traced (the k31 fixture did) and a fresh interpreter that never did give the same graph, as the compile cache assumes
of one key (docs/passes.md: the TP failure under .ci/run's warm cache archive)."""

import json
import subprocess
import sys

import onnx.defs
import onnx_ir as ir
import pytest

from kimi_compile import ops
from kimi_compile.passes.fuse_attn_res import FuseAttnResPass
from kimi_compile.passes.fuse_indexer import FuseIndexerPass
from kimi_compile.passes.fuse_kda import FuseKDAPass
from kimi_compile.passes.fuse_moe import FuseMoEPass
from kimi_compile.passes.fuse_sparse_mla import FuseSparseMLAPass
from kimi_compile.passes.infer_shapes import INVENTED, InferShapesPass
from kimi_compile.pipeline import verify_model

PHASES = ["prefill", "decode"]
FUSIONS = [FuseIndexerPass, FuseSparseMLAPass, FuseKDAPass, FuseMoEPass, FuseAttnResPass]

# a fresh interpreter: the fused graph from a file through infer_shapes, every node output's shape and dtype printed
_ELSEWHERE = """
import json, sys
import onnx_ir as ir
from kimi_compile.functions import attach_functions
from kimi_compile.passes.infer_shapes import InferShapesPass
m = ir.load(sys.argv[1])
attach_functions(m)
InferShapesPass()(m)
print(json.dumps({v.name: [None if v.shape is None else [str(d) for d in v.shape], str(v.dtype)]
                  for n in m.graph for v in n.outputs}))
"""


def _fused(k31, phase: str) -> ir.Model:
    m = k31.fresh(phase)
    for P in FUSIONS:
        P()(m)
    return m


def _shapes(m: ir.Model) -> dict:
    return {v.name: [None if v.shape is None else [str(d) for d in v.shape], str(v.dtype)]
            for n in m.graph for v in n.outputs}


def test_trace_leaves_no_kimi_schema_registered(k31):
    """The k31 fixture traced in this process; ONNX knows no kimi op afterwards (the exporter's schemas are gone)."""
    assert [op.name for op in ops.registered() if onnx.defs.has(op.name, op.domain)] == []


@pytest.mark.parametrize("phase", PHASES)
def test_kimi_outputs_keep_the_graph_dims(k31, phase):
    m = _fused(k31, phase)
    r = InferShapesPass()(m)
    verify_model(m, "test")
    assert r.counts["kimi_outputs_from_ops"] > 0
    for n in m.graph:
        if n.domain == ops.DOMAIN:
            for v in n.outputs:
                assert v.shape is not None and v.dtype is not None, (n.op_type, v.name)
                assert not any(str(d).startswith(INVENTED) for d in v.shape), (n.op_type, v.name, v.shape)
    tokens = list(m.graph.inputs[0].shape)  # input_ids [batch, T]
    cfg = k31.cfg
    mla = [n for n in m.graph if n.op_type == "SparseMLA"]
    assert len(mla) == len(cfg.indexed_layer_ids)
    for n in mla:
        assert list(n.outputs[0].shape) == [*tokens, cfg.num_attention_heads, cfg.v_head_dim]


@pytest.mark.parametrize("phase", PHASES)
def test_same_graph_in_a_process_that_never_traced(k31, phase, tmp_path):
    m = _fused(k31, phase)
    ir.save(m, tmp_path / "fused.onnx")
    InferShapesPass()(m)
    r = subprocess.run([sys.executable, "-c", _ELSEWHERE, str(tmp_path / "fused.onnx")], capture_output=True,
                       text=True, check=True)
    assert json.loads(r.stdout.splitlines()[-1]) == _shapes(m)


def test_refuses_while_a_kimi_schema_is_registered(k31):
    """A kimi OpSchema registered in the process would make ONNX skip the function bodies: the pass says so."""
    from kimi_compile.trace import _export_schemas

    m = _fused(k31, "decode")
    with _export_schemas():
        assert onnx.defs.has("PagedWrite", ops.DOMAIN)
        with pytest.raises(RuntimeError, match=r"infer_shapes: ONNX has schemas for kimi ops .*PagedWrite"):
            InferShapesPass()(m)
    assert not onnx.defs.has("PagedWrite", ops.DOMAIN)
