"""partition_cp: one prefill graph per rank for context parallelism (DESIGN.md §3 "Parallelism", issue 18,
docs/context_parallel.md).

The pipeline runs this pass once per rank (`partitions`: each phase graph forks into `<phase>.rank<r>`). A rank's
prefill graph takes that rank's pieces of every sequence as its rows (kimi_compile/cp_layout.py: zigzag, rank r
holding chunks r and 2P-1-r of 2P; or contiguous): row j*B + b is sequence b's chunk rank_chunks(r)[j], with its
own `start` (the chunk's global position), `lengths` (its tokens) and the sequence's block-table row. Token-wise ops
(projections, norms, AttnRes, MoE) run on the rank's tokens as they are; positions are global through `start`.
The rules, keyed on ops (group "cp", world cp):

    paged writes   kimi.PagedWrite(pool, slots, values): slots and values all-gathered (one AllGather per value),
                   so every rank writes every token where single-rank prefill would: the pools (MLA latent KV,
                   index-K) are whole and identical on every rank, and IndexerTopK / SparseMLA read them for the
                   rank's own queries with the causal mask on global positions (start + t)
    KDA            kimi.KDA -> KDAConvTail, AllGather(tails), KDASegmentMap, AllGather(maps), KDASegmentReplay
                   (plugins/kda_cp: exact sequence parallelism by affine state maps; one AllGather of `lengths`
                   serves every layer); the new conv window and state are the sequence's, on every rank
    logits         only each row's last valid token goes through the LM head: the head's input (the MatMul with a
                   constant weight that `logits` comes from, through elementwise ops with constants) is gathered at
                   position max(lengths, 1) - 1 of each row, and those [rows, 1, vocab] logits are all-gathered as
                   the output `logits_last` (world * rows rows, small), so every rank holds the logits of each
                   prompt's last token and samples the same next token for the replicated decode; the executor picks
                   the row that holds it. No rank computes or moves the other tokens' logits.

Decode graphs (no dynamic sequence axis) stay whole: every rank runs the same decode on identical caches. After
partition_tp (tp x cp), each tp rank's graph is split again: the rules never look at heads, and the collectives
here use group "cp" (the ranks of one tp index; world rank = cp index * tp + tp index).

    before (one rank)                               after (rank r of P)
      o, c', s' = KDA(x, c, s, lengths, ...)          t = KDAConvTail(x, lengths, ...)
                                                      ts = AllGather(t);  ls = AllGather(lengths)
                                                      m = KDASegmentMap(x, c, lengths, ts, ls, ...)
                                                      o, c', s' = KDASegmentReplay(x, c, s, lengths, ts, ls,
                                                                                   AllGather(m), ...)
      kv' = PagedWrite(kv, slots, latent)             kv' = PagedWrite(kv, AllGather(slots), AllGather(latent))

Refusals (errors: the graph cannot be split exactly): an unfused KDA recurrence (kimi.KDARecurrence: enable
fuse_kda), a prefill graph without the `lengths` input or the `logits` output.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import numpy as np
import onnx_ir as ir

from kimi_compile import cp_layout, ops
from kimi_compile.functions import attach_functions
from kimi_compile.passbase import KimiPass, PassStats

RULE = "partition_cp"
GROUP = "cp"
KDA_ATTRS = ("lower_bound", "scale", "l2_eps", "eps", "chunk_size")


class PartitionCPError(ValueError):
    pass


class PartitionCPPass(KimiPass):
    name = "partition_cp"
    version = 2
    changes_signature = True  # the prefill's `logits` output becomes `logits_last` (every rank's rows' last token)
    partitions = True  # the pipeline runs one copy per rank (for_rank)

    @dataclasses.dataclass(frozen=True)
    class Options:
        cp: int = dataclasses.field(default=1, metadata={"positive": True})  # from the recipe's parallel.cp
        cp_layout: Literal["zigzag", "contiguous"] = "zigzag"  # parallel.cp_layout
        rank: int = dataclasses.field(default=0, metadata={"min": 0})  # set by the pipeline per copy

        def __post_init__(self):
            if self.rank >= self.cp:
                raise ValueError(f"rank {self.rank} is outside cp={self.cp}")

    def ranks(self) -> int:
        return self.options.cp

    def for_rank(self, rank: int) -> PartitionCPPass:
        return PartitionCPPass(dataclasses.replace(self.options, rank=rank))

    def run(self, model: ir.Model, stats: PassStats) -> bool:
        o = self.options
        if o.cp == 1:
            return False
        g = self.g = model.graph
        self.stats = stats
        inputs = {v.name: v for v in g.inputs}
        ids = inputs.get("input_ids")
        if ids is None or ids.shape is None or isinstance(ids.shape[1], int):
            stats.counts["replicated"] = 1  # decode: whole on every rank
            model.metadata_props["kimi.partition_plan"] = json.dumps({"cp": o.cp, "rank": o.rank, "phase": "whole"})
            return False
        for n in g:
            if n.domain == ops.DOMAIN and n.op_type == "KDARecurrence":
                raise PartitionCPError(f"{RULE}: node {n.name!r} is an unfused KDA recurrence (kimi.KDARecurrence); "
                                       "context parallelism splits fused kimi.KDA layers: enable fuse_kda in passes")
        if "lengths" not in inputs:
            raise PartitionCPError(f"{RULE}: the prefill graph has no `lengths` input (graph I/O contract)")
        outs = {v.name: (i, v) for i, v in enumerate(g.outputs)}
        if "logits" not in outs:
            raise PartitionCPError(f"{RULE}: the prefill graph has no `logits` output (graph I/O contract)")
        self._gathered: dict[ir.Value, ir.Value] = {}
        for n in list(g):
            if n.domain == ops.DOMAIN and n.op_type == "PagedWrite":
                for port in (1, 2):  # slots, values
                    n.replace_input_with(port, self._gather(n.inputs[port], before=n))
                stats.add("paged_writes")
            elif n.domain == ops.DOMAIN and n.op_type == "KDA":
                self._kda(n, inputs["lengths"])
                stats.add("kda_layers")
        i, logits = outs["logits"]
        last = self._last_rows(logits, inputs["lengths"])
        gathered = self._collective(last, after=last.producer(), name="logits.cp_gather")
        logits.name = "logits.cp_local"
        gathered.name = "logits_last"
        g.outputs[i] = gathered
        attach_functions(model)
        hist: dict[str, int] = {}
        for n in g:
            if n.domain == ops.DOMAIN and n.op_type == "AllGather":
                hist["AllGather"] = hist.get("AllGather", 0) + 1
        stats.counts["collectives.AllGather"] = hist.get("AllGather", 0)
        model.metadata_props["kimi.partition_plan"] = json.dumps({
            "cp": o.cp, "cp_layout": o.cp_layout, "rank": o.rank, "group": GROUP, "phase": "split",
            "chunks": list(cp_layout.rank_chunks(o.cp, o.cp_layout, o.rank)), "collectives": hist})
        return True

    # ---- rewrites ---------------------------------------------------------------------------------------------

    _ELEMENTWISE = {"Cast", "Mul", "Div", "Add", "Sub", "Tanh", "Identity"}

    def _last_rows(self, logits: ir.Value, lengths: ir.Value) -> ir.Value:
        """[rows, 1, vocab]: the logits of each row's last valid token, the LM head run on those rows only (the
        gather moves before the head's MatMul when the chain to it is elementwise with constants)."""
        chain, v = [], logits
        while True:
            n = v.producer()
            if n is None or n.domain not in ("", "ai.onnx"):
                break
            data = [x for x in n.inputs if x is not None and x.const_value is None]
            if n.op_type == "MatMul" and len(data) == 1 and n.inputs[0] is data[0]:
                chain.append(n)
                v = n.inputs[0]
                break
            if n.op_type not in self._ELEMENTWISE or len(data) != 1:
                chain = []
                v = logits
                break
            chain.append(n)
            v = data[0]
        head = chain[-1] if chain and chain[-1].op_type == "MatMul" else None
        x = v if head is not None else logits
        anchor = [x.producer()]

        def node(op, ins, attrs=None, name=""):
            nd = ir.node(op, ins, attrs or {}, name=f"{RULE}.last.{name or op}")
            nd.metadata_props["kimi.rule"] = f"{RULE}.last_token"
            if head is not None:  # right before the head, in order
                self.g.insert_before(head, nd)
            else:  # after the logits' producer, in order
                self.g.insert_after(anchor[0], nd)
                anchor[0] = nd
            return nd.outputs[0]

        def const(name, arr):
            arr = np.asarray(arr, np.int64)
            nm = f"{RULE}.last.{name}"
            if nm not in self.g.initializers:
                self.g.register_initializer(ir.Value(name=nm, shape=ir.Shape(arr.shape),
                                                     type=ir.TensorType(ir.DataType.INT64),
                                                     const_value=ir.tensor(arr, name=nm)))
            return self.g.initializers[nm]

        pos = node("Sub", [node("Max", [lengths, const("one", [1])]), const("one", [1])], name="pos")
        idx = node("Reshape", [pos, const("col", [-1, 1, 1])], name="idx")
        shp = node("Shape", [x], name="shape")
        tgt = node("Concat", [node("Slice", [shp, const("s0", [0]), const("one", [1])], name="rows"),
                              const("one", [1]), node("Slice", [shp, const("s2", [2]), const("s3", [3])],
                                                      name="width")], {"axis": 0}, name="target")
        picked = node("GatherElements", [x, node("Expand", [idx, tgt], name="expand")], {"axis": 1}, name="gather")
        if x.dtype is not None:
            picked.dtype = x.dtype
        if x.shape is not None:
            picked.shape = ir.Shape([x.shape[0], 1, *list(x.shape)[2:]])
        if head is None:
            return picked
        head.replace_input_with(0, picked)
        for n in chain:  # the head and the elementwise ops after it now carry one row per sequence piece
            for o in n.outputs:
                if o.shape is not None and len(o.shape) >= 2:
                    o.shape = ir.Shape([o.shape[0], 1, *list(o.shape)[2:]])
        self.stats.add("last_token_head")
        return logits

    def _collective(self, x: ir.Value, *, after: ir.Node | None = None, before: ir.Node | None = None,
                    name: str) -> ir.Value:
        node = ir.node("AllGather", [x], {"axis": 0, "group": GROUP, "world": self.options.cp}, domain=ops.DOMAIN,
                       name=f"{RULE}.{name}")
        out = node.outputs[0]
        out.name = name
        out.dtype = x.dtype
        if x.shape is not None:
            out.shape = ir.Shape([None, *list(x.shape)[1:]])
        node.metadata_props["kimi.rule"] = f"{RULE}.AllGather"
        if after is not None:
            self.g.insert_after(after, node)
        elif before is not None:
            self.g.insert_before(before, node)
        else:
            self.g.insert_before(next(iter(self.g)), node)
        return out

    def _gather(self, v: ir.Value, *, before: ir.Node) -> ir.Value:
        """One AllGather per value, placed after its producer (or first, for a graph input)."""
        if v not in self._gathered:
            p = v.producer()
            self._gathered[v] = (self._collective(v, after=p, name=f"{v.name}.cp_gather") if p is not None
                                 else self._collective(v, before=before, name=f"{v.name}.cp_gather"))
        return self._gathered[v]

    def _kda(self, n: ir.Node, lengths: ir.Value) -> None:
        o = self.options
        port = dict(zip(ops.lookup("KDA").inputs, n.inputs))
        attrs = {k: n.attributes[k].value for k in KDA_ATTRS if k in n.attributes}
        attrs.update(world=o.cp, rank=o.rank, layout=o.cp_layout)
        lens = self._gather(lengths, before=n)
        prep = [port[k] for k in ("w_q", "w_k", "w_v", "conv_q", "conv_k", "conv_v", "w_f_a", "w_f_b", "w_b")]
        base = n.name

        def node(op, ins, outs, a):
            m = ir.node(op, ins, a, domain=ops.DOMAIN, name=f"{base}.{op}", num_outputs=outs)
            m.metadata_props["kimi.rule"] = f"{RULE}.kda"
            self.g.insert_before(n, m)
            return m.outputs

        (tail,) = node("KDAConvTail", [port["x"], port["lengths"], port["w_q"], port["w_k"], port["w_v"],
                                       port["conv_q"]], 1, attrs)
        tail.name, tail.dtype = f"{base}.tail", ir.DataType.FLOAT
        tails = self._collective(tail, before=n, name=f"{base}.tails")
        (mp,) = node("KDASegmentMap", [port["x"], port["conv_state"], port["lengths"], tails, lens, *prep,
                                       port["A_log"], port["dt_bias"]], 1, attrs)
        mp.name, mp.dtype = f"{base}.map", ir.DataType.FLOAT
        maps = self._collective(mp, before=n, name=f"{base}.maps")
        new = node("KDASegmentReplay", [port["x"], port["conv_state"], port["state"], port["lengths"], tails, lens,
                                        maps, *prep, port["w_g"], port["A_log"], port["dt_bias"], port["o_norm"],
                                        port["w_o"]], 3, attrs)
        for old, v in zip(n.outputs, new):
            v.dtype, v.shape = old.dtype, old.shape
            name = old.name
            old.name = f"{name}.unsplit"
            ir.convenience.replace_all_uses_with(old, v, replace_graph_outputs=True)
            v.name = name
        self.g.remove(n, safe=True)


PASS = PartitionCPPass
