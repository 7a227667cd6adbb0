"""assign_streams: a list schedule onto at most N streams from the DAG and a cost model (no names of models, layers
or ops); every dependency respected; chains and cheap forks stay on one stream; the indexer preamble of the K3.1
graph spreads over three streams and joins at kimi.IndexerTopK."""

from __future__ import annotations

import json

import networkx as nx
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from kimi_compile.passes.assign_streams import PLAN, STREAM, WAIT, AssignStreamsPass, list_schedule


def _model(nodes, outputs, width=1024) -> ir.Model:
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", width])],
                     [h.make_tensor_value_info(o, T.FLOAT, ["batch", width]) for o in outputs])
    m = ir.serde.deserialize_model(h.make_model(g, opset_imports=[h.make_opsetid("", 23)]))
    for n in m.graph:
        for v in n.outputs:
            v.dtype, v.shape = ir.DataType.FLOAT, ir.Shape(["batch", width])
    return m


def _streams(m):
    return {n.name: int(n.metadata_props[STREAM]) for n in m.graph}


def test_a_chain_stays_on_one_stream():
    nodes = [h.make_node("Relu", ["x" if i == 0 else f"y{i - 1}"], [f"y{i}"], name=f"n{i}") for i in range(12)]
    m = _model(nodes, ["y11"])
    r = AssignStreamsPass()(m)
    assert set(_streams(m).values()) == {0} and r.counts["events"] == 0 and r.counts["side_nodes"] == 0
    assert not any(WAIT in n.metadata_props for n in m.graph)


def _fork(branch_len: int, width: int):
    nodes = [h.make_node("Relu", ["x"], ["a0"], name="a0"), h.make_node("Relu", ["x"], ["b0"], name="b0")]
    for i in range(1, branch_len):
        nodes += [h.make_node("Relu", [f"a{i - 1}"], [f"a{i}"], name=f"a{i}"),
                  h.make_node("Relu", [f"b{i - 1}"], [f"b{i}"], name=f"b{i}")]
    nodes.append(h.make_node("Add", [f"a{branch_len - 1}", f"b{branch_len - 1}"], ["y"], name="join"))
    return _model(nodes, ["y"], width)


def test_a_fork_below_the_threshold_is_not_split():
    m = _fork(1, 16)  # two single tiny kernels: the gain (one launch) is below min_gain_us
    AssignStreamsPass(AssignStreamsPass.Options(min_gain_us=4.0))(m)
    assert set(_streams(m).values()) == {0}


def test_a_long_fork_runs_its_branches_on_two_streams_and_joins():
    m = _fork(6, 1 << 16)
    r = AssignStreamsPass()(m)
    s = _streams(m)
    assert {s["a0"], s["b0"]} == {0, 1} or len({s["a0"], s["b0"]}) == 2
    assert all(s[f"a{i}"] == s["a0"] and s[f"b{i}"] == s["b0"] for i in range(6))  # each branch a chain
    join = next(n for n in m.graph if n.name == "join")
    other = "a5" if s["join"] != s["a0"] else "b5"
    assert join.metadata_props[WAIT] == other  # the join waits on the other branch's last node
    plan = json.loads(m.metadata_props[PLAN])
    assert plan["makespan_n_us"] < plan["makespan_1_us"] and r.counts["events"] == 1


@pytest.mark.parametrize("seed", range(25))
def test_random_dags_respect_every_dependency(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 60))
    und = nx.gnp_random_graph(n, float(rng.uniform(0.03, 0.3)), seed=seed)
    dag = nx.DiGraph([(min(a, b), max(a, b)) for a, b in und.edges()])
    dag.add_nodes_from(range(n))
    cost = {i: float(rng.uniform(0.5, 30)) for i in range(n)}
    streams, event = int(rng.integers(1, 5)), 1.5
    placed = list_schedule(dag, cost, streams, event, float(rng.uniform(0, 5)))
    assert set(placed) == set(range(n))
    for a, b in dag.edges():
        sa, _, ea = placed[a]
        sb, sb_start, _ = placed[b]
        assert sb_start >= ea + (event if sa != sb else 0.0) - 1e-9, (a, b)
    for s in range(streams):  # no two nodes overlap on one stream
        spans = sorted((st, en) for x, (ss, st, en) in placed.items() if ss == s)
        assert all(e1 <= s2 + 1e-9 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert max(s for s, _, _ in placed.values()) < streams


def test_the_indexer_preamble_branches_land_on_three_streams(k31):
    """On the fused K3.1 decode graph at the small preset's cost model: the index Q projection, the index K
    normalization and the head-weight projection run on three different streams and join at kimi.IndexerTopK."""
    from kimi_compile.passes.fuse_indexer import FuseIndexerPass

    m = k31.fresh("decode")
    FuseIndexerPass()(m)
    AssignStreamsPass(AssignStreamsPass.Options(streams=3, batch=1, context=32768, block_size=8))(m)
    topk = next(n for n in m.graph if n.op_type == "IndexerTopK")
    q, w, pool = topk.inputs[0], topk.inputs[1], topk.inputs[2]

    def first(v, op):
        frontier, seen = [v], set()
        while frontier:
            x = frontier.pop(0)
            p = x.producer() if x is not None else None
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.op_type == op:
                return p
            frontier += [i for i in p.inputs if i is not None and not i.is_initializer()]
        raise AssertionError(f"no {op} above {v.name}")

    q_proj = first(q, "MatMul")
    k_norm = first(pool.producer().inputs[2], "LayerNormalization")
    w_proj = first(w, "MatMul")
    streams = {int(n.metadata_props[STREAM]) for n in (q_proj, k_norm, w_proj)}
    assert len(streams) == 3, {n.name: n.metadata_props[STREAM] for n in (q_proj, k_norm, w_proj)}
    waits = set(topk.metadata_props.get(WAIT, "").split(","))
    assert waits, "IndexerTopK joins the other streams"


def test_cuda_executor_with_streams_gives_identical_outputs_on_cpu(k31):
    import torch

    from kimi_compile.backends.cuda.program import Program

    m = k31.fresh("decode")
    plain = Program(m, "cpu")
    AssignStreamsPass()(m)
    streamed = Program(m, "cpu")
    assert streamed.streams > 1 and any(s.waits for s in streamed.steps)
    feeds = {k: torch.from_numpy(np.array(v)) for k, v in k31.feeds["decode"].items()}
    a = plain.run({k: v.clone() for k, v in feeds.items()})
    b = streamed.run({k: v.clone() for k, v in feeds.items()})
    assert all(torch.equal(a[k], b[k]) for k in a)
    onnx.checker.check_model(ir.to_proto(m))  # metadata only: the graph stays valid ONNX
