"""`kimi-compile plan`: per-rank weight bytes, cache bytes per token and collective bytes per decode step and per
prefill token of a recipe's model under a parallel layout, without its weights (issue 17, deliverable 5).

The numbers come from partitioned graphs, not from a formula. A model too large to build (kimi-k3.1-pro: terabytes)
is planned through a *probe*: the same config with small widths (distinct values, divisible by the layout) and, when
it has more than PROBE_MAX_LAYERS layers, only its first layers up to one of every layer kind. The probe is traced
and run through the recipe's own passes, partition_tp included; rank 0's graphs are then read:

    regions      the rank graph in node order, cut after every collective that exits a tensor-parallel region
                 (role "exit" / "vocab"; a MoE's latent all-reduce stays inside its region). A region's kind is
                 what it holds: embed | kda | mla | mla_indexer | dense | moe | head.
    weights      each initializer belongs to the region of its first reader. Its dims are mapped back to the
                 config (`DimMap`: the probe's value of every field and of every product of two fields, times
                 1..4, is looked up; a dim no expression gives is a constant, one that two expressions give with
                 different values at the target is an error), split dims through their `kimi.shard` record
                 (full size = shard x parts; routed experts: held experts x ep).
    caches       the rank graph's cache inputs (their heads' slice), per token (paged pools) or per sequence
                 (KDA states), mapped the same way.
    collectives  every kimi.AllReduce / AllGather / ReduceScatter / AllToAll with the tensor it moves per token
                 (its full-size, unscattered shape), in the decode graph (T = 1) and the prefill graph.

Evaluated at the target config, each region kind's bytes are multiplied by the number of layers of that kind there
(`region_counts`). Context parallelism is read from real graphs; attention data parallel (ep > tp) is composed
from a layout the pass builds, and says so:

    tp8+ep16     ep > tp: attention data parallel. dp = ep/tp groups of tp ranks, each group running its own
                 requests; routed experts split over all tp*dp ranks. From the (tp, ep=tp) graphs: routed expert
                 tensors held / dp; per MoE layer and token a cross-group exchange of the MoEExperts node's input
                 (D) out and its latent output (L) back, (dp-1)/dp of each.
    tp8xcp4      tp x cp: partition_tp then partition_cp (appended to the recipe's passes when it lacks it); no
                 sequence parallelism with cp. Prefill collectives whose tensor has a token axis are per prompt
                 token, the others (the lengths gather) per sequence; graph inputs gathered once per graph.

Wire bytes assume ring collectives over P ranks: AllReduce 2(P-1)/P of the tensor, AllGather / ReduceScatter
(P-1)/P, AllToAll (P-1)/P.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from kimi_compile.config import KimiConfig, from_hf_dict
from kimi_compile.recipe import ParallelSpec, Recipe, parallel_problems

PROBE_MAX_LAYERS = 8  # a model with more layers is probed with its first layers (one of every kind)
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
# config fields a dim can be made of (derived ones included: a dim is often their sum)
ATOMS = ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim", "num_experts",
         "moe_intermediate_size", "routed_expert_hidden_size", "index_n_heads", "index_head_dim", "q_head_dim",
         "latent_dim")
COEFFS = (1, 2, 3, 4)


class PlanError(ValueError):
    """The plan cannot be derived (a dim maps to two different full-size values, a layout that does not divide)."""


# ---- layouts ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """tp, ep (ep > tp: attention data parallel over ep/tp groups), cp, sequence_parallel (prefill)."""

    tp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = True

    @property
    def dp(self) -> int:
        return self.ep // self.tp if self.ep > self.tp else 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def built(self) -> ParallelSpec:
        """The layout the partition passes build and the plan reads (ep capped at tp; no sequence parallelism with
        cp: the recipe schema refuses it)."""
        return ParallelSpec(tp=self.tp, ep=min(self.ep, self.tp), cp=self.cp,
                            sequence_parallel=self.sequence_parallel and self.tp > 1 and self.cp == 1)

    @property
    def name(self) -> str:
        s = f"tp{self.tp}"
        if self.ep > 1:
            s += f"+ep{self.ep}"
        if self.cp > 1:
            s += f"xcp{self.cp}"
        return s + ("" if self.sequence_parallel or self.tp == 1 or self.cp > 1 else " (no sp)")

    @classmethod
    def parse(cls, text: str) -> Layout:
        """"tp8", "tp8+ep16", "tp8xcp4", "tp2+ep2+nosp"."""
        vals = {"tp": 1, "ep": 1, "cp": 1}
        sp = True
        for part in re.split(r"[+x,\s]+", text.strip().lower()):
            if part == "nosp":
                sp = False
                continue
            m = re.fullmatch(r"(tp|ep|cp)(\d+)", part)
            if not m:
                raise PlanError(f"layout {text!r}: expected parts like tp8, ep16, cp4, nosp; got {part!r}")
            vals[m.group(1)] = int(m.group(2))
        lay = cls(vals["tp"], vals["ep"], vals["cp"], sp)
        if lay.ep > lay.tp and lay.ep % lay.tp:
            raise PlanError(f"layout {text!r}: ep={lay.ep} > tp={lay.tp} must be a multiple of tp (data-parallel "
                            "attention groups of tp ranks)")
        if lay.ep <= lay.tp and lay.tp % lay.ep:
            raise PlanError(f"layout {text!r}: ep={lay.ep} must divide tp={lay.tp}")
        return lay

    @classmethod
    def of(cls, p: ParallelSpec) -> Layout:
        return cls(p.tp, p.ep, p.cp, p.sequence_parallel or p.tp == 1)


# ---- the probe ----------------------------------------------------------------------------------------------------


def _kinds(cfg: KimiConfig, i: int) -> tuple[bool, bool, bool]:
    return cfg.is_kda(i), cfg.is_moe(i), cfg.has_indexer(i)


def probe_config(cfg: KimiConfig, lay: Layout) -> KimiConfig:
    """`cfg` with small widths, each a distinct value (split ones a multiple of tp*ep), and at most
    PROBE_MAX_LAYERS layers (else its first layers, up to one layer of every kind)."""
    d = copy.deepcopy(cfg.to_text_config())
    m = math.lcm(lay.built.tp, lay.built.ep)
    lin = dict(d["linear_attn_config"])
    # widths chosen so that the dims the graphs hold map back to one config expression (DimMap)
    d.update(hidden_size=61, vocab_size=m * 17, intermediate_size=m * 13, num_attention_heads=m * 5,
             num_key_value_heads=m * 5, q_lora_rank=11, kv_lora_rank=31, qk_nope_head_dim=71, qk_rope_head_dim=74,
             v_head_dim=73, moe_intermediate_size=m * 3,
             routed_expert_hidden_size=m * 11 if cfg.routed_expert_hidden_size else None)
    lin.update(num_heads=m * 5, head_dim=79)
    if cfg.num_experts:
        d["num_experts"] = m * next(q for q in (7, 19, 23, 29) if m * q > cfg.num_experts_per_token)
    if cfg.index_topk is not None:
        d.update(index_n_heads=83, index_head_dim=37, index_topk=min(cfg.index_topk, 8))
    n = cfg.num_hidden_layers
    if n > PROBE_MAX_LAYERS:
        want = {_kinds(cfg, i) for i in range(n)}
        seen: set = set()
        for k in range(n):
            seen.add(_kinds(cfg, k))
            if seen == want:
                n = k + 1
                break
        keep = lambda ids: [i for i in ids if i <= n]  # noqa: E731 - 1-based layer lists
        lin.update(kda_layers=keep(lin["kda_layers"]), full_attn_layers=keep(lin["full_attn_layers"]))
        if "index_layers" in d:
            d["index_layers"] = keep(d["index_layers"])
        d["num_hidden_layers"] = n
        if d.get("attn_res_block_size") and d["attn_res_block_size"] > n:
            d["attn_res_block_size"] = 2
    d["linear_attn_config"] = lin
    return from_hf_dict(d, source="plan probe")


def region_counts(cfg: KimiConfig) -> dict[str, int]:
    """How many regions of each kind the model's graphs have (one per layer half, the embedding, the head)."""
    L = range(cfg.num_hidden_layers)
    return {"embed": 1, "head": 1,
            "kda": sum(cfg.is_kda(i) for i in L),
            "mla": sum(not cfg.is_kda(i) and not cfg.has_indexer(i) for i in L),
            "mla_indexer": sum(cfg.has_indexer(i) for i in L),
            "dense": sum(not cfg.is_moe(i) for i in L),
            "moe": sum(cfg.is_moe(i) for i in L)}


# ---- dims -> config ---------------------------------------------------------------------------------------------


def _atom(cfg: KimiConfig, name: str) -> int | None:
    v = getattr(cfg, name)
    return int(v) if v else None


class DimMap:
    """A dim of the probe's graphs -> its value at the target config: the coefficient x (field | product of two
    fields) whose probe value it is, the simplest such expression first (one field before two, coefficient 1
    before more); a dim no expression gives is a constant. Two equally simple expressions giving it with
    different target values raise PlanError naming the dim's owner."""

    def __init__(self, probe: KimiConfig, target: KimiConfig):
        self.table: dict[int, dict[tuple, set[int]]] = {}  # probe value -> {(atoms, coeff): target values}
        self.names: dict[int, list[str]] = {}
        atoms = [(a, _atom(probe, a), _atom(target, a)) for a in ATOMS]
        atoms = [a for a in atoms if a[1] is not None and a[2] is not None]
        terms = [(n, 1, p, t) for n, p, t in atoms]
        terms += [(f"{a[0]}*{b[0]}", 2, a[1] * b[1], a[2] * b[2]) for a, b in
                  itertools.combinations_with_replacement(atoms, 2)]
        for (n, k, p, t), c in itertools.product(terms, COEFFS):
            self.table.setdefault(c * p, {}).setdefault((k, c), set()).add(c * t)
            self.names.setdefault(c * p, []).append(f"{c}*{n}" if c > 1 else n)

    def ambiguous(self, value: int) -> bool:
        got = self.table.get(int(value))
        return bool(got) and len(got[min(got)]) > 1

    def __call__(self, value: int, owner: str = "") -> int:
        got = self.table.get(int(value))
        if not got:
            return int(value)
        best = got[min(got)]
        if len(best) > 1:
            raise PlanError(f"plan: dim {value} of {owner} is {' or '.join(self.names[int(value)])} in the probe, "
                            f"which differ at full size ({sorted(best)}); pick other probe widths")
        return next(iter(best))


# ---- reading the rank graphs ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Collective:
    op: str  # "AllGather", or "AllGather(cp)" for the context-parallel group
    region: str
    role: str
    elements: int | None  # of the tensor it moves, per token; None: its shape is unknown in the graph
    itemsize: int
    world: int
    per: str = "token"  # token: its tensor has the token axis; sequence: it has none (KDA state maps, lengths)

    @property
    def wire_factor(self) -> float:
        p = self.world
        return 2 * (p - 1) / p if self.op == "AllReduce" else (p - 1) / p


@dataclasses.dataclass
class RankGraphs:
    """What the plan reads from one rank's partitioned graphs, mapped to the target config."""

    weights: dict[str, dict]  # region kind -> {"float": elements per region, "other": bytes per region}
    caches: list[dict]  # {name, kind, per: token|sequence, elements, itemsize, shape}
    decode: list[Collective]
    prefill: list[Collective]
    moe_io: tuple[int, int]  # the MoEExperts node's input and output elements per token (D, L) at the target
    experts: int  # routed-expert weight elements held (the probe's MoE regions, target widths)


def _is_float(v) -> bool:
    return v.dtype is not None and v.dtype.is_floating_point()


def _region_kinds(m) -> tuple[list[tuple[str, list]], dict]:
    """[(kind, nodes)] in graph order, and node -> region index. Regions close after an exit / vocab collective."""
    regions: list[tuple[str, list]] = []
    cur: list = []
    where = {}

    def kind_of(nodes) -> str:
        ops = {(n.domain, n.op_type) for n in nodes}
        roles = {n.metadata_props.get("kimi.partition_role") for n in nodes}
        if any(d == "kimi" and t.startswith("KDA") for d, t in ops):  # KDA, or partition_cp's segment ops
            return "kda"
        if ("kimi", "SparseMLA") in ops:
            return "mla_indexer" if ("kimi", "IndexerTopK") in ops else "mla"
        if ("kimi", "MoEExperts") in ops or ("kimi", "MoE") in ops:
            return "moe"
        if "vocab" in roles:
            return "head"
        if any(n.op_type == "Gather" and n.metadata_props.get("kimi.rule", "").endswith("vocab_embedding")
               for n in nodes) or not regions:
            return "embed"
        return "dense"

    for n in m.graph:
        where[n] = len(regions)
        cur.append(n)
        if n.domain == "kimi" and n.op_type in COLLECTIVES and \
                n.metadata_props.get("kimi.partition_role") in ("exit", "vocab"):
            regions.append((kind_of(cur), cur))
            cur = []
    if cur:
        if regions:  # trailing nodes (graph outputs' reshapes): the last region's
            regions[-1][1].extend(cur)
            for n in cur:
                where[n] = len(regions) - 1
        else:
            regions.append((kind_of(cur), cur))
    return regions, where


def _full_shape(v, meta: dict | None, ep: int) -> tuple[list, list]:
    """(the unsplit shape of a shard, the divisor of each dim on this rank)."""
    shape = [int(d) for d in v.shape]
    div = [1] * len(shape)
    if not meta:
        return shape, div
    if "experts" in meta:
        a, b = meta["experts"]
        shape[0] = (b - a) * ep
        div[0] = ep
    axis, parts = meta.get("axis"), meta.get("parts", 1)
    if axis is not None and parts > 1:
        ax = (1 - axis) if meta.get("transposed") else axis  # a transposed 2-D shard
        shape[ax] *= parts
        div[ax] = parts
    return shape, div


def read_rank(graphs: dict, probe: KimiConfig, target: KimiConfig, ep: int) -> RankGraphs:
    """Rank 0's decode and prefill graphs -> per-region weights, caches and collectives at `target`."""
    dmap = DimMap(probe, target)
    dec = graphs["decode"]
    regions, where = _region_kinds(dec)
    weights: dict[str, dict] = {}
    seen = set()
    experts = 0
    for kind, _ in regions:
        weights.setdefault(kind, {"float": 0, "other": 0, "n": 0})
        weights[kind]["n"] += 1
    for n in dec.graph:
        for v in n.inputs:
            if v is None or v in seen or not v.is_initializer() or v.const_value is None:
                continue
            seen.add(v)
            meta = json.loads(v.metadata_props["kimi.shard"]) if "kimi.shard" in v.metadata_props else None
            full, div = _full_shape(v, meta, ep)
            elems = math.prod(dmap(d, v.name) // k for d, k in zip(full, div))
            kind = regions[where[n]][0]
            if meta and "experts" in meta:
                experts += elems
            if _is_float(v):
                weights[kind]["float"] += elems
            else:
                weights[kind]["other"] += elems * v.dtype.itemsize
    caches = []
    for v in dec.graph.inputs:
        kind = re.match(r"(conv|state|kv|index_k)\.\d+$", v.name)
        if not kind:
            continue
        meta = json.loads(v.metadata_props["kimi.shard"]) if "kimi.shard" in v.metadata_props else None
        dims = [d for d in v.shape]
        paged = str(dims[0]) == "num_blocks"
        per_shape = [int(d) for d in dims[1:]]
        div = [1] * len(per_shape)
        if meta and meta.get("parts", 1) > 1:
            ax = meta["axis"] - 1
            per_shape[ax] *= meta["parts"]
            div[ax] = meta["parts"]
        if paged:  # [num_blocks, block, ...]: per token is the rest
            per_shape, div = per_shape[1:], div[1:]
        elems = math.prod(dmap(d, v.name) // k for d, k in zip(per_shape, div))
        caches.append({"name": v.name, "kind": kind.group(1), "per": "token" if paged else "sequence",
                       "elements": elems, "itemsize": v.dtype.itemsize})
    moe_io = (0, 0)
    for n in dec.graph:
        if n.domain == "kimi" and n.op_type == "MoEExperts":
            moe_io = (dmap(int(n.inputs[0].shape[-1]), n.name), dmap(int(n.outputs[0].shape[-1]), n.name))
            break
    return RankGraphs(weights, caches, _collectives(dec, dmap), _collectives(graphs["prefill"], dmap, prefill=True), moe_io,
                      experts)


def _collectives(m, dmap: DimMap, prefill: bool = False) -> list[Collective]:
    regions, where = _region_kinds(m)
    out = []
    for n in m.graph:
        if n.domain != "kimi" or n.op_type not in COLLECTIVES:
            continue
        v = n.inputs[0] if n.op_type == "ReduceScatter" else n.outputs[0]  # the whole tensor
        shape = v.shape
        if n.op_type == "ReduceScatter" or (n.op_type == "AllGather" and
                                             n.metadata_props.get("kimi.partition_role") == "sp_entry"):
            shape = n.outputs[0].shape  # token axis symbolic, the rest whole
        # a shape the passes left unknown: counted, its bytes not (the plan's notes say how many)
        elems = None if shape is None else math.prod(dmap(d, n.name) for d in shape if isinstance(d, int))
        world = int(n.attributes["world"].value) if "world" in n.attributes else 1
        group = n.attributes["group"].value if "group" in n.attributes else "tp"
        axes = [d for t in (n.inputs[0].shape, shape) if t is not None for d in t]  # the shard has the token axis
        per = "token" if not prefill or shape is None or any("seq" in str(d) for d in axes) else "sequence"
        region = "global" if n.inputs[0].is_graph_input() else regions[where[n]][0]  # once per graph (lengths)
        out.append(Collective(n.op_type + (f"({group})" if group != "tp" else ""), region,
                              n.metadata_props.get("kimi.partition_role", ""), elems,
                              v.dtype.itemsize if v.dtype is not None else 4, world, per))
    return out


# ---- building the probe's rank graphs -----------------------------------------------------------------------------


_SCRATCH: dict[tuple[str, str], Path] = {}  # probe traces made outside a read-only compile cache, this process


def partitioned_graphs(recipe: Recipe, cfg: KimiConfig, spec: ParallelSpec, *, cache=None,
                       say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Rank 0's {"decode", "prefill"} graphs of the model `cfg` (random weights, seed 0) through the recipe's passes
    with the parallel layout `spec` (the real pipeline; the trace and every pass are compile-cache stages)."""
    from kimi_compile import __version__, graph_io, pipeline
    from kimi_compile.build import trace_options, versions
    from kimi_compile.cache import CompileCache, cache_key
    from kimi_compile.functions import attach_functions
    from kimi_compile.trace_spec import PHASES

    cache = cache or CompileCache()
    opts = trace_options(recipe)
    vers = versions()
    key = cache_key(stage="trace", config=cfg.to_dict(), weights="plan-probe-seed0",
                    options=dataclasses.asdict(opts), torch=vers["torch"], onnx=vers["onnx"],
                    onnxscript=vers["onnxscript"], onnx_ir=vers["onnx_ir"], kimi_compile=__version__)

    def produce(d: Path) -> None:
        import torch

        from kimi_compile.model.weights import build_model, init_random
        from kimi_compile.trace import trace

        say(f"tracing the probe ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})")
        with torch.no_grad():
            graph_io.save(trace(init_random(build_model(cfg), seed=0), opts), d)

    memo = (str(cache.root), key)
    entry = _SCRATCH.get(memo)
    if entry is None:
        entry, hit = cache.get_or_create("trace", key, produce)
        if not hit and cache.read_only:  # a scratch trace (lives until exit): reuse it for the next layout
            _SCRATCH[memo] = entry
    graphs = {p: graph_io.load(entry, p) for p in PHASES}
    for m in graphs.values():
        attach_functions(m)
    r = dataclasses.replace(recipe, parallel=spec)
    if spec.cp > 1 and not any(p.name == "partition_cp" and p.enabled for p in r.passes):
        from kimi_compile.recipe import PassSpec

        r = dataclasses.replace(r, passes=(*r.passes, PassSpec(name="partition_cp", enabled=True, options={})))
    passes = pipeline.resolve(r)
    say(f"passes for tp {spec.tp} (ep {spec.ep}) x cp {spec.cp}")
    res = pipeline.run(graphs, passes, cache=cache, keys=dict.fromkeys(PHASES, key))
    pick = lambda ph: res.graphs[ph] if ph in res.graphs else res.graphs[f"{ph}.rank0"]  # noqa: E731
    return {ph: pick(ph) for ph in PHASES}


# ---- the plan ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LayoutPlan:
    layout: Layout
    weight_elements: int  # floating-point weight elements per rank
    weight_other_bytes: int  # integer constants per rank
    weight_regions: dict[str, int]  # kind -> float elements per rank (all layers of the kind)
    expert_elements: int  # of which routed-expert tensors (kimi.shard "experts")
    cache_token: dict[str, int]  # kind -> elements per token per rank (paged pools: kv, index_k)
    cache_sequence: dict[str, int]  # kind -> elements per sequence per rank (KDA conv windows and states)
    decode: dict[str, dict]  # op -> {"count", "bytes" (payload per token), "wire" (ring bytes per rank)}
    prefill: dict[str, dict]  # per prompt token
    prefill_sequence: dict[str, dict]  # per prompt sequence (cp: KDA state maps)
    notes: list[str]

    def weight_bytes(self, dtype: str) -> int:
        return self.weight_elements * DTYPE_BYTES[dtype] + self.weight_other_bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layout"] = {**dataclasses.asdict(self.layout), "name": self.layout.name, "world": self.layout.world}
        d["weight_bytes"] = {k: self.weight_bytes(k) for k in DTYPE_BYTES}
        return d


def _sum_collectives(cols: list[Collective], counts: dict[str, int], probe_counts: dict[str, int],
                     itemsize: int | None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for c in cols:
        k = 1 if c.region == "global" else counts.get(c.region, 0) / max(probe_counts.get(c.region, 1), 1)
        size = c.itemsize if itemsize is None or c.itemsize == 8 else itemsize  # int64 slots stay 8 bytes
        row = out.setdefault(c.op, {"count": 0, "bytes": 0, "wire": 0.0})
        row["count"] += k
        if c.elements is None:
            row["unknown"] = row.get("unknown", 0) + k
            continue
        row["bytes"] += k * c.elements * size
        row["wire"] += k * c.elements * size * c.wire_factor
    for row in out.values():
        row["count"] = round(row["count"])
        if "unknown" in row:
            row["unknown"] = round(row["unknown"])
        row["bytes"] = round(row["bytes"])
        row["wire"] = round(row["wire"])
    return out


def plan_layout(rank: RankGraphs, probe: KimiConfig, target: KimiConfig, lay: Layout,
                act_dtype: str | None = None) -> LayoutPlan:
    """Scale rank 0's regions from the probe's layer counts to the target's and compose dp / cp."""
    counts, pcounts = region_counts(target), region_counts(probe)
    # regions present in the probe but of a kind the rank graph calls otherwise (no MoE in a dense model) scale by 0
    regions, other = {}, 0
    for kind, w in rank.weights.items():
        k = counts.get(kind, 0) / max(pcounts.get(kind, 0), 1)
        if pcounts.get(kind, 0) != w["n"]:
            raise PlanError(f"plan: the probe's graph has {w['n']} {kind} regions, its config says "
                            f"{pcounts.get(kind, 0)}: the region reader and the model disagree")
        regions[kind] = round(w["float"] * k)
        other += round(w["other"] * k)
    notes = []
    isz = DTYPE_BYTES[act_dtype] if act_dtype else None
    decode = _sum_collectives(rank.decode, counts, pcounts, isz)
    prefill = _sum_collectives([c for c in rank.prefill if c.per == "token"], counts, pcounts, isz)
    prefill_seq = _sum_collectives([c for c in rank.prefill if c.per == "sequence"], counts, pcounts, isz)
    for phase, tbl in (("decode", decode), ("prefill", prefill), ("prefill (per sequence)", prefill_seq)):
        for op, row in tbl.items():
            if row.get("unknown"):
                notes.append(f"{phase}: {row['unknown']} of the {row['count']} {op} nodes have no shape in the "
                             "partitioned graph; their bytes are not counted")
    cache_token: dict[str, int] = {}
    cache_seq: dict[str, int] = {}
    per_layer = {"kv": "mla", "index_k": "mla_indexer", "conv": "kda", "state": "kda"}
    for c in rank.caches:
        kind = per_layer[c["kind"]]
        n_probe = pcounts["mla"] + pcounts["mla_indexer"] if kind == "mla" else pcounts[kind]
        n_target = counts["mla"] + counts["mla_indexer"] if kind == "mla" else counts[kind]
        tgt = cache_token if c["per"] == "token" else cache_seq
        tgt[c["kind"]] = tgt.get(c["kind"], 0) + c["elements"] * n_target / max(n_probe, 1)
    cache_token = {k: round(v) for k, v in cache_token.items()}
    cache_seq = {k: round(v) for k, v in cache_seq.items()}
    experts = round(rank.experts * counts.get("moe", 0) / max(pcounts["moe"], 1))  # routed experts at ep <= tp
    if lay.dp > 1:  # routed experts over every rank of the dp groups
        notes.append(f"ep{lay.ep} > tp{lay.tp}: {lay.dp} attention data-parallel groups of tp{lay.tp}; routed "
                     f"experts over all {lay.world} ranks (composed from the tp{lay.tp}+ep{lay.tp} graphs)")
        regions["moe"] -= experts - experts // lay.dp
        experts //= lay.dp
        d_in, l_out = rank.moe_io
        frac = (lay.dp - 1) / lay.dp
        size = isz or 4
        for tbl in (decode, prefill):
            tbl["AllToAll"] = {"count": 2 * counts["moe"],
                               "bytes": round(counts["moe"] * (d_in + l_out) * size),
                               "wire": round(counts["moe"] * (d_in + l_out) * size * frac)}
    if lay.cp > 1:
        notes.append(f"cp{lay.cp}: read from the partition_cp graphs (after partition_tp); no sequence parallelism "
                     "with cp; decode graphs stay whole")
    return LayoutPlan(lay, sum(regions.values()), other, regions, experts, cache_token, cache_seq, decode, prefill,
                      prefill_seq, notes)


def model_config(recipe: Recipe) -> KimiConfig:
    from kimi_compile.config import load_config, preset

    return load_config(recipe.model.checkpoint) if recipe.model.checkpoint else preset(recipe.model.preset)


def plan(recipe: Recipe, layouts: list[Layout] | None = None, *, cache=None, probe: KimiConfig | None = None,
         act_dtype: str | None = None, say: Callable[[str], None] = lambda _m: None) -> list[LayoutPlan]:
    """The plan of the recipe's model for each layout (default: the recipe's own)."""
    target = model_config(recipe)
    layouts = layouts or [Layout.of(recipe.parallel)]
    for lay in layouts:  # the full-size model must split as the probe does
        problems = [msg for _key, msg in parallel_problems(target, lay.built)]
        if lay.ep > lay.tp and target.num_experts and target.num_experts % lay.ep:
            problems.append(f"ep={lay.ep} does not divide num_experts ({target.num_experts})")
        if problems:
            raise PlanError(f"layout {lay.name!r} does not fit {recipe.model.preset or recipe.model.checkpoint}: "
                            + "; ".join(problems))
    out = []
    built: dict[ParallelSpec, tuple] = {}
    for lay in layouts:
        spec = lay.built
        if spec not in built:
            p = probe or probe_config(target, lay)
            graphs = partitioned_graphs(recipe, p, spec, cache=cache, say=say)
            built[spec] = (p, read_rank(graphs, p, target, spec.ep))
        p, rank = built[spec]
        out.append(plan_layout(rank, p, target, lay, act_dtype))
    return out


# ---- the table ---------------------------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 2**k:
            return f"{n / 2**k:,.2f} {unit}"
    return f"{n:,.0f} B"


def render(model: str, plans: list[LayoutPlan]) -> str:
    """The plan as Markdown tables (one column per layout)."""
    cols = [p.layout.name for p in plans]
    lines = [f"# plan: {model}", "", "| per rank | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(p) for p in plans) + " |")

    row("ranks", lambda p: str(p.layout.world))
    for dt in ("bf16", "fp8"):
        row(f"weights ({dt})", lambda p, dt=dt: _size(p.weight_bytes(dt)))
    row("of which MoE layers (bf16)", lambda p: _size(2 * p.weight_regions.get("moe", 0)))
    row("of which routed experts (bf16)", lambda p: _size(2 * p.expert_elements))
    row("weights, routed experts in MXFP4 (4.25 bits), rest bf16",
        lambda p: _size(2 * (p.weight_elements - p.expert_elements) + p.expert_elements * 4.25 / 8
                       + p.weight_other_bytes))
    for dt in ("bf16", "fp8"):
        row(f"KV cache per token ({dt}: MLA latent + index-K)",
            lambda p, dt=dt: _size(sum(p.cache_token.values()) * DTYPE_BYTES[dt]))
    row("KDA state per sequence (fp32)", lambda p: _size(sum(p.cache_sequence.values()) * 4))
    ops = sorted({op for p in plans for op in p.decode})
    for op in ops:
        row(f"decode step: {op} (count, payload/token)",
            lambda p, op=op: f"{p.decode[op]['count']}, {_size(p.decode[op]['bytes'])}" if op in p.decode else "-")
    row("decode step: wire bytes per token per rank",
        lambda p: _size(sum(r["wire"] for r in p.decode.values())))
    ops = sorted({op for p in plans for op in p.prefill})
    for op in ops:
        row(f"prefill token: {op} (count, payload)",
            lambda p, op=op: f"{p.prefill[op]['count']}, {_size(p.prefill[op]['bytes'])}" if op in p.prefill else "-")
    row("prefill token: wire bytes per rank", lambda p: _size(sum(r["wire"] for r in p.prefill.values())))
    for op in sorted({op for p in plans for op in p.prefill_sequence}):
        row(f"prefill sequence: {op} (count, payload)", lambda p, op=op: f"{p.prefill_sequence[op]['count']}, "
            f"{_size(p.prefill_sequence[op]['bytes'])}" if op in p.prefill_sequence else "-")
    notes = [f"- {p.layout.name}: {n}" for p in plans for n in p.notes]
    lines += ["", "Activations and collectives in bf16; caches per rank (heads split for KDA; the MLA latent and "
              "index-K pools whole on every rank). fp8 rows: 1 byte per element, scales not included."]
    return "\n".join(lines + ([""] + notes if notes else []))


# ---- the TTFT model ------------------------------------------------------------------------------------------------

# Effective H200 throughput of a whole prefill under prefill_flops' count: kimi-k3.1-small (bf16 + layered
# quantization, cuda backend, one H200) took 3.933 s for a 131072-token prompt (second prompt of that length,
# bench/results/e2e_gpu_2026-12-03.json), and prefill_flops counts CALIBRATION_FLOP for it at tp1.
CALIBRATION = {"preset": "kimi-k3.1-small", "tokens": 131072, "seconds": 3.933,
               "source": "bench/results/e2e_gpu_2026-12-03.json (ttft, ours, 131072, warm_ms)"}
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (the lower bound column)
NVLINK_GBPS = 400.0  # per rank, one direction, effective (H200 NVLink 4: 450 GB/s each way): stated, not measured
KDA_CHUNK = 64


def prefill_flops(p: LayoutPlan, cfg: KimiConfig, tokens: int) -> dict[str, float]:
    """FLOPs of one prompt of `tokens` tokens on the busiest rank of layout p (zigzag cp): every weight the rank
    holds times its tokens (routed experts at top_k / num_experts of them; the embedding is a lookup; the LM head
    runs on the last token only), the indexer + sparse attention of cp_layout.prefill_flops split over the tp
    heads, and the chunked KDA recurrence (4 Dk Dv + 2 C (Dk + Dv) per token, head and layer, C = 64)."""
    from kimi_compile.cp_layout import prefill_flops as attention_flops

    lay = p.layout
    att = max(r["indexer"] + r["attention"] for r in attention_flops(cfg, tokens, lay.cp, "zigzag"))
    n = -(-tokens // lay.cp)
    dense = p.weight_elements - p.expert_elements - p.weight_regions.get("embed", 0) - p.weight_regions.get("head", 0)
    frac = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    d = cfg.kda_head_dim
    kda = len(cfg.kda_layers) * (cfg.kda_num_heads / lay.tp) * (4 * d * d + 2 * KDA_CHUNK * 2 * d)
    return {"linear": 2.0 * n * dense, "experts": 2.0 * n * p.expert_elements * frac, "attention": att / lay.tp,
            "kda": n * kda}


def ttft_model(p: LayoutPlan, cfg: KimiConfig, tokens: int, flops_per_s: float) -> dict:
    """Modelled time to the first token of one prompt: the busiest rank's FLOPs at the calibrated throughput plus its
    collectives' wire bytes over NVLink, not overlapped (an upper bound of this model)."""
    f = prefill_flops(p, cfg, tokens)
    n = -(-tokens // p.layout.cp)
    wire = n * sum(r["wire"] for r in p.prefill.values()) + sum(r["wire"] for r in p.prefill_sequence.values())
    compute = sum(f.values()) / flops_per_s
    comm = wire / (NVLINK_GBPS * 1e9) if p.layout.world > 1 else 0.0
    return {"layout": p.layout.name, "tokens": tokens, "tflop": sum(f.values()) / 1e12,
            "tflop_parts": {k: v / 1e12 for k, v in f.items()}, "compute_s": compute, "comm_s": comm,
            "wire_bytes": wire, "ttft_s": compute + comm, "ttft_at_peak_s": sum(f.values()) / H200_BF16_PEAK + comm}


def calibrated_throughput() -> float:
    """FLOP/s that turns prefill_flops of the calibration run into its measured seconds."""
    from kimi_compile.config import preset

    cfg = preset(CALIBRATION["preset"])  # counted from its parameters, not from graphs
    return sum(prefill_flops(single_rank_plan(cfg), cfg, CALIBRATION["tokens"]).values()) / CALIBRATION["seconds"]


def single_rank_plan(cfg: KimiConfig) -> LayoutPlan:
    """One rank's weight elements of the model, counted from the reference model's parameters (meta tensors): the
    regions prefill_flops reads (embed, head, routed experts, the rest)."""
    from kimi_compile.model.weights import build_model

    model = build_model(cfg, device="meta")
    total = experts = embed = head = 0
    for name, t in model.named_parameters():
        n = t.numel()
        total += n
        if ".experts." in name and "shared" not in name:
            experts += n
        elif "embed_tokens" in name:
            embed += n
        elif "lm_head" in name:
            head += n
    return LayoutPlan(Layout(), total, 0, {"embed": embed, "head": head}, experts, {}, {}, {}, {}, {}, [])


def render_ttft(rows: list[dict], flops_per_s: float) -> str:
    lines = [f"Modelled TTFT of one prompt on H200s (busiest rank; compute at {flops_per_s / 1e12:.0f} TFLOP/s "
             f"effective, calibrated on {CALIBRATION['preset']}'s measured {CALIBRATION['tokens'] // 1024}K prefill, "
             f"{CALIBRATION['seconds']} s; collectives at {NVLINK_GBPS:.0f} GB/s per rank, not overlapped; a model, "
             "not a measurement)", "",
             "| layout | prompt | TFLOP per rank | compute | collectives | TTFT | TTFT at bf16 peak (bound) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['tokens'] // 1024}K | {r['tflop']:.0f} | {r['compute_s']:.2f} s | "
                     f"{r['comm_s']:.2f} s | {r['ttft_s']:.2f} s | {r['ttft_at_peak_s']:.2f} s |")
    return "\n".join(lines)


def plan_text(recipe_path: str, layouts: tuple[str, ...] = (), *, as_json: bool = False, act_dtype: str = "bf16",
              cache=None, say: Callable[[str], None] = lambda _m: None, ttft: tuple[int, ...] = ()) -> str:
    """What `kimi-compile plan RECIPE [--layout L ...] [--json]` prints: the Markdown table, or the plans as JSON."""
    from kimi_compile.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    plans = plan(recipe, [Layout.parse(s) for s in layouts] or None, act_dtype=act_dtype, cache=cache, say=say)
    cps = sorted({p.layout.cp for p in plans if p.layout.cp > 1})
    cfg = model_config(recipe)
    balance = cp_balance(cfg, cps) if cps else []
    rate = calibrated_throughput() if ttft else 0.0
    ttft_rows = [ttft_model(p, cfg, n, rate) for p in plans if p.layout.dp == 1 for n in ttft] if ttft else []
    if as_json:
        return json.dumps({"recipe": recipe.name, "model": recipe.model.preset or recipe.model.checkpoint,
                           "plans": [p.to_dict() for p in plans], **({"cp_balance": balance} if cps else {}),
                           **({"ttft": {"flops_per_s": rate, "calibration": CALIBRATION, "nvlink_gbps": NVLINK_GBPS,
                                        "rows": ttft_rows}} if ttft else {})}, indent=2)
    text = render(recipe.model.preset or str(recipe.model.checkpoint), plans)
    if cps:
        text += "\n\n" + render_balance(balance)
    if ttft_rows:
        text += "\n\n" + render_ttft(ttft_rows, rate)
    return text


def render_balance(rows: list[dict]) -> str:
    """cp_balance rows as a Markdown table: zigzag beside contiguous per prompt length and cp size."""
    lines = ["Context-parallel prefill balance: max/mean over ranks of indexer + attention FLOPs of one sequence "
             "(kimi_compile/cp_layout.py, a token-count model of the graphs' dominant terms, not measured)", "",
             "| prompt tokens | cp | zigzag max/mean | contiguous max/mean | zigzag max TFLOP | contiguous max TFLOP |",
             "|---|---|---|---|---|---|"]
    by = {(r["tokens"], r["cp"], r["layout"]): r for r in rows}
    for tokens, cp in sorted({(r["tokens"], r["cp"]) for r in rows}):
        z, c = by[(tokens, cp, "zigzag")], by[(tokens, cp, "contiguous")]
        lines.append(f"| {tokens // 1024}K | {cp} | {z['max_over_mean']:.4f} | {c['max_over_mean']:.4f} | "
                     f"{z['max_tflop']:.4g} | {c['max_tflop']:.4g} |")
    return "\n".join(lines)


def cp_balance(cfg: KimiConfig, cps: list[int]) -> list[dict]:
    """cp_layout.balance_table of the model at 32K, 128K and 1M tokens, for cp 2, 4, 8 and the planned sizes."""
    from kimi_compile.cp_layout import balance_table

    return balance_table(cfg, worlds=sorted({2, 4, 8, *cps}))
