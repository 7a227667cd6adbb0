"""Backends: `build(graphs, out_dir, options) -> record` writes engine files; `load(artifact_dir, manifest)` runs them.

Looked up by name; a backend module imports its heavy dependencies lazily so the core never needs them.
"""

from __future__ import annotations

import importlib

BACKENDS = {"onnxruntime": "kimi_compile.backends.onnxruntime", "cuda": "kimi_compile.backends.cuda",
            "tensorrt": "kimi_compile.backends.tensorrt"}


class BackendError(RuntimeError):
    pass


def get(name: str):
    if name not in BACKENDS:
        raise BackendError(f"backend {name!r} is not available here; known backends: {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
