"""The runtime: load an artifact, own the paged caches, run prefill/decode, generate tokens.

`load(artifact_dir)` checks the manifest (schema version, every file's sha256) and returns a `Session`. With the ONNX
Runtime backend it needs only numpy, onnxruntime and safetensors: importing it does not import torch.
"""

from kimi_compile.runtime.session import CacheState, Session, load

__all__ = ["CacheState", "Session", "load"]
