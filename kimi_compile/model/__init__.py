"""The PyTorch reference model of Kimi K3 / K3.1: the numerical oracle every compiled result is judged against."""

from kimi_compile.model.model import KimiCache, KimiK3ForCausalLM, LayerCache
from kimi_compile.model.weights import (
    CheckpointError,
    build_model,
    load_pretrained,
    random_checkpoint,
    save_pretrained,
)

__all__ = [
    "CheckpointError",
    "KimiCache",
    "KimiK3ForCausalLM",
    "LayerCache",
    "build_model",
    "load_pretrained",
    "random_checkpoint",
    "save_pretrained",
]
