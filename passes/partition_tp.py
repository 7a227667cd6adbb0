"""partition_tp: one graph per rank for tensor, expert and sequence parallelism (DESIGN.md §3 "Parallelism").

The pipeline runs this pass once per rank (`partitions`: it forks each phase graph into `<phase>.rank<r>`); each copy
keeps that rank's slice of every split weight and gains explicit collectives (plugins/collectives). Rules are keyed
on op structure, never on names:

    heads        kimi.KDA: heads split (q/k/v/g/beta/gate projections and conv weights by their head columns, the
                 output projection by rows, the KDA conv window and state caches with their heads); its output is
                 a partial sum.  kimi.SparseMLA: heads split (q_nope/q_pe on axis 2, w_uk/w_uv on axis 0); the
                 latent KV pool stays whole (one latent shared by every head).
    row/column   a MatMul whose input can be split on its last axis back to column-parallel MatMuls or head-split
                 ops, through elementwise ops, Slice and Reshape, is row-parallel: the MLA output projection with
                 its q-up projection and output gate, dense MLPs (gate/up columns, down rows). Its output is partial.
    experts      kimi.MoE -> kimi.MoEExperts over the experts this rank holds (expert parallel within the TP group:
                 ep groups of tp/ep ranks; inside a group each expert's intermediate dim is split) + AllReduce of
                 the latent sum + RMSNorm + row-parallel up-projection (latent dim split) + tensor-parallel shared
                 experts (standard ops); the sum of both is partial.
    vocabulary   Gather(table [V, D], token ids): each rank looks up its V/tp rows (others give 0), partial.
                 MatMul(h, W [D, V]) producing a graph output (the LM head): columns split, AllGather of the
                 vocabulary slices.
    indexer      kimi.IndexerTopK is replicated with its projections and the index-K pool (docs/parallel.md has
                 the bytes that chose it over splitting its heads).
    partial      AllReduce after every partial value; with sequence_parallel (graphs with a dynamic sequence axis:
                 prefill) ReduceScatter along the tokens instead, the token-wise ops between regions (residual adds,
                 AttnRes, norms) run on sequence shards, and an AllGather feeds each region.

Anything no rule claims stays replicated (correct, only not sharded); the counts say what was split.

    before (one rank)                              after (rank r of 2, MLA layer)
      h = AttnResMerge(...)                          h = AttnResMerge(...)
      q = Reshape(MatMul(n, Wqb[24,48]), [.,2,24])   q = Reshape(MatMul(n, Wqb_r[24,24]), [.,1,24])
      o = SparseMLA(q.., w_uk[2,..], w_uv[2,..])     o = SparseMLA(q.., w_uk_r[1,..], w_uv_r[1,..])
      y = MatMul(Reshape(o)*Sigmoid(MatMul(h,Wg)), Wo[32,64])
                                                     y = AllReduce(MatMul(Reshape(o)*Sigmoid(MatMul(h,Wg_r)), Wo_r[16,64]))

Refusals (counted as `refused.<reason>`, with the node in near misses): a candidate chain that hits an op no rule
knows, a size that does not divide, a split value used outside its region, a shape it cannot rewrite.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Literal

import numpy as np
import onnx_ir as ir

from kimi_compile import ops
from kimi_compile.functions import attach_functions
from kimi_compile.passbase import KimiPass, PassStats
from kimi_compile.passes.infer_shapes import kimi_shapes

RULE = "partition_tp"
GROUP = "tp"

UNARY = {"Sigmoid", "Tanh", "Relu", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Abs", "Erf", "Softplus", "Cast",
         "Identity", "Sign", "Floor", "Ceil", "Not"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less", "Greater", "And", "Or"}

# heads: kimi op -> {input port: axis split with the heads} (weights and caches), and its outputs
HEAD_SPLIT = {
    "SparseMLA": {"inputs": {"q_nope": 2, "q_pe": 2}, "weights": {"w_uk": 0, "w_uv": 0}, "outputs": {"o": 2}},
    "KDA": {"inputs": {}, "caches": {"conv_state": 2, "state": 1},
            "weights": {"w_q": 1, "w_k": 1, "w_v": 1, "conv_q": 0, "conv_k": 0, "conv_v": 0, "w_f_b": 1, "w_b": 1,
                        "w_g": 1, "A_log": 0, "dt_bias": 0, "w_o": 0},
            "outputs": {"new_conv_state": 2, "new_state": 1}, "caches_out": ("new_conv_state", "new_state"),
            "partial": "out"},
}


class Refuse(Exception):
    def __init__(self, reason: str, node: str = "", detail: str = ""):
        super().__init__(reason)
        self.reason, self.node, self.detail = reason, node, detail


@dataclasses.dataclass
class Plan:
    """What one rank's graph changes: values split on an axis, weights sliced (axis, parts, index), Reshape nodes
    whose shape divides on an output axis, the nodes inside split regions, partial values to reduce."""

    split: dict = dataclasses.field(default_factory=dict)  # ir.Value -> axis
    weights: dict = dataclasses.field(default_factory=dict)  # ir.Value -> (axis, parts, index)
    reshapes: dict = dataclasses.field(default_factory=dict)  # ir.Node -> output axis
    nodes: set = dataclasses.field(default_factory=set)
    partial: list = dataclasses.field(default_factory=list)
    heads: list = dataclasses.field(default_factory=list)  # head-split kimi nodes
    caches: set = dataclasses.field(default_factory=set)  # split cache outputs (graph outputs by contract)

    def copy(self) -> Plan:
        return Plan(dict(self.split), dict(self.weights), dict(self.reshapes), set(self.nodes), list(self.partial),
                    list(self.heads), set(self.caches))


def _dims(v: ir.Value) -> list | None:
    if v is None or v.shape is None:
        return None
    return [d if isinstance(d, int) else str(d) for d in v.shape]


def _const(v: ir.Value | None) -> np.ndarray | None:
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value.numpy()
    n = v.producer()
    if n is not None and n.op_type == "Constant" and n.domain == "":
        a = next(iter(n.attributes.values())).value
        return a.numpy() if isinstance(a, ir.TensorProtocol) else np.asarray(a)
    return None


def _is_weight(v: ir.Value | None) -> bool:
    return v is not None and v.is_initializer() and v.const_value is not None


def _attr(n: ir.Node, name: str, default=None):
    a = n.attributes.get(name)
    return default if a is None else a.value


def _nbytes(v: ir.Value) -> int:
    t = v.const_value
    return int(math.prod(int(d) for d in t.shape) * t.dtype.itemsize)


class PartitionTPPass(KimiPass):
    name = "partition_tp"
    version = 4
    changes_signature = True  # KDA cache inputs take their heads' slice
    partitions = True  # the pipeline runs one copy per rank (for_rank)

    @dataclasses.dataclass(frozen=True)
    class Options:
        tp: int = dataclasses.field(default=1, metadata={"positive": True})  # from the recipe's parallel.tp
        ep: int = dataclasses.field(default=1, metadata={"positive": True})  # parallel.ep (divides tp)
        sequence_parallel: bool = False  # parallel.sequence_parallel
        rank: int = dataclasses.field(default=0, metadata={"min": 0})  # set by the pipeline per copy
        indexer: Literal["replicate"] = "replicate"  # docs/parallel.md: splitting its heads costs more bytes

        def __post_init__(self):
            if self.tp % self.ep:
                raise ValueError(f"parallel.ep={self.ep} must divide parallel.tp={self.tp} (experts are split "
                                 "within the tensor-parallel group)")
            if self.rank >= self.tp:
                raise ValueError(f"rank {self.rank} is outside tp={self.tp}")

    def ranks(self) -> int:
        return self.options.tp

    def for_rank(self, rank: int) -> PartitionTPPass:
        return PartitionTPPass(dataclasses.replace(self.options, rank=rank))

    # ---- the pass -------------------------------------------------------------------------------------------

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        o = self.options
        if o.tp == 1:
            return False
        g = model.graph
        self.model, self.g, self.stats = model, g, stats
        kimi_shapes(g)  # kimi.* outputs that shape inference left unknown or vague, from the ops' inference
        sp = o.sequence_parallel and self._has_sequence_axis()
        bytes_before = self._weight_bytes()
        plan = Plan()
        for n in list(g):  # heads of KDA layers (their output projection is inside the op)
            if n.domain == ops.DOMAIN and n.op_type == "KDA":
                self._try(plan, n, self._plan_kda)
        for n in list(g):  # row-parallel MatMuls and the column-parallel chains that feed them
            if n.domain == "" and n.op_type == "MatMul" and _is_weight(n.inputs[1]) and n not in plan.nodes:
                self._try(plan, n, self._plan_row)
        self._apply(plan)
        for n in list(g):
            if n.domain == ops.DOMAIN and n.op_type == "MoE":
                self._wrap(n, self._moe)
            elif n.domain == "" and n.op_type == "Gather" and self._is_embedding(n):
                self._wrap(n, self._embedding)
            elif n.domain == "" and n.op_type == "MatMul" and n.outputs[0].is_graph_output() and \
                    _is_weight(n.inputs[1]) and n not in plan.nodes:
                self._wrap(n, self._lm_head)
        if sp:
            self._sequence_parallel()
        self._drop_unused_initializers()
        attach_functions(model)
        sharded, replicated = self._weight_split()
        stats.counts.update({"weight_bytes.before": bytes_before, "weight_bytes.sharded": sharded,
                             "weight_bytes.replicated": replicated, "sequence_parallel": int(sp)})
        hist: dict[str, int] = {}
        for n in g:
            if n.domain == ops.DOMAIN and n.op_type in ("AllReduce", "AllGather", "ReduceScatter", "AllToAll"):
                hist[n.op_type] = hist.get(n.op_type, 0) + 1
                stats.add(f"collectives.{n.op_type}")
        model.metadata_props["kimi.partition_plan"] = json.dumps({
            "tp": o.tp, "ep": o.ep, "rank": o.rank, "sequence_parallel": sp, "group": GROUP, "indexer": o.indexer,
            "collectives": hist, "weight_bytes": {"sharded": sharded, "replicated": replicated}})
        return True

    # ---- planning: split values backwards from a row-parallel MatMul ------------------------------------------

    def _try(self, plan: Plan, n: ir.Node, fn) -> None:
        trial = plan.copy()
        try:
            fn(trial, n)
            self._check_closed(trial)
        except Refuse as e:
            self.stats.refuse(e.reason, node=e.node or n.name, anchor=n.name, detail=e.detail)
            return
        plan.__dict__.update(trial.__dict__)

    def _plan_row(self, plan: Plan, mm: ir.Node) -> None:
        x, w = mm.inputs
        if x in plan.split:
            raise Refuse("input_already_split", mm.name)
        self._need_split(plan, x, len(x.shape) - 1 if x.shape is not None else -1)
        self._slice_weight(plan, w, 0)
        plan.nodes.add(mm)
        plan.partial.append(mm.outputs[0])
        self.stats.add("row_parallel")

    def _plan_kda(self, plan: Plan, n: ir.Node) -> None:
        self._plan_head_op(plan, n)
        self.stats.add("heads.KDA")

    def _plan_head_op(self, plan: Plan, n: ir.Node) -> None:
        rule, op = HEAD_SPLIT[n.op_type], ops.lookup(n.op_type)
        port = dict(zip(op.inputs, n.inputs))
        plan.nodes.add(n)
        plan.heads.append(n)
        for name, axis in rule.get("weights", {}).items():
            self._slice_weight(plan, port[name], axis, n)
        for name, axis in rule.get("inputs", {}).items():
            self._need_split(plan, port[name], axis)
        outs = dict(zip(op.outputs, n.outputs))
        for name, axis in rule.get("outputs", {}).items():
            plan.split[outs[name]] = axis
            if name in rule.get("caches_out", ()):
                plan.caches.add(outs[name])
        for name, axis in rule.get("caches", {}).items():
            v = port[name]
            if not v.is_graph_input():
                raise Refuse("cache_not_graph_input", n.name, name)
            plan.split[v] = axis
        if "partial" in rule:
            plan.partial.append(outs[rule["partial"]])
        for name, v in port.items():  # everything else the op reads must be whole
            if v is not None and v in plan.split and name not in rule.get("inputs", {}) and \
                    name not in rule.get("caches", {}) and name not in rule.get("weights", {}):
                raise Refuse("head_op_input_split", n.name, name)

    def _slice_weight(self, plan: Plan, w: ir.Value, axis: int, node: ir.Node | None = None,
                      parts: int | None = None, index: int | None = None) -> None:
        if not _is_weight(w):
            raise Refuse("weight_not_constant", node.name if node else "", w.name if w else "")
        parts = parts or self.options.tp
        index = self.options.rank if index is None else index
        size = int(w.shape[axis])
        if size % parts:
            raise Refuse("indivisible", node.name if node else w.name, f"{w.name} axis {axis}: {size} % {parts}")
        have = plan.weights.get(w)
        if have is not None and have != (axis, parts, index):
            raise Refuse("weight_conflict", w.name)
        plan.weights[w] = (axis, parts, index)
        plan.split[w] = axis

    def _need_split(self, plan: Plan, v: ir.Value, axis: int) -> None:
        """Plan `v` split on `axis` (each rank computes its 1/tp of that axis), recursively through its producer."""
        dims = _dims(v)
        if dims is None:
            raise Refuse("unknown_shape", v.producer().name if v.producer() else v.name, v.name)
        axis %= len(dims)
        if v in plan.split:
            if plan.split[v] != axis:
                raise Refuse("split_conflict", v.name, f"axis {plan.split[v]} and {axis}")
            return
        if _is_weight(v):
            self._slice_weight(plan, v, axis)
            return
        p = v.producer()
        if p is None:
            raise Refuse("graph_input", v.name)
        plan.split[v] = axis
        plan.nodes.add(p)
        t = p.op_type if p.domain == "" else f"{p.domain}.{p.op_type}"
        if t == "MatMul":
            x, w = p.inputs
            if not _is_weight(w) or len(w.shape) != 2 or axis != len(dims) - 1:
                raise Refuse("matmul_not_column", p.name)
            if x in plan.split:
                raise Refuse("input_already_split", p.name)
            self._slice_weight(plan, w, 1, p)
            self.stats.add("column_parallel")
        elif t == "Reshape":
            self._need_split_reshape(plan, p, axis)
        elif t == "Slice":
            axes = _const(p.inputs[3]) if len(p.inputs) > 3 and p.inputs[3] is not None else None
            x = p.inputs[0]
            n_in = len(_dims(x) or dims)
            sliced = [int(a) % n_in for a in (axes if axes is not None else range(len(_const(p.inputs[1]))))]
            if axis in sliced:
                raise Refuse("slice_on_split_axis", p.name)
            self._need_split(plan, x, axis)
        elif p.domain == "" and p.op_type in UNARY:
            self._need_split(plan, p.inputs[0], axis)
        elif p.domain == "" and p.op_type in BINARY:
            for u in p.inputs:
                du = _dims(u)
                if du is None:
                    raise Refuse("unknown_shape", p.name, u.name)
                a = axis - (len(dims) - len(du))
                if a < 0 or du[a] == 1:
                    continue  # broadcast along the split axis: whole on every rank
                self._need_split(plan, u, a)
        elif p.domain == ops.DOMAIN and p.op_type in HEAD_SPLIT and "inputs" in HEAD_SPLIT[p.op_type]:
            rule = HEAD_SPLIT[p.op_type]
            want = rule["outputs"].get(ops.lookup(p.op_type).outputs[list(p.outputs).index(v)])
            if want != axis:
                raise Refuse("head_axis", p.name, f"axis {axis}")
            del plan.split[v]  # _plan_head_op sets it with the op's other outputs
            self._plan_head_op(plan, p)
            self.stats.add(f"heads.{p.op_type}")
        else:
            raise Refuse(f"producer_{p.op_type}", p.name)

    def _need_split_reshape(self, plan: Plan, p: ir.Node, axis: int) -> None:
        x, out = p.inputs[0], p.outputs[0]
        di, do = _dims(x), _dims(out)
        if di is None or do is None:
            raise Refuse("unknown_shape", p.name)
        known = lambda ds: all(isinstance(d, int) for d in ds)  # noqa: E731
        # [..., H*d] -> [..., H, d]: the head axis comes from the input's last axis
        if do[:axis] == di[:-1] and known(do[axis:]) and isinstance(di[-1], int) and \
                math.prod(do[axis:]) == di[-1]:
            self._need_split(plan, x, len(di) - 1)
        # [..., H, d] -> [..., H*d]: the last axis merges the input's axes from the head axis on
        elif axis == len(do) - 1 and isinstance(do[-1], int) and any(
                di[:k] == do[:-1] and known(di[k:]) and math.prod(di[k:]) == do[-1] for k in range(len(di))):
            k = next(k for k in range(len(di)) if di[:k] == do[:-1] and known(di[k:]) and math.prod(di[k:]) == do[-1])
            self._need_split(plan, x, k)
        else:
            raise Refuse("reshape_mapping", p.name, f"{di} -> {do} axis {axis}")
        plan.reshapes[p] = axis

    def _check_closed(self, plan: Plan) -> None:
        """A split value may only be read inside its region (planned nodes), never by a graph output."""
        for v in plan.split:
            if v.is_graph_input() or _is_weight(v) or v in plan.caches:
                continue
            if v.is_graph_output():
                raise Refuse("split_graph_output", v.name)
            for u in v.uses():
                if u.node not in plan.nodes:
                    raise Refuse("escapes_region", u.node.name, f"{v.name} is split, {u.node.name} needs it whole")

    # ---- applying the plan ------------------------------------------------------------------------------------

    def _apply(self, plan: Plan) -> None:
        g, tp = self.g, self.options.tp
        for w, (axis, parts, index) in plan.weights.items():
            new = self._shard(w, axis, parts, index)
            for u in list(w.uses()):
                if u.node in plan.nodes:
                    u.node.replace_input_with(u.idx, new)
        for p, axis in plan.reshapes.items():
            self._divide_shape(p, axis, tp)
        for v, axis in plan.split.items():
            if _is_weight(v):
                continue
            d = _dims(v)
            if d is not None and isinstance(d[axis], int):
                shape = list(v.shape)
                shape[axis] = d[axis] // tp
                v.shape = ir.Shape(shape)
        for v in plan.partial:
            self._reduce(v)
        for n in plan.heads:  # caches: the graph's cache inputs and outputs take the heads' slice
            rule = HEAD_SPLIT[n.op_type]
            op = ops.lookup(n.op_type)
            port = dict(zip(op.inputs, n.inputs))
            for name in rule.get("caches", {}):
                port[name].metadata_props["kimi.shard"] = json.dumps(
                    {"axis": plan.split[port[name]], "parts": tp, "index": self.options.rank, "heads": True})
            for name, v in zip(op.outputs, n.outputs):
                if name in rule.get("outputs", {}) and v.is_graph_output():
                    v.metadata_props["kimi.shard"] = json.dumps(
                        {"axis": rule["outputs"][name], "parts": tp, "index": self.options.rank, "heads": True})
        self.stats.add("regions.weights_sliced", len(plan.weights))

    def _shard(self, w: ir.Value, axis: int, parts: int, index: int, *, transpose: bool = False,
               name: str | None = None) -> ir.Value:
        """A new initializer holding slice `index` of `parts` of w along `axis` (the shard this rank keeps)."""
        arr = w.const_value.numpy()
        n = arr.shape[axis] // parts
        piece = np.take(arr, np.arange(index * n, (index + 1) * n), axis=axis)
        if transpose:
            piece = piece.T
        piece = np.ascontiguousarray(piece)
        nm = name or f"{w.name}.tp{index}of{parts}" + (".T" if transpose else "")
        if nm in self.g.initializers:
            return self.g.initializers[nm]
        v = ir.Value(name=nm, shape=ir.Shape(piece.shape), type=ir.TensorType(w.dtype),
                     const_value=ir.tensor(piece, name=nm))
        v.metadata_props.update(w.metadata_props)
        v.metadata_props["kimi.shard"] = json.dumps({"of": w.name, "axis": axis, "parts": parts, "index": index,
                                                     "transposed": transpose})
        self.g.register_initializer(v)
        return v

    def _const_value(self, arr: np.ndarray, name: str) -> ir.Value:
        arr = np.asarray(arr)
        nm = name
        k = 0
        while nm in self.g.initializers:
            k += 1
            nm = f"{name}.{k}"
        v = ir.Value(name=nm, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                     const_value=ir.tensor(arr, name=nm))
        self.g.register_initializer(v)
        return v

    def _divide_shape(self, p: ir.Node, axis: int, tp: int) -> None:
        """Reshape `p`'s target shape: the entry for output `axis` divided by tp (a constant, or the constant
        element of a Concat of 1-element pieces)."""
        s = p.inputs[1]
        arr = _const(s)
        if arr is not None:
            new = np.array(arr, dtype=np.int64)
            if new[axis] > 0:
                new[axis] //= tp
            p.replace_input_with(1, self._const_value(new, f"{s.name}.tp"))
            return
        c = s.producer()
        if c is None or c.op_type != "Concat":
            raise Refuse("reshape_shape_dynamic", p.name)
        pieces, pos = list(c.inputs), 0
        for i, piece in enumerate(pieces):
            d = _dims(piece)
            if d is None or not isinstance(d[0], int):
                raise Refuse("reshape_shape_dynamic", p.name)
            if pos <= axis < pos + d[0]:
                arr = _const(piece)
                if arr is None:
                    raise Refuse("reshape_shape_dynamic", p.name, piece.name)
                new = np.array(arr, dtype=np.int64)
                if new[axis - pos] > 0:
                    new[axis - pos] //= tp
                pieces[i] = self._const_value(new, f"{piece.name}.tp")
                break
            pos += d[0]
        cat = ir.node("Concat", pieces, {"axis": 0}, name=f"{c.name}.{p.name}.tp")
        cat.outputs[0].name = f"{s.name}.{p.name}.tp"
        cat.outputs[0].dtype, cat.outputs[0].shape = s.dtype, s.shape
        cat.metadata_props["kimi.rule"] = f"{RULE}.shape"
        self.g.insert_before(p, cat)
        p.replace_input_with(1, cat.outputs[0])

    def _collective(self, op: str, x: ir.Value, after: ir.Node | None, *, name: str, shape=None,
                    role: str = "", **attrs) -> ir.Value:
        """Insert kimi.<op>(x) after `after` (or before the first consumer); returns its output."""
        node = ir.node(op, [x], {"group": GROUP, "world": self.options.tp, **attrs}, domain=ops.DOMAIN,
                       name=f"{RULE}.{name}")
        out = node.outputs[0]
        out.name = name
        if x.dtype is not None:
            out.dtype = x.dtype
        out.shape = ir.Shape(shape) if shape is not None else (ir.Shape(list(x.shape)) if x.shape is not None else None)
        node.metadata_props["kimi.rule"] = f"{RULE}.{op}"
        if role:
            node.metadata_props["kimi.partition_role"] = role
        if after is not None:
            self.g.insert_after(after, node)
        else:
            first = next(iter(u.node for u in x.uses() if u.node is not node))
            self.g.insert_before(first, node)
        return out

    def _reduce(self, v: ir.Value, role: str = "exit") -> ir.Value:
        """AllReduce the partial value v; every reader of v reads the sum."""
        uses = [u for u in v.uses()]
        out = self._collective("AllReduce", v, v.producer(), name=f"{v.name}.allreduce", role=role)
        for u in uses:
            u.node.replace_input_with(u.idx, out)
        self._swap_graph_output(v, out)
        return out

    def _swap_graph_output(self, old: ir.Value, new: ir.Value) -> None:
        outs = self.g.outputs
        for i, o in enumerate(outs):
            if o is old:
                name = old.name
                old.name = f"{name}.local"
                new.name = name
                outs[i] = new

    # ---- experts, vocabulary ----------------------------------------------------------------------------------

    def _wrap(self, n: ir.Node, fn) -> None:
        try:
            fn(n)
        except Refuse as e:
            self.stats.refuse(e.reason, node=e.node or n.name, detail=e.detail)

    def _moe(self, n: ir.Node) -> None:
        """kimi.MoE -> MoEExperts (held experts, partial latent) -> AllReduce -> RMSNorm -> latent slice @ w_up rows
        + shared experts (tensor parallel) -> partial output."""
        o = self.options
        tp, ep, rank = o.tp, o.ep, o.rank
        mtp, group, j = tp // ep, rank // (tp // ep), rank % (tp // ep)
        port = dict(zip(ops.lookup("MoE").inputs, n.inputs))
        a = {k: v.value for k, v in n.attributes.items()}
        full = {**ops.lookup("MoE").attributes, **a}
        x = port["x"]
        E, inter, L = port["w1"].shape[0], port["w1"].shape[1], port["w1"].shape[2]
        hidden = port["w_up"].shape[0]
        shared = int(port["shared_gate"].shape[0]) if port["shared_gate"] is not None else 0
        for what, size, parts in (("experts", E, ep), ("moe intermediate", inter, mtp), ("latent", L, tp),
                                  ("shared intermediate", shared, tp)):
            if size % parts:
                raise Refuse("indivisible", n.name, f"{what} {size} % {parts}")
        for k in ("router_w", "router_bias", "w_down", "w1", "w3", "w2", "norm_w", "w_up", "shared_gate", "shared_up",
                  "shared_down"):
            if port[k] is not None and not _is_weight(port[k]):
                raise Refuse("weight_not_constant", n.name, k)
        y = n.outputs[0]
        yshape = list(x.shape[:-1]) + [hidden] if x.shape is not None else None
        nodes: list[ir.Node] = []

        add = _adder(n, "moe", nodes, x.dtype)

        def shard_ex(w, axis_e, axis_i):  # held experts, then this rank's slice of their intermediate dim
            arr = w.const_value.numpy()
            el, ni = E // ep, inter // mtp
            piece = np.take(np.take(arr, np.arange(group * el, (group + 1) * el), axis=axis_e),
                            np.arange(j * ni, (j + 1) * ni), axis=axis_i)
            nm = f"{w.name}.ep{group}of{ep}.tp{j}of{mtp}"
            v = ir.Value(name=nm, shape=ir.Shape(piece.shape), type=ir.TensorType(w.dtype),
                         const_value=ir.tensor(np.ascontiguousarray(piece), name=nm))
            v.metadata_props["kimi.shard"] = json.dumps({"of": w.name, "experts": [group * el, (group + 1) * el],
                                                         "axis": axis_i, "parts": mtp, "index": j})
            self.g.register_initializer(v)
            return v

        rshape = list(x.shape[:-1]) + [L] if x.shape is not None else None
        r = add("MoEExperts", [x, port["router_w"], port["router_bias"], port["w_down"], shard_ex(port["w1"], 0, 1),
                               shard_ex(port["w3"], 0, 1), shard_ex(port["w2"], 0, 2)],
                {k: full[k] for k in ("top_k", "renormalize", "scaling", "situ_beta", "situ_linear_beta")} |
                {"expert_offset": group * (E // ep)}, domain=ops.DOMAIN, shape=rshape, name="experts")
        ls = L // tp
        for node in nodes:
            self.g.insert_before(n, node)
        nodes.clear()
        r_all = self._collective("AllReduce", r, r.producer(), name=f"{r.name}.allreduce", role="moe_latent")
        rn = add("RMSNormalization", [r_all, port["norm_w"]], {"axis": -1, "epsilon": float(full["eps"]),
                                                               "stash_type": 1}, shape=rshape, name="norm")
        rs = add("Slice", [rn, self._const_value(np.array([rank * ls]), f"{n.name}.lat_start"),
                           self._const_value(np.array([(rank + 1) * ls]), f"{n.name}.lat_end"),
                           self._const_value(np.array([-1]), f"{n.name}.lat_axis")],
                 shape=(rshape[:-1] + [ls]) if rshape else None, name="latent_slice")
        w_up = self._shard(port["w_up"], 1, tp, rank, transpose=True)  # [hidden, L] -> rows of [L/tp, hidden]
        yr = add("MatMul", [rs, w_up], shape=yshape, name="up")
        out = yr
        if shared:
            beta, lbeta = float(full["situ_beta"]), float(full["situ_linear_beta"])
            sg = self._shard(port["shared_gate"], 0, tp, rank, transpose=True)
            su = self._shard(port["shared_up"], 0, tp, rank, transpose=True)
            sd = self._shard(port["shared_down"], 1, tp, rank, transpose=True)
            hs = list(x.shape[:-1]) + [shared // tp] if x.shape is not None else None
            gate = add("MatMul", [x, sg], shape=hs, name="shared_gate")
            up = add("MatMul", [x, su], shape=hs, name="shared_up")
            act = self._situ(add, up, gate, beta, lbeta, hs, n.name)
            ys = add("MatMul", [act, sd], shape=yshape, name="shared_down")
            out = add("Add", [yr, ys], shape=yshape, name="sum")
        anchor = r_all.producer()
        self.g.insert_after(anchor, nodes)
        for u in list(y.uses()):
            u.node.replace_input_with(u.idx, out)
        self._swap_graph_output(y, out)
        self.g.remove(n, safe=True)
        self._reduce(out)
        self.stats.add("experts.MoE")

    def _situ(self, add, up, gate, beta, lbeta, shape, prefix):
        b = self._const_value(np.array(beta, dtype=np.float32), f"{prefix}.situ_beta")
        gd = add("Div", [gate, b], shape=shape, name="situ_gd")
        ga = add("Mul", [add("Mul", [add("Tanh", [gd], shape=shape, name="situ_gt"), b], shape=shape, name="situ_gb"),
                         add("Sigmoid", [gate], shape=shape, name="situ_gs")], shape=shape, name="situ_a")
        u = up
        if lbeta > 0:
            lb = self._const_value(np.array(lbeta, dtype=np.float32), f"{prefix}.situ_lbeta")
            u = add("Mul", [add("Tanh", [add("Div", [up, lb], shape=shape, name="situ_ud")], shape=shape,
                                name="situ_ut"), lb], shape=shape, name="situ_u")
        return add("Mul", [ga, u], shape=shape, name="situ")

    def _is_embedding(self, n: ir.Node) -> bool:
        table, ids = n.inputs
        return _is_weight(table) and len(table.shape) == 2 and _attr(n, "axis", 0) == 0 and ids is not None and \
            ids.is_graph_input() and ids.dtype in (ir.DataType.INT64, ir.DataType.INT32)

    def _embedding(self, n: ir.Node) -> None:
        """Vocabulary-parallel lookup: rows [r*V/tp, (r+1)*V/tp) here; a token outside gives 0; partial."""
        tp, rank = self.options.tp, self.options.rank
        table, ids = n.inputs
        V = int(table.shape[0])
        if V % tp:
            raise Refuse("indivisible", n.name, f"vocabulary {V} % {tp}")
        vl = V // tp
        mine = self._shard(table, 0, tp, rank)
        out = n.outputs[0]
        nodes = []

        add = _adder(n, "vocab_embedding", nodes)

        ishape = list(ids.shape) if ids.shape is not None else None
        it = ids.dtype
        npt = np.int64 if it == ir.DataType.INT64 else np.int32
        loc = add("Sub", [ids, self._const_value(np.array(rank * vl, dtype=npt), f"{n.name}.vocab_offset")], dtype=it,
                  shape=ishape, name="local_ids")
        zero = self._const_value(np.array(0, dtype=npt), f"{n.name}.zero_id")
        held = add("And", [add("GreaterOrEqual", [loc, zero], dtype=ir.DataType.BOOL, shape=ishape, name="ge"),
                           add("Less", [loc, self._const_value(np.array(vl, dtype=npt), f"{n.name}.vocab_local")],
                               dtype=ir.DataType.BOOL, shape=ishape, name="lt")],
                   dtype=ir.DataType.BOOL, shape=ishape, name="held")
        idx = add("Where", [held, loc, zero], dtype=it, shape=ishape, name="clamped")
        rows = add("Gather", [mine, idx], {"axis": 0}, dtype=out.dtype, shape=list(out.shape), name="rows")
        held3 = add("Unsqueeze", [held, self._const_value(np.array([-1]), f"{n.name}.ax_last")],
                    dtype=ir.DataType.BOOL, shape=(ishape + [1]) if ishape else None, name="held3")
        zf = self._const_value(np.array(0, dtype=out.dtype.numpy()), f"{n.name}.zero_row")
        part = add("Where", [held3, rows, zf], dtype=out.dtype, shape=list(out.shape), name="partial")
        self.g.insert_before(n, nodes)
        for u in list(out.uses()):
            u.node.replace_input_with(u.idx, part)
        self.g.remove(n, safe=True)
        self._reduce(part)
        self.stats.add("vocab.embedding")

    def _lm_head(self, n: ir.Node) -> None:
        """Vocabulary-parallel head: this rank's V/tp columns, then AllGather of the slices (rank order)."""
        tp, rank = self.options.tp, self.options.rank
        x, w = n.inputs
        V = int(w.shape[1])
        if V % tp:
            raise Refuse("indivisible", n.name, f"vocabulary {V} % {tp}")
        n.replace_input_with(1, self._shard(w, 1, tp, rank))
        out = n.outputs[0]
        full_shape = list(out.shape)
        local = list(full_shape)
        local[-1] = V // tp
        out.shape = ir.Shape(local)
        uses = list(out.uses())
        g = self._collective("AllGather", out, n, name=f"{out.name}.allgather", shape=full_shape, axis=-1,
                             role="vocab")
        for u in uses:
            u.node.replace_input_with(u.idx, g)
        self._swap_graph_output(out, g)
        self.stats.add("vocab.lm_head")

    # ---- sequence parallelism ---------------------------------------------------------------------------------

    def _has_sequence_axis(self) -> bool:
        """Whether the token ids the embedding reads have a dynamic sequence axis ([B, T]: prefill; decode has
        T = 1 and stays plain tensor parallel)."""
        return any(n.domain == "" and n.op_type == "Gather" and self._is_embedding(n) and n.inputs[1].shape is not None
                   and len(n.inputs[1].shape) == 2 and not isinstance(n.inputs[1].shape[1], int) for n in self.g)

    def _sequence_parallel(self) -> None:
        """Region exits reduce-scatter along the tokens; token-wise ops between regions run on the shards (graph
        order: every input's placement is known when a node is reached); any other reader of a shard (a region
        entry) gets one AllGather of it."""
        domain: dict[ir.Value, int] = {}  # value on sequence shards -> its token axis
        for n in list(self.g):
            if n.domain == ops.DOMAIN and n.op_type == "AllReduce" and \
                    n.metadata_props.get("kimi.partition_role") == "exit":
                v = n.outputs[0]
                axis = _token_axis(v)
                if axis is not None and _flat(v, axis) and self._after_unflatten(n):
                    v = n.outputs[0]
                    axis = _token_axis(v)
                if axis is None:
                    self.stats.refuse("sp_token_axis", node=n.name)
                    continue
                n.op_type = "ReduceScatter"
                n.attributes["axis"] = ir.AttrInt64("axis", axis)
                n.metadata_props["kimi.rule"] = f"{RULE}.ReduceScatter"
                domain[v] = axis
        gathered: dict[ir.Value, ir.Value] = {}

        def gather(v: ir.Value) -> ir.Value:
            if v not in gathered:
                gv = self._collective("AllGather", v, v.producer(), name=f"{v.name}.allgather", axis=domain[v],
                                      role="sp_entry")
                if v.dtype is not None:
                    gv.shape = v.shape
                gathered[v] = gv
                self.stats.add("sequence_parallel.entries")
            return gathered[v]

        for n in list(self.g):
            ins = [i for i, v in enumerate(n.inputs) if v is not None and v in domain]
            if not ins or n.outputs[0] in domain:
                continue
            axes = self._tokenwise(n, domain)
            if axes is not None:
                domain.update(zip(n.outputs, axes))
                continue
            for i in ins:
                n.replace_input_with(i, gather(n.inputs[i]))
        for i, v in enumerate(self.g.outputs):
            if v in domain:
                raise Refuse("sp_graph_output", v.name)
        self.stats.add("sequence_parallel.shards", len(domain))

    def _after_unflatten(self, n: ir.Node) -> bool:
        """An exit on the flattened tokens ([B*T, D], a MoE output) whose one reader restores [B, T, D]: the reshape
        moves before the reduction (a sum commutes with it), so the exit scatters each sequence's tokens and the
        residual stream stays on shards (a [B*T] shard is not a shard of every sequence for B > 1)."""
        out = n.outputs[0]
        uses = list(out.uses())
        if len(uses) != 1 or out in self.g.outputs:
            return False
        r, idx = uses[0].node, uses[0].idx
        if r.domain != "" or r.op_type != "Reshape" or idx != 0:
            return False
        y = r.outputs[0]
        ax = _token_axis(y)
        if ax is None or _flat(y, ax) or y in self.g.outputs:
            return False
        r.replace_input_with(0, n.inputs[0])
        for u in list(y.uses()):
            u.node.replace_input_with(u.idx, out)
        n.replace_input_with(0, y)
        out.shape = y.shape
        self.g.remove(n)
        self.g.insert_after(r, n)
        self.stats.add("sequence_parallel.unflattened_exits")
        return True

    def _tokenwise(self, n: ir.Node, domain: dict) -> list[int] | None:
        """Token axes of n's outputs when n runs on sequence shards as it is (every data input on shards with
        aligned token axes; weights and constants broadcast), else None."""
        shape_args = n.domain == "" and n.op_type in ("Reshape", "Unsqueeze", "Squeeze", "Expand")
        data = [v for v in (n.inputs[:1] if shape_args else n.inputs)
                if v is not None and not _is_weight(v) and _const(v) is None]
        if not data or any(v not in domain for v in data):
            return None  # a data input that is whole: the shards go back to whole tensors here
        t = n.op_type if n.domain == "" else f"{n.domain}.{n.op_type}"
        if n.domain == "" and (n.op_type in UNARY or n.op_type in BINARY):
            rank = max(len(_dims(v) or []) for v in data)
            aligned = {domain[v] + rank - len(_dims(v)) for v in data if _dims(v) is not None}
            if len(aligned) != 1 or any(_dims(v) is None for v in data) or len({_flat(v, domain[v]) for v in data}) > 1:
                return None  # a [B*T] shard holds other rows than a [B, T] shard: never mixed
            return [aligned.pop()] * len(n.outputs)
        if t in ("RMSNormalization", "LayerNormalization"):
            v = n.inputs[0]
            d = _dims(v)
            ax = _attr(n, "axis", -1) % len(d) if d else None
            return [domain[v]] if d is not None and domain[v] < ax else None
        if t == "Unsqueeze":
            axes = _const(n.inputs[1])
            out_rank = len(_dims(n.inputs[0]) or []) + len(axes)
            a = domain[n.inputs[0]]
            for ax in sorted(int(x) % out_rank for x in axes):
                if ax <= a:
                    a += 1
            return [a]
        if t == "Concat":
            axes = {domain[v] for v in data}
            if len(axes) != 1 or len(data) != len([v for v in n.inputs if v is not None]):
                return None
            a, ax = axes.pop(), _attr(n, "axis", 0)
            d = _dims(data[0])
            if ax < 0 and d is None:
                return None
            return [a] if (ax % len(d) if d else ax) != a else None
        if t == "Reshape":
            return self._tokenwise_reshape(n, domain)
        if t == "kimi.AttnResStage1":
            return [domain[n.inputs[0]]] * 3
        if t == "kimi.AttnResMerge":
            parts = n.inputs[:4]
            if any(v not in domain for v in parts):
                return None
            return [domain[n.inputs[3]]]
        return None

    def _tokenwise_reshape(self, n: ir.Node, domain: dict) -> list[int] | None:
        """A Reshape that keeps the token axis in the same layout (one sequence's tokens [B, T, ...], or the
        flattened [B*T, ...]) and the dims after it (a full-length T in its target shape becomes -1)."""
        x, out = n.inputs[0], n.outputs[0]
        do = _dims(out)
        axis = _token_axis(out)
        if do is None or axis is None:
            return None
        a_in = domain[x]
        di = _dims(x)
        if di is not None and do[axis + 1:] != di[a_in + 1:]:
            return None
        if _flat(x, a_in) != _flat(out, axis):  # [B*T, D] <-> [B, T, D]: for B > 1 a shard of the flattened rows
            return None  # is not a shard of each sequence's tokens, so the value goes back to whole here
        s = n.inputs[1]
        arr = _const(s)
        if arr is not None:
            if int(arr[axis]) != -1:
                return None
            return [axis]
        c = s.producer()
        if c is None or c.op_type != "Concat":
            return None
        pieces, pos, changed = list(c.inputs), 0, False
        for i, piece in enumerate(pieces):
            d = _dims(piece)
            if d is None or not isinstance(d[0], int):
                return None
            if pos <= axis < pos + d[0]:
                if d[0] != 1:
                    return None
                pieces[i] = self._const_value(np.array([-1], dtype=np.int64), f"{n.name}.seq_shard")
                changed = True
            pos += d[0]
        if not changed:
            return None
        cat = ir.node("Concat", pieces, {"axis": 0}, name=f"{c.name}.{n.name}.sp")
        cat.outputs[0].name = f"{s.name}.{n.name}.sp"
        cat.outputs[0].dtype, cat.outputs[0].shape = s.dtype, s.shape
        cat.metadata_props["kimi.rule"] = f"{RULE}.sequence_shape"
        self.g.insert_before(n, cat)
        n.replace_input_with(1, cat.outputs[0])
        return [axis]

    # ---- bookkeeping ------------------------------------------------------------------------------------------

    def _weight_bytes(self) -> int:
        return sum(_nbytes(v) for v in self.g.initializers.values() if v.const_value is not None)

    def _weight_split(self) -> tuple[int, int]:
        sharded = replicated = 0
        for v in self.g.initializers.values():
            if v.const_value is None:
                continue
            if "kimi.shard" in v.metadata_props:
                sharded += _nbytes(v)
            else:
                replicated += _nbytes(v)
        return sharded, replicated

    def _drop_unused_initializers(self) -> None:
        used = {v for n in self.g for v in n.inputs if v is not None} | set(self.g.outputs)
        for name, v in list(self.g.initializers.items()):
            if v not in used:
                del self.g.initializers[name]


def _adder(n: ir.Node, rule: str, nodes: list, default_dtype=None):
    """add(op, inputs, ...) -> the output of a new node named after `n`, tagged `partition_tp.<rule>`, appended to
    `nodes` (the caller inserts them)."""
    def add(op, inputs, attrs=None, domain="", shape=None, dtype=None, name=""):
        node = ir.node(op, inputs, attrs or {}, domain=domain, name=f"{n.name}.{RULE}.{name or op}")
        node.outputs[0].name = node.name
        node.outputs[0].dtype = dtype or default_dtype
        node.outputs[0].shape = ir.Shape(shape) if shape is not None else None
        node.metadata_props["kimi.rule"] = f"{RULE}.{rule}"
        nodes.append(node)
        return node.outputs[0]
    return add


def _flat(v: ir.Value, axis: int) -> bool:
    """Whether v's token axis is the flattened batch x sequence axis ([B*T, D]), not one sequence's tokens."""
    return v.shape is not None and "*" in str(v.shape[axis])


def _token_axis(v: ir.Value) -> int | None:
    """The token axis of an activation: the dynamic axis named after the sequence ([B, T, D]: 1; [B*T, D]: 0)."""
    if v.shape is None:
        return None
    for i, d in enumerate(v.shape):
        if not isinstance(d, int) and "seq" in str(d):
            return i
    return None


PASS = PartitionTPPass
