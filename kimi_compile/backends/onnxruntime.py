"""ONNX Runtime backend (CPU, the embedded default).

build: the graphs as ONNX with shared external weights (backends/serialize.py). load: one InferenceSession per
phase. Imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kimi_compile.backends.serialize import write_graphs

NAME = "onnxruntime"
BUILD_VERSION = 2  # bump when the files build() writes change (part of the cache key)


def version() -> str:
    from importlib.metadata import version as dist_version

    return dist_version("onnxruntime")


def build(graphs: dict, out_dir: Path, options: dict | None = None) -> dict[str, Any]:
    """Serialize the optimized graphs with shared external weights; returns {phase: {"file": rel_path}}."""
    return write_graphs(graphs, out_dir)


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
