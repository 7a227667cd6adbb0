"""Serializing optimized graphs: `graphs/<phase>.onnx` for every phase plus one `graphs/weights.bin` holding each
distinct initializer once (prefill and decode point at the same bytes as external data, never duplicated). Shared by
the backends that ship ONNX graphs (onnxruntime, cuda). A partitioned build's graphs (`<phase>.rank<r>`) get one
weights file per rank, `graphs/weights.rank<r>.bin`, holding only that rank's shards. Imports no torch."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

WEIGHTS = "weights.bin"
ALIGN = 64


def weights_file(phase: str) -> str:
    """The weights file of a phase graph: weights.bin, or weights.rank<r>.bin for rank r's `<phase>.rank<r>`."""
    _, sep, rank = phase.partition(".rank")
    return f"weights.rank{rank}.bin" if sep else WEIGHTS


def write_graphs(graphs: dict, out_dir: Path) -> dict[str, Any]:
    """Serialize the graphs with shared external weights; returns {phase: {"file", "weights"},
    "_shared_initializers": n (initializers whose bytes were already written, in any phase)}. Initializers are
    shared by content: the phases' traces name one weight differently (`val_188` in one, `val_506` in the other), so
    a name would miss most of them."""
    gdir = Path(out_dir) / "graphs"
    gdir.mkdir(parents=True, exist_ok=True)
    shared = 0
    files: dict[str, list[str]] = {}
    held: dict[str, dict[str, int]] = {}
    for phase in graphs:
        files.setdefault(weights_file(phase), []).append(phase)
    for name, phases in files.items():
        n, held[name] = _write_weights(graphs, phases, gdir, name)
        shared += n
    import onnx_ir as ir

    record: dict[str, Any] = {}
    for phase, model in graphs.items():
        rel = f"graphs/{phase}.onnx"
        proto = ir.to_proto(model)
        (Path(out_dir) / rel).write_bytes(proto.SerializeToString())
        record[phase] = {"file": rel, "weights": f"graphs/{weights_file(phase)}"}
    record["_shared_initializers"] = shared
    record["_weight_bytes"] = held
    return record


def _write_weights(graphs: dict, phases: list[str], gdir: Path, weights: str) -> tuple[int, dict[str, int]]:
    """Writes the initializers of `phases` into `weights`; (initializers whose bytes were already written, the bytes the
    phases hold: {"sharded": a partition pass's slices (kimi.shard metadata), "replicated": the rest}, each distinct
    content once, small inline constants included)."""
    import onnx_ir as ir

    offsets: dict[tuple[str, int], tuple[int, int]] = {}
    held: dict[tuple[str, int], tuple[bool, int]] = {}
    shared = 0
    with open(gdir / weights, "wb") as f:
        for phase in phases:
            model = graphs[phase]
            for name, value in list(model.graph.initializers.items()):
                tensor = value.const_value
                if tensor is None:
                    continue
                data = tensor.tobytes()
                key = (hashlib.sha256(data).hexdigest(), len(data))
                held[key] = ("kimi.shard" in value.metadata_props, len(data))
                if len(data) < 1024:  # small constants stay inline
                    value.const_value = ir.Tensor(tensor.numpy(), name=name)
                    continue
                if key in offsets:
                    shared += 1
                else:
                    pad = (-f.tell()) % ALIGN
                    f.write(b"\0" * pad)
                    offsets[key] = (f.tell(), len(data))
                    f.write(data)
                off, length = offsets[key]
                value.const_value = ir.ExternalTensor(weights, off, length, tensor.dtype, shape=tensor.shape,
                                                      name=name, base_dir=str(gdir))
    return shared, {"sharded": sum(n for s, n in held.values() if s),
                    "replicated": sum(n for s, n in held.values() if not s)}
