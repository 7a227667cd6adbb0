"""Spawning the ranks of a partitioned artifact in tests: one process per rank (torch.multiprocessing, spawn),
joined over gloo on a free local port."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, world: int, paths: list[str]) -> dict:
    """{rank: what worker(rank, world, port, paths, queue) put on the queue as (rank, out, error)}, after every rank
    finished; the ranks' errors, if any, fail the test together."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, paths, q)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in procs:
        rank, out, err = q.get(timeout=900)
        results[rank] = out
        if err:
            errors.append(err)
    for p in procs:
        p.join(timeout=60)
    assert not errors, "\n".join(errors)
    return results
