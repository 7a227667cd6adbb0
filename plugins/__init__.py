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


def wgmma_reason(capability: tuple[int, int], what: str) -> str | None:
    """Why a kernel built on Hopper's warpgroup MMA (the Gluon kernels' `warpgroup_mma`) cannot run on a GPU of this
    compute capability, or None on Hopper (sm_90). Blackwell (sm_100, sm_120) has no wgmma: compiling such a kernel
    there aborts the process in LLVM ("Cannot select: intrinsic %llvm.nvvm.wgmma..."), so it must not be chosen."""
    if capability[0] == 9:
        return None
    return (f"{what} uses Hopper's warpgroup MMA (sm_90), which this GPU (sm_{capability[0]}{capability[1]}) does not "
            "have")
