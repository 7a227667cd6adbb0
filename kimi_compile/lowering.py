"""The vocabulary of the backend tables that op folders fill (DESIGN.md §3 "Ops"): `Kernel` for the cuda backend
(plugins/<op>/cuda.py: `CUDA = {"Op": Kernel(...)}`) and `Native` / `Plugin` for TensorRT (plugins/<op>/tensorrt.py:
`TENSORRT = {"Op": {flavour: Native(...) | Plugin(...)}}`). Defined here, below the backends, so that op folders
never import a backend; the backends read the tables (`ops.kernels("CUDA")`, backends/tensorrt/lowering.py).
Imports no torch and no tensorrt.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import onnx


_WARNED: set[tuple[str, str]] = set()


def warn_fallback_once(op: str, why: str, fallback: str) -> None:
    """A kernel chosen at build time refused the tensors it got at run time (a shape the build could not see): say so
    once per (op, reason), naming the fallback kernel that runs instead."""
    if (op, why) not in _WARNED:
        _WARNED.add((op, why))
        logging.getLogger("kimi_compile.kernels").warning("%s: the Triton kernel does not apply (%s); running %s",
                                                          op, why, fallback)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One backend implementation of a `kimi.*` op, named in the op folder's backend table (`plugins/<op>/cuda.py`:
    `CUDA = {"OpName": Kernel(...)}`), the same pattern as the TensorRT tables.

    run(inputs, attrs) -> tuple of outputs: torch tensors in the op's input order (None for an absent optional
        input), attributes by name; outputs in the op's output order.
    supports(inputs, attrs) -> None when the kernel applies to these shapes/dtypes/attributes, else the reason (the
        backend then runs the op's reference and lists the node with that reason in its GPU coverage report).
    devices: where `run` works ("cuda" for Triton kernels; torch-composed kernels run on "cpu" too).
    inplace: {output index: input index} pairs the kernel writes in place (a cache updated where it lives).
    fallback: the op's one other kernel, used where this one does not apply (before the reference).
    out: `run` also takes `out=`, a tuple with each output's planned slot in the executor's arena (None where none
        is planned), and writes the outputs it can into them, returning those slots: the executor then copies
        nothing for them (it copies any other tensor returned into its slot, so a kernel may decline per call).
    min_capability: the least CUDA compute capability `run` works on (for example (8, 9): Triton's float8e4nv
        conversions); on an older GPU (or a build whose target names one) the fallback runs, with that reason.
    """

    run: Callable[..., Any]
    supports: Callable[..., str | None] | None = None
    devices: tuple[str, ...] = ("cuda",)
    inplace: dict = dataclasses.field(default_factory=dict)
    name: str = ""
    fallback: Kernel | None = None
    out: bool = False
    min_capability: tuple[int, int] | None = None


FP8_CAPABILITY = (8, 9)  # Triton's float8e4nv (E4M3) needs sm_89+: Ada, Hopper, Blackwell


def target_capability(target: str | None) -> tuple[int, int] | None:
    """The compute capability a build target names ("sm90" -> (9, 0), "sm89" -> (8, 9), "sm120" -> (12, 0)), or None
    for a target that names none ("cuda", "cpu")."""
    t = (target or "").lower()
    if not (t.startswith("sm") and t[2:].isdigit() and len(t) >= 4):
        return None
    return int(t[2:-1]), int(t[-1])


def capability_reason(kernel: Kernel, capability: tuple[int, int] | None) -> str | None:
    """Why `kernel` cannot run on a GPU of this compute capability (None where it can, or where it is unknown)."""
    need = kernel.min_capability
    if need is None or capability is None or tuple(capability) >= tuple(need):
        return None
    return (f"needs a GPU of compute capability {need[0]}.{need[1]} or newer, this one is "
            f"{capability[0]}.{capability[1]}")


def out_slot(out, i: int, shape, dtype):
    """out[i], the executor's planned slot for output i (Kernel.out), when a result of this shape and dtype can be
    written into it as is (contiguous); else None: the kernel allocates and the executor copies."""
    t = out[i] if out is not None and i < len(out) else None
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
        return None
    return t


# ---- TensorRT -------------------------------------------------------------------------------------------------

FLAVOURS = ("tensorrt", "tensorrt_rtx")
NAMESPACE = "kimi"


class LoweringError(RuntimeError):
    """A kimi node cannot be lowered for TensorRT; the message names the node, the op and what to change."""


@dataclasses.dataclass(frozen=True)
class Native:
    """Inline the op's ONNX function body: the parser builds native TensorRT layers. `rewrite(call, body) -> body`
    adapts the inlined body to TensorRT where the standard-op body uses what TensorRT refuses (e.g. FP8 Casts ->
    explicit Q/DQ); bump `version` when it changes."""

    reason: str
    version: int = 1
    rewrite: Callable[[onnx.NodeProto, list[onnx.NodeProto]], list[onnx.NodeProto]] | None = \
        dataclasses.field(default=None, compare=False)
    kind: str = "native"


PLUGIN_STATUSES = ("planned", "available")
PLANNED = "planned (not implemented)"


@dataclasses.dataclass(frozen=True)
class Plugin:
    """Keep one node for an IPluginV3 creator `kimi::<name>` (AOT form when `aot`); `otherwise` when unregistered.
    `status` "planned": no implementation ships with this project yet (see the module docstring)."""

    name: str
    reason: str
    otherwise: Native
    plugin_version: str = "1"
    aot: bool = True
    version: int = 1
    kind: str = "plugin"
    status: str = "planned"

    def __post_init__(self):
        if self.status not in PLUGIN_STATUSES:
            raise LoweringError(f"Plugin {self.name}: status must be one of {PLUGIN_STATUSES}, got {self.status!r}")

    @property
    def shown_status(self) -> str:
        return PLANNED if self.status == "planned" else self.status


Lowering = Native | Plugin
DEFAULT = Native("no TensorRT lowering in the op's folder: its ONNX function body is inlined (native layers)")
