import pytest
import torch

from kimi_compile.config import preset
from kimi_compile.model.weights import build_model, init_random


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="session")
def tiny_models():
    """Seeded random fp32 models of the two tiny presets."""
    return {name: init_random(build_model(preset(name)), seed=3) for name in ("kimi-k3-tiny", "kimi-k3.1-tiny")}
