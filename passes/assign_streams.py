"""assign_streams: a list schedule of each graph onto at most N GPU streams, recorded in node metadata.

    before: every node on one stream, in graph order
    after:  node.metadata_props["kimi.stream"] = "k" (0 = the main stream), and "kimi.wait" = the names of the
            nodes on other streams whose outputs it reads (the executor waits on their events);
            model.metadata_props["kimi.stream_plan"] = JSON: streams used, the makespan on 1 and on N streams under
            the cost model, events, and per node (start, end, stream) for the report's Gantt chart

The dependency DAG (networkx) of the graph's nodes is list-scheduled (HEFT-style): nodes are taken in order of their
upward rank (the longest cost path from the node to the end), each placed on the stream where it finishes first,
where reading a value produced on another stream costs an event. A node leaves the stream of its latest-finishing
input only if that gains at least `min_gain_us`: forks too small to pay for their events stay on one stream.
Nothing here names a model, a layer or an op: the parallel branches come out of the DAG and the costs.

Cost of a node (microseconds): launch overhead per kernel + max(bytes moved / bandwidth, FLOPs / peak), with the
graph's symbolic dims bound to the recipe's shape (decode: `batch` sequences of `context` tokens; prefill: one chunk
of `prefill_tokens`); a paged pool input counts only the rows a step reads (batch x context). FLOPs are counted for
contractions (MatMul, Gemm, Einsum) and per element elsewhere. `profile` (a JSON file {op type: microseconds})
overrides the model per op type with measured times.
Counts: `streams_used`, `side_nodes` (nodes off the main stream), `events`, `makespan_1_us`, `makespan_n_us` (x1000,
integers).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math

import networkx as nx
import onnx_ir as ir

from kimi_compile import ops
from kimi_compile.passbase import KimiPass, PassStats

STREAM = "kimi.stream"
WAIT = "kimi.wait"
PLAN = "kimi.stream_plan"
_CONTRACTIONS = ("MatMul", "Gemm", "Einsum")
_KERNELS = {"primitive": 1, "quant": 3, "fused": 4}  # launches per kimi.* op, by its registry kind


@dataclasses.dataclass(frozen=True)
class CostModel:
    batch: int = 1
    context: int = 32768
    prefill_tokens: int = 4096
    block_size: int = 64
    bandwidth_gbps: float = 4300.0  # measured device copy bandwidth of an H200 (KINDS.md)
    tflops: float = 700.0  # bf16 dense
    launch_us: float = 2.0  # per kernel, replayed in a CUDA graph
    profile: dict = dataclasses.field(default_factory=dict)

    def dims(self, phase: str) -> dict[str, int]:
        T = 1 if phase == "decode" else self.prefill_tokens
        B = self.batch if phase == "decode" else 1
        mb = -(-self.context // self.block_size)
        return {"batch": B, "seq": T, "max_blocks": mb, "num_blocks": B * mb + 1}

    def numel(self, v: ir.Value | None, dims: dict[str, int]) -> int:
        if v is None or v.shape is None:
            return 0
        n = 1
        for i, d in enumerate(v.shape):
            if isinstance(d, int):
                n *= d
            else:
                n *= dims.get(str(d), 1 if i else dims["batch"])
        return n

    def nbytes(self, v: ir.Value | None, dims: dict[str, int]) -> int:
        if v is None or v.dtype is None:
            return 0
        return self.numel(v, dims) * max(1, v.dtype.itemsize)

    def cost_us(self, node: ir.Node, dims: dict[str, int]) -> float:
        key = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
        if key in self.profile:
            return float(self.profile[key])
        moved = sum(self.nbytes(v, dims) for v in (*node.inputs, *node.outputs))
        out = sum(self.numel(v, dims) for v in node.outputs)
        flops = float(out)
        if node.op_type in _CONTRACTIONS and node.inputs and node.inputs[0] is not None:
            k = node.inputs[0].shape[-1] if node.inputs[0].shape else 1
            flops = 2.0 * out * (k if isinstance(k, int) else 1)
        kernels = 1 if node.domain == "" else _KERNELS.get(ops.lookup(node.op_type).kind, 4)
        return kernels * self.launch_us + max(moved / (self.bandwidth_gbps * 1e3), flops / (self.tflops * 1e6))


def dependency_dag(graph: ir.Graph) -> nx.DiGraph:
    """Nodes (by position) with an edge producer -> consumer for every value read."""
    g = nx.DiGraph()
    index = {id(n): i for i, n in enumerate(graph)}
    for i, n in enumerate(graph):
        g.add_node(i)
        for v in n.inputs:
            p = v.producer() if v is not None else None
            if p is not None and id(p) in index:
                g.add_edge(index[id(p)], i)
    return g


def list_schedule(dag: nx.DiGraph, cost: dict[int, float], streams: int, event_us: float,
                  min_gain_us: float) -> dict[int, tuple[int, float, float]]:
    """{node: (stream, start, end)}. HEFT-style: nodes in order of upward rank, each on the stream where it finishes
    first (reading another stream's output costs `event_us`; ties keep the stream of its latest input). Then every
    branch a side stream runs (a connected run of its nodes) whose total cost is under `min_gain_us` goes back to
    the stream it forked from, and the schedule is re-timed."""
    rank: dict[int, float] = {}
    topo = list(nx.topological_sort(dag))
    for n in reversed(topo):
        rank[n] = cost[n] + max((rank[s] for s in dag.successors(n)), default=0.0)
    indeg = {n: dag.in_degree(n) for n in dag}
    ready = [(-rank[n], n) for n in dag if indeg[n] == 0]
    heapq.heapify(ready)
    free = [0.0] * streams
    placed: dict[int, tuple[int, float, float]] = {}
    order: list[int] = []
    while ready:
        _, n = heapq.heappop(ready)
        preds = list(dag.predecessors(n))
        home = max(preds, key=lambda p: placed[p][2], default=None)
        home_s = placed[home][0] if home is not None else 0

        def finish(s: int) -> tuple[float, float]:
            at = max((placed[p][2] + (event_us if placed[p][0] != s else 0.0) for p in preds), default=0.0)
            start = max(at, free[s])
            return start, start + cost[n]

        best, (b_start, b_end) = home_s, finish(home_s)
        for s in range(streams):
            st, en = finish(s)
            if en < b_end - 1e-9:
                best, b_start, b_end = s, st, en
        placed[n] = (best, b_start, b_end)
        free[best] = b_end
        order.append(n)
        for s in dag.successors(n):
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, (-rank[s], s))
    stream = {n: placed[n][0] for n in dag}
    for s in range(1, streams):  # cheap side branches go home: their events would cost more than they save
        side = dag.subgraph([n for n in dag if stream[n] == s])
        for comp in nx.weakly_connected_components(side):
            if sum(cost[n] for n in comp) >= min_gain_us:
                continue
            outside = [p for n in comp for p in dag.predecessors(n) if p not in comp]
            home = max(outside, key=lambda p: placed[p][2], default=None)
            for n in comp:
                stream[n] = stream[home] if home is not None else 0
    return _retime(dag, cost, stream, order, streams, event_us)


def _retime(dag: nx.DiGraph, cost: dict[int, float], stream: dict[int, int], order: list[int], streams: int,
            event_us: float) -> dict[int, tuple[int, float, float]]:
    """Start/end of every node given its stream, issuing nodes in `order` (a topological order)."""
    free = [0.0] * streams
    out: dict[int, tuple[int, float, float]] = {}
    for n in order:
        s = stream[n]
        at = max((out[p][2] + (event_us if stream[p] != s else 0.0) for p in dag.predecessors(n)), default=0.0)
        start = max(at, free[s])
        out[n] = (s, start, start + cost[n])
        free[s] = start + cost[n]
    return out


class AssignStreamsPass(KimiPass):
    name = "assign_streams"
    version = 1

    @dataclasses.dataclass(frozen=True)
    class Options:
        streams: int = dataclasses.field(default=3, metadata={"min": 1, "max": 8})
        batch: int = dataclasses.field(default=1, metadata={"positive": True})  # decode sequences (cost model)
        context: int = dataclasses.field(default=32768, metadata={"positive": True})  # tokens cached per sequence
        prefill_tokens: int = dataclasses.field(default=4096, metadata={"positive": True})
        block_size: int = dataclasses.field(default=64, metadata={"positive": True})
        event_us: float = 1.5  # one cross-stream wait (record + wait in a graph)
        min_gain_us: float = 4.0  # a fork must shorten the schedule by this much, else it stays on one stream
        profile: str = ""  # JSON file {op type: measured microseconds} overriding the cost model

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        o = self.options
        profile = {}
        if o.profile:
            with open(o.profile) as f:
                profile = json.load(f)
        cm = CostModel(o.batch, o.context, o.prefill_tokens, o.block_size, profile=profile)
        phase = model.metadata_props.get("kimi.phase", model.graph.name.replace("kimi_", "") or "decode")
        dims = cm.dims(phase)
        nodes = list(model.graph)
        for i, n in enumerate(nodes):  # waits name their producers: every node needs a unique name
            if not n.name:
                n.name = f"{n.op_type}_{i}"
        dag = dependency_dag(model.graph)
        cost = {i: cm.cost_us(n, dims) for i, n in enumerate(nodes)}
        placed = list_schedule(dag, cost, o.streams, o.event_us, o.min_gain_us)
        events = 0
        for i, n in enumerate(nodes):
            s = placed[i][0]
            n.metadata_props[STREAM] = str(s)
            waits = sorted({nodes[p].name for p in dag.predecessors(i) if placed[p][0] != s})
            if waits:
                n.metadata_props[WAIT] = ",".join(waits)
                events += len(waits)
            else:
                n.metadata_props.pop(WAIT, None)
        one = sum(cost.values())
        many = max((e for _, _, e in placed.values()), default=0.0)
        used = sorted({s for s, _, _ in placed.values()})
        plan = {"phase": phase, "streams": len(used), "makespan_1_us": round(one, 3), "makespan_n_us": round(many, 3),
                "events": events, "cost_model": dataclasses.asdict(cm) | {"profile": bool(profile)},
                "schedule": [[n.name, placed[i][0], round(placed[i][1], 3), round(placed[i][2], 3),
                              f"{n.domain}.{n.op_type}" if n.domain else n.op_type] for i, n in enumerate(nodes)]}
        model.metadata_props[PLAN] = json.dumps(plan)
        stats.counts.update({"streams_used": len(used), "side_nodes": sum(1 for s, _, _ in placed.values() if s),
                             "events": events, "makespan_1_us_x1000": int(math.floor(one * 1000)),
                             "makespan_n_us_x1000": int(math.floor(many * 1000))})
        return True


PASS = AssignStreamsPass
