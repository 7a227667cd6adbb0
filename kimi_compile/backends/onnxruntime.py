"""ONNX Runtime backend (CPU, the embedded default).

build: writes `graphs/<phase>.onnx` for every phase plus one `graphs/weights.bin` holding each distinct initializer
once (prefill and decode point at the same bytes: external data, never duplicated). load: one InferenceSession per
phase. Imports no torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

NAME = "onnxruntime"
BUILD_VERSION = 2  # bump when the files build() writes change (part of the cache key)
WEIGHTS = "weights.bin"
ALIGN = 64


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("onnxruntime")


def build(graphs: dict, out_dir: Path, options: dict | None = None) -> dict[str, Any]:
    """Serialize the optimized graphs with shared external weights; returns {phase: {"file": rel_path}}."""
    import onnx_ir as ir

    gdir = Path(out_dir) / "graphs"
    gdir.mkdir(parents=True, exist_ok=True)
    offsets: dict[tuple[str, str], tuple[int, int]] = {}
    shared = 0
    with open(gdir / WEIGHTS, "wb") as f:
        for phase, model in graphs.items():
            for name, value in list(model.graph.initializers.items()):
                tensor = value.const_value
                if tensor is None:
                    continue
                data = tensor.tobytes()
                if len(data) < 1024:  # small constants stay inline
                    value.const_value = ir.Tensor(tensor.numpy(), name=name)
                    continue
                key = (name, hashlib.sha256(data).hexdigest())
                if key in offsets:
                    shared += 1
                else:
                    pad = (-f.tell()) % ALIGN
                    f.write(b"\0" * pad)
                    offsets[key] = (f.tell(), len(data))
                    f.write(data)
                off, length = offsets[key]
                value.const_value = ir.ExternalTensor(WEIGHTS, off, length, tensor.dtype, shape=tensor.shape,
                                                      name=name, base_dir=str(gdir))
    record: dict[str, Any] = {}
    for phase, model in graphs.items():
        rel = f"graphs/{phase}.onnx"
        proto = ir.to_proto(model)
        (Path(out_dir) / rel).write_bytes(proto.SerializeToString())
        record[phase] = {"file": rel, "weights": f"graphs/{WEIGHTS}"}
    record["_shared_initializers"] = shared
    return record


class Executor:
    """Runs a phase graph: `run(phase, feeds) -> {output_name: array}`."""

    def __init__(self, artifact_dir: Path, graphs: dict, threads: int | None = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.sessions = {}
        for phase, g in graphs.items():
            self.sessions[phase] = ort.InferenceSession(str(Path(artifact_dir) / g["file"]), so,
                                                        providers=["CPUExecutionProvider"])
        self.output_names = {p: [o.name for o in s.get_outputs()] for p, s in self.sessions.items()}

    def run(self, phase: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.sessions[phase].run(None, feeds)
        return dict(zip(self.output_names[phase], outs))


def load(artifact_dir: Path, manifest: dict, **kwargs) -> Executor:
    return Executor(artifact_dir, manifest["graphs"], **kwargs)
