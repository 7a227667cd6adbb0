"""Reference model -> ONNX IR: one prefill graph (dynamic B and T) and one decode graph (T = 1), same weights.

Every cache is explicit graph I/O (DESIGN.md §3, "Graphs and caches"):

    inputs   input_ids [B,T] int64, start [B] int64 (tokens already cached), lengths [B] int64 (valid new tokens),
             block_table [B,MB] int64, then per layer in order:
               KDA layer i:   conv.i [B, W-1, 3P], state.i [B, H, Dk, Dv] (fp32)
               MLA layer i:   kv.i [NB, BS, kv_lora+rope]  and, when indexed, index_k.i [NB, BS, index_head_dim]
    outputs  logits [B,T,vocab], then the same caches (updated) named with a `.out` suffix.

`kimi::` primitives become single `kimi.*` nodes (custom translation + OpSchema), and their ONNX function bodies are
attached after export so ONNX Runtime can inline them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import onnx
import onnx_ir as ir
import torch
from onnxscript import FLOAT  # the translation functions' return annotations name it
from torch import Tensor, nn

from kimi_compile import ops
from kimi_compile.config import KimiConfig
from kimi_compile.model.common import Step
from kimi_compile.functions import attach_functions
from kimi_compile.model.model import KimiK3ForCausalLM, LayerCache
from kimi_compile.trace_spec import (  # noqa: F401  (re-exported)
    PHASES,
    CacheSpec,
    TraceOptions,
    cache_layouts,
    cache_specs,
    graph_inputs_for,
    signature,
)

log = logging.getLogger(__name__)



class StepGraph(nn.Module):
    """The traced function: one cached step over flat tensors."""

    def __init__(self, model: KimiK3ForCausalLM, block_size: int, decode: bool, kda_chunk: int):
        super().__init__()
        self.model, self.block_size, self.decode, self.kda_chunk = model, block_size, decode, kda_chunk
        self.specs = cache_specs(model.config, block_size)

    def forward(self, input_ids: Tensor, start: Tensor, lengths: Tensor, block_table: Tensor, *caches: Tensor):
        cfg = self.model.config
        it = iter(caches)
        layer_caches = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda(i):
                layer_caches.append(LayerCache(conv=next(it), state=next(it)))
            else:
                layer_caches.append(LayerCache(kv=next(it), index=next(it) if cfg.has_indexer(i) else None))
        step = Step(start, lengths, block_table, self.block_size, self.decode, self.kda_chunk)
        logits, new = self.model.forward_step(input_ids, step, layer_caches)
        flat = []
        for i, c in enumerate(new):
            if cfg.is_kda(i):
                flat += [c.conv, c.state]
            else:
                flat += [c.kv] + ([c.index] if cfg.has_indexer(i) else [])
        return (logits, *flat)


def example_inputs(cfg: KimiConfig, opts: TraceOptions, decode: bool) -> tuple[Tensor, ...]:
    B, MB, BS = opts.example_batch, opts.example_blocks_per_seq, opts.block_size
    T = 1 if decode else opts.example_len
    NB = B * MB + 1
    ids = torch.zeros(B, T, dtype=torch.long)
    start = torch.tensor([3, 0][:B] + [0] * max(0, B - 2), dtype=torch.long)
    lengths = torch.full((B,), T, dtype=torch.long)
    bt = torch.arange(1, B * MB + 1, dtype=torch.long).view(B, MB)
    caches = []
    for s in cache_specs(cfg, BS):
        shape = [B if d == "batch" else NB if d == "num_blocks" else d for d in s.shape]
        caches.append(torch.zeros(*shape, dtype=torch.float32))
    return (ids, start, lengths, bt, *caches)


def _dynamic_shapes(cfg: KimiConfig, opts: TraceOptions, decode: bool):
    B = torch.export.Dim("batch", min=1, max=1024)
    T = torch.export.Dim("seq", min=2, max=1 << 20)
    MB = torch.export.Dim("max_blocks", min=1, max=1 << 16)
    NB = torch.export.Dim("num_blocks", min=2, max=1 << 24)
    shapes: list = [{0: B} if decode else {0: B, 1: T}, {0: B}, {0: B}, {0: B, 1: MB}]
    caches = [{0: B} if s.shape[0] == "batch" else {0: NB} for s in cache_specs(cfg, opts.block_size)]
    return (*shapes, tuple(caches))  # *caches arrives as one tuple


# ---- custom translations: kimi:: primitives -> single kimi.* nodes -------------------------------------------------

@contextlib.contextmanager
def _export_schemas() -> Iterator[None]:
    """ONNX OpSchemas of the kimi:: primitives, registered while the exporter runs (it translates a custom op only
    when ONNX knows its schema) and removed after. ONNX's schema registry is process-wide: a kimi schema left there
    makes every later ONNX shape inference in the process treat those nodes as opaque instead of reading their
    function bodies, so a pass that infers shapes (infer_shapes) would give a different graph for the same cache key
    depending on whether its process traced first."""
    from onnx.defs import OpSchema

    ops.ensure_loaded()
    added = []
    try:
        for name in ("KDARecurrence", "PagedWrite", "PagedGather"):
            op = ops.lookup(name)
            if onnx.defs.has(name, op.version, ops.DOMAIN):  # registered by someone else: theirs to remove
                continue
            onnx.defs.register_schema(OpSchema(
                name, ops.DOMAIN, op.version,
                inputs=[OpSchema.FormalParameter(n, "T") for n in op.inputs],
                outputs=[OpSchema.FormalParameter(n, "T") for n in op.outputs],
                type_constraints=[("T", ["tensor(float)", "tensor(int64)", "tensor(float16)", "tensor(bfloat16)"],
                                   "")],
                attributes=[OpSchema.Attribute(a, OpSchema.AttrType.INT) for a in op.attributes]))
            added.append((name, op.version))
        yield
    finally:
        for name, version in added:
            onnx.defs.deregister_schema(name, version, ops.DOMAIN)


def _translations():
    from onnxscript.values import Opset

    kimi = Opset(ops.DOMAIN, 1)

    def kda_recurrence(q, k, v, g, beta, state, chunk_size: int) -> tuple[FLOAT, FLOAT]:
        return kimi.KDARecurrence(q, k, v, g, beta, state, chunk_size=chunk_size, _outputs=2)

    def paged_write(pool, slots, values) -> FLOAT:
        return kimi.PagedWrite(pool, slots, values)

    def paged_gather(pool, block_table) -> FLOAT:
        return kimi.PagedGather(pool, block_table)

    return {
        torch.ops.kimi.kda_recurrence.default: kda_recurrence,
        torch.ops.kimi.paged_write.default: paged_write,
        torch.ops.kimi.paged_gather.default: paged_gather,
    }


def trace(model: KimiK3ForCausalLM, opts: TraceOptions = TraceOptions()) -> dict[str, ir.Model]:
    """Export the prefill and decode graphs. Weights stay initializers; both graphs name them identically."""
    with _export_schemas():
        return _trace(model.float().eval(), opts)


def _trace(model: KimiK3ForCausalLM, opts: TraceOptions) -> dict[str, ir.Model]:
    out: dict[str, ir.Model] = {}
    for phase in PHASES:
        decode = phase == "decode"
        t0 = time.perf_counter()
        wrapper = StepGraph(model, opts.block_size, decode, opts.kda_chunk).eval()  # no export-in-training warning
        args = example_inputs(model.config, opts, decode)
        specs = wrapper.specs
        in_names = ["input_ids", "start", "lengths", "block_table", *[s.name for s in specs]]
        out_names = ["logits", *[s.name + ".out" for s in specs]]
        with torch.no_grad():
            prog = torch.onnx.export(
                wrapper, args, dynamo=True, opset_version=ops.ONNX_OPSET, input_names=in_names,
                output_names=out_names, dynamic_shapes=_dynamic_shapes(model.config, opts, decode),
                custom_translation_table=_translations(), optimize=True, verbose=False,
            )
        m = prog.model
        attach_functions(m)
        m.graph.name = f"kimi_{phase}"
        m.metadata_props["kimi.phase"] = phase
        log.info("traced %s graph: %d nodes in %.2fs", phase, len(m.graph), time.perf_counter() - t0)
        out[phase] = m
    return out


