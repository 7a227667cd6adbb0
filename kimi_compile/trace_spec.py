"""The graph contract shared by trace, build, backends and the runtime, without torch: phases, trace options,
the cache tensors of the signature and their layouts."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx_ir as ir

from kimi_compile.config import KimiConfig

PHASES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    block_size: int = 16
    kda_chunk: int = 64
    example_batch: int = 2
    example_len: int = 5
    example_blocks_per_seq: int = 4


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """One cache tensor of the graph signature."""

    name: str
    layer: int
    kind: str  # conv | state | kv | index_k
    shape: tuple  # symbolic dims as strings
    dtype: str


def cache_specs(cfg: KimiConfig, block_size: int) -> list[CacheSpec]:
    P, W = cfg.kda_proj_dim, cfg.short_conv_kernel_size
    out: list[CacheSpec] = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_kda(i):
            out.append(CacheSpec(f"conv.{i}", i, "conv", ("batch", W - 1, 3 * P), "float32"))
            out.append(CacheSpec(f"state.{i}", i, "state", ("batch", cfg.kda_num_heads, cfg.kda_head_dim,
                                                            cfg.kda_head_dim), "float32"))
        else:
            out.append(CacheSpec(f"kv.{i}", i, "kv", ("num_blocks", block_size, cfg.latent_dim), "float32"))
            if cfg.has_indexer(i):
                out.append(CacheSpec(f"index_k.{i}", i, "index_k", ("num_blocks", block_size, cfg.index_head_dim),
                                     "float32"))
    return out


def signature(m: ir.Model) -> dict:
    """I/O signature of a graph for the manifest: names, dtypes and (symbolic) shapes."""

    def desc(v: ir.Value) -> dict:
        shape = None if v.shape is None else [d if isinstance(d, int) else str(d) for d in v.shape]
        return {"name": v.name, "dtype": v.dtype.name if v.dtype is not None else None, "shape": shape}

    return {"inputs": [desc(v) for v in m.graph.inputs], "outputs": [desc(v) for v in m.graph.outputs]}


_NP_DTYPE = {"FLOAT": "float32", "FLOAT16": "float16", "UINT8": "uint8", "INT64": "int64", "INT32": "int32",
             "BFLOAT16": "bfloat16", "FLOAT8E4M3FN": "float8_e4m3fn", "FLOAT8E5M2": "float8_e5m2"}  # numpy/ml_dtypes


def cache_layouts(cfg: KimiConfig, block_size: int, graph: ir.Model | None = None) -> list[dict]:
    """Every cache: shape, dtype and bytes per token (per sequence for the KDA states).

    With `graph` (a built phase graph), the rows are its cache inputs as they are after the passes (issue 5: the
    quantize pass splits a cache into codes / scale / kept pools, tagged with metadata_props kimi.cache, kimi.role,
    kimi.format, kimi.dims); each row then also says `cache` (the logical cache), `role`, `format` and
    `scale_layout`."""
    if graph is not None:
        return _graph_cache_layouts(cfg, block_size, graph)
    rows = []
    for s in cache_specs(cfg, block_size):
        per = 1
        for d in s.shape[1:]:
            per *= d
        paged = s.shape[0] == "num_blocks"
        rows.append({
            "name": s.name, "layer": s.layer, "kind": s.kind, "shape": list(s.shape), "dtype": s.dtype,
            "paged": paged,
            "bytes_per_token": (per // block_size) * 4 if paged else 0,
            "bytes_per_sequence": 0 if paged else per * 4,
        })
    return rows


def _graph_cache_layouts(cfg: KimiConfig, block_size: int, m: ir.Model) -> list[dict]:
    specs = {s.name: s for s in cache_specs(cfg, block_size)}
    rows = []
    for v in m.graph.inputs:
        meta = v.metadata_props
        parent = specs.get(meta.get("kimi.cache", v.name))
        if parent is None:
            continue
        shape = [d if isinstance(d, int) else str(d) for d in v.shape]
        if shape and shape[0] == "num_blocks" or parent.shape[0] == "num_blocks":
            shape[0] = "num_blocks"
        elif parent.shape[0] == "batch":
            shape[0] = "batch"
        dtype = _NP_DTYPE.get(v.dtype.name, v.dtype.name.lower())
        per = 1
        for d in shape[1:]:
            per *= d
        paged = shape[0] == "num_blocks"
        nbytes = int(per * v.dtype.itemsize)
        fmt = meta.get("kimi.format", dtype)
        row = {"name": v.name, "layer": parent.layer, "kind": parent.kind, "shape": shape, "dtype": dtype,
               "paged": paged,
               "bytes_per_token": nbytes // block_size if paged else 0,
               "bytes_per_sequence": 0 if paged else nbytes,
               "cache": parent.name, "role": meta.get("kimi.role", ""), "format": fmt,
               "dims": meta.get("kimi.dims", f"0:{parent.shape[-1]}")}
        if "/" in fmt:  # a scale pool: "<e8m0|fp32>/<values per scale>"
            kind, per_scale = fmt.split("/")
            row["scale_layout"] = f"{kind} per {per_scale} values, [..., {shape[-1]}] per token"
        elif fmt.endswith(".codes"):
            row["scale_layout"] = f"{fmt}, scales in {v.name}.scale"
        rows.append(row)
    return rows


def graph_inputs_for(cfg: KimiConfig, block_size: int) -> Sequence[str]:
    return ["input_ids", "start", "lengths", "block_table", *[s.name for s in cache_specs(cfg, block_size)]]
