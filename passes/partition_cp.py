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
    logits         the graph output `logits` all-gathered over the ranks' rows (the executor restores the order)

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
    version = 1
    changes_signature = True  # the prefill logits output holds every rank's rows
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
        gathered = self._collective(logits, after=logits.producer(), name="logits.cp_gather")
        logits.name = "logits.cp_local"
        gathered.name = "logits"
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
