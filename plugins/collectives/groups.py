"""Process groups by name, filled by whoever starts the ranks (backends/cuda/distributed.py) and read by the
collective kernels: a node's `group` attribute names one ("tp"); a name not registered means the default group.
Holds torch.distributed objects without importing torch."""

from __future__ import annotations

from typing import Any

_GROUPS: dict[str, Any] = {}


def register(name: str, group: Any) -> None:
    _GROUPS[name] = group


def get(name: str) -> Any:
    """The process group named `name`, or None (torch.distributed's default group)."""
    return _GROUPS.get(name)


def clear() -> None:
    _GROUPS.clear()
