"""Third-party GPU kernels measured beside ours (bench only; nothing here is imported by the compiler).

    flashmla  FlashMLA's sm90 sparse FP8 decode (DeepSeek V3.2 cache layout)      bench/baselines/flashmla.py
    deepgemm  DeepGEMM's sm90 paged FP8 MQA logits (the indexer's scores)           bench/baselines/deepgemm.py
    flashkda  FlashKDA's sm90 chunked KDA forward                                   bench/baselines/flashkda.py
    fla       fla-core 0.6.0's chunk_kda (pure-Python wheel in .whl, git-excluded; needs einops, torch, triton)

Each of the first three is a torch-free shared library in .ext/lib (git-excluded; .ext/build/build_<name>.sh builds
it from sources kept outside the repo), sm_90a code with cudart linked statically (needs glibc >= 2.34; else the copy in
.ext/lib/cudart-shared, which uses the libcudart.so.13 torch loaded), called with ctypes over raw device pointers on
torch's current stream. `unavailable(name)` says why a baseline cannot run (None when it can);
the entry points raise RuntimeError with that reason. Converters from our cache formats (plugins/sparse_mla,
plugins/indexer_topk) to each library's own live beside the entry points; run them once, outside timing.
`bench/baselines/check_gpu.py` compares every baseline with plain torch at small shapes and times the target shapes.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

LIB_DIR = Path(os.environ.get("KIMI_BASELINE_LIB_DIR", Path(__file__).resolve().parents[2] / ".ext" / "lib"))
P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
# exported C functions: name -> (restype, argtypes); the shims in .ext/build/<name>_shim.cu
SIGNATURES = {
    "flashmla": {
        "flashmla_last_error": (ctypes.c_char_p, []),
        "flashmla_sched_meta_ints": (I, []),
        "flashmla_num_sm_parts": (I, [I, I]),
        "flashmla_sparse_decode_plan": (I, [P, P, I, I, I, I, P]),
        "flashmla_sparse_decode": (I, [P] * 9 + [I] * 6 + [L, F, I, P]),
    },
    "deepgemm": {
        "deepgemm_last_error": (ctypes.c_char_p, []),
        "deepgemm_logits_stride": (I, [I]),
        "deepgemm_paged_mqa_logits_metadata": (I, [P, P, I, I, P]),
        "deepgemm_fp8_paged_mqa_logits": (I, [P, P, I, L, P, P, P, I, P, I, P, I, I, P]),
    },
    "flashkda": {
        "flashkda_last_error": (ctypes.c_char_p, []),
        "flashkda_workspace_size": (L, [L, L, L]),
        "flashkda_fwd": (I, [P] * 5 + [F, P, P, P, P, F, P, P, I, P, I, I, I, I, P]),
    },
}


@functools.cache
def _load(name: str) -> tuple[ctypes.CDLL | None, str | None]:
    if name == "fla":
        try:
            import fla.ops.kda  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure is the reason
            return None, f"fla-core does not import ({type(e).__name__}: {e}): install .whl/fla_core-0.6.0-*.whl"
        return None, None
    path = LIB_DIR / f"lib{name}_sm90.so"
    if not path.exists():
        return None, f"{path} is missing: run .ext/build/build_{name}.sh (or carry .ext/lib)"
    try:
        import torch
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            found = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
            return None, f"{name}: needs an sm_90 GPU (H100/H200), found {found}"
        torch.cuda.init()  # loads libcudart.so.13, which the cudart-shared build resolves to
    except ImportError as e:
        return None, f"{name}: needs torch ({e})"
    errors = []
    for candidate in (path, LIB_DIR / "cudart-shared" / path.name):  # cudart static (glibc >= 2.34), then shared
        try:
            lib = ctypes.CDLL(str(candidate))
            break
        except OSError as e:
            errors.append(str(e))
    else:
        return None, f"{path} does not load: {'; '.join(errors)}"
    for fn, (res, args) in SIGNATURES[name].items():
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    return lib, None


def unavailable(name: str) -> str | None:
    """Why baseline `name` (flashmla, deepgemm, flashkda, fla) cannot run here; None when it can."""
    return _load(name)[1]


def lib(name: str) -> ctypes.CDLL:
    handle, reason = _load(name)
    if reason:
        raise RuntimeError(reason)
    return handle


def call(name: str, fn: str, *args) -> None:
    """Calls `fn` of library `name`; raises RuntimeError with the library's message when it returns nonzero."""
    handle = lib(name)
    if getattr(handle, fn)(*args) != 0:
        raise RuntimeError(f"{fn}: {getattr(handle, f'{name}_last_error')().decode()}")


def ptr(t) -> int | None:
    return None if t is None else t.data_ptr()


def stream() -> int:
    import torch
    return torch.cuda.current_stream().cuda_stream


from .deepgemm import deepgemm_paged_mqa_logits, deepgemm_plan, to_deepgemm_cache, to_deepgemm_q  # noqa: E402
from .flashkda import flashkda_prefill  # noqa: E402
from .flashmla import flashmla_plan, flashmla_sparse_decode, to_flashmla_cache, to_flashmla_indices  # noqa: E402

__all__ = ["unavailable", "flashmla_plan", "flashmla_sparse_decode", "to_flashmla_cache", "to_flashmla_indices",
           "deepgemm_plan", "deepgemm_paged_mqa_logits", "to_deepgemm_cache", "to_deepgemm_q", "flashkda_prefill"]
