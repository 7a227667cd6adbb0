"""Fused ops, one per folder (installed as kimi_compile.plugins)."""

import functools


@functools.cache
def num_sms(device) -> int:
    """The SM count of a CUDA device, which the Triton kernels' launch shapes follow; 132 (an H100's / H200's) for a
    CPU device, where Triton's interpreter runs the kernels on CPU tensors, so tests take the GPU's launch shapes.
    Cached per device: the kernels' hosts ask at every launch."""
    import torch  # here, not at the top: importing the plugins package must not need torch

    device = torch.device(device)
    return 132 if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count
