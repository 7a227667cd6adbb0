"""Starting the ranks of a partitioned artifact over torch.distributed (DESIGN.md §3 "Parallelism"): one process per
rank, launched by torchrun (`torchrun --nproc-per-node N -m kimi_compile run ARTIFACT ...`) or by anything that
sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (tests spawn them with torch.multiprocessing). gloo on CPU, NCCL
on GPU; no home-made transport.

    rank, device = init(manifest)       # joins (or reuses) the process group, registers the artifact's groups
    Executor(artifact, manifest, rank=rank, device=device)

The manifest's `parallel.groups` names the process groups its collectives use ("tp": the ranks that split one
model's heads; tp x cp layouts have one tp group per cp index). Every rank creates every group, in one order, as
torch.distributed requires; the collectives' kernels (plugins/collectives/cuda.py) find theirs by name.
"""

from __future__ import annotations

import atexit
import os

from kimi_compile.plugins.collectives import groups


class LaunchError(RuntimeError):
    """The ranks were not started the way the artifact needs; the message says how to start them."""


def init(manifest: dict, *, backend: str | None = None) -> tuple[int, str]:
    """Join the artifact's process group (initializing torch.distributed from the environment if no one has) and
    register its named groups. Returns (this process's rank, the device it runs on: cuda:<local rank> or cpu)."""
    import torch
    import torch.distributed as dist

    par = manifest.get("parallel") or {}
    world = int(par.get("world", 1))
    how = f"torchrun --nproc-per-node {world} -m kimi_compile run ARTIFACT ..."
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise LaunchError(f"this artifact is partitioned for {world} ranks (parallel: tp={par.get('tp')}, "
                              f"ep={par.get('ep')}): start one process per rank, e.g. `{how}` "
                              f"({', '.join(missing)} not set)")
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
        backend = backend or ("nccl" if cuda else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend)
        atexit.register(_shutdown)
    if dist.get_world_size() != world:
        raise LaunchError(f"this artifact is partitioned for {world} ranks, the process group has "
                          f"{dist.get_world_size()}: `{how}`")
    rank = dist.get_rank()
    groups.clear()
    for name, members in (par.get("groups") or {}).items():
        for ranks in members:  # every rank creates every group, in order
            g = None if len(ranks) == world else dist.new_group(ranks)
            if rank in ranks:
                groups.register(name, g)
    device = "cpu"
    if dist.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    return rank, device


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
