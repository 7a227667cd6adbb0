"""Where the tokens of a context-parallel prefill live (DESIGN.md §3 "Parallelism", docs/context_parallel.md).

A sequence of L new tokens is cut into `chunks(world, layout)` contiguous chunks of near-equal size (chunk i holds
tokens [ceil(i*L/n), ceil((i+1)*L/n)): sizes differ by at most one, any L; when L < n the empty chunks are the last
ones, so a piece that starts the sequence is never empty: every piece row has at least one key to attend). Rank r
holds
`rank_chunks(world, layout, r)`:

    zigzag      2P chunks; rank r holds chunk r and chunk 2P-1-r (an early and a late chunk: under a causal mask
                every rank attends over about the same number of keys)
    contiguous  P chunks; rank r holds chunk r (for comparison: the last rank does about (2P-1)/P of the mean work)

A rank's rows are its pieces, piece-major: local row j*B + b is sequence b's chunk rank_chunks(...)[j]. Gathered
across the ranks in rank order (kimi.AllGather on axis 0), row q*R + j*B + b (R = rows per rank) is rank q's piece;
`gathered_order` lists, per sequence, those rows in chunk order. `split` then `restore` is the identity.
`prefill_flops` / `balance_table`: the per-rank causal indexer + attention work each layout gives (a model).
"""

from __future__ import annotations

from collections.abc import Sequence

LAYOUTS = ("zigzag", "contiguous")


def _check(world: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"parallel.cp_layout: expected one of {LAYOUTS}, got {layout!r}")
    if world < 1:
        raise ValueError(f"parallel.cp: expected a positive number of ranks, got {world}")


def chunks(world: int, layout: str) -> int:
    """How many chunks a sequence is cut into."""
    _check(world, layout)
    return 2 * world if layout == "zigzag" else world


def bounds(length: int, world: int, layout: str) -> list[tuple[int, int]]:
    """[(start, stop)] of every chunk of a sequence of `length` tokens, in sequence order."""
    n = chunks(world, layout)
    return [(-(-i * length // n), -(-(i + 1) * length // n)) for i in range(n)]


def rank_chunks(world: int, layout: str, rank: int) -> tuple[int, ...]:
    """The chunks rank `rank` holds, in its piece order."""
    _check(world, layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside cp={world}")
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def pieces_per_rank(world: int, layout: str) -> int:
    return len(rank_chunks(world, layout, 0))


def gathered_order(world: int, layout: str, batch: int) -> list[list[int]]:
    """Per sequence b (of `batch` per rank), the rows of the all-gathered piece tensor that hold its chunks 0, 1, ...
    in sequence order (rows per rank: pieces_per_rank * batch)."""
    npieces = pieces_per_rank(world, layout)
    R = npieces * batch
    where = {}
    for q in range(world):
        for j, c in enumerate(rank_chunks(world, layout, q)):
            where[c] = (q, j)
    return [[where[c][0] * R + where[c][1] * batch + b for c in range(chunks(world, layout))] for b in range(batch)]


def split(seq: Sequence, world: int, layout: str) -> list[list]:
    """The pieces of one sequence per rank: out[r][j] = seq[chunk rank_chunks(r)[j]] (slices of `seq`)."""
    bs = bounds(len(seq), world, layout)
    return [[seq[bs[c][0]:bs[c][1]] for c in rank_chunks(world, layout, r)] for r in range(world)]


def restore(pieces: Sequence[Sequence], world: int, layout: str) -> list:
    """The inverse of `split`: the sequence from every rank's pieces (as a list of items)."""
    by_chunk = {}
    for r in range(world):
        for j, c in enumerate(rank_chunks(world, layout, r)):
            by_chunk[c] = pieces[r][j]
    out: list = []
    for c in range(chunks(world, layout)):
        out.extend(list(by_chunk[c]))
    return out


def _keys(a: int, e: int, cap: int | None) -> int:
    """Sum over positions t in [a, e) of the keys a causal query at t reads: t + 1, or min(t + 1, cap)."""
    def upto(n: int) -> int:  # sum_{t < n} min(t + 1, cap)
        if cap is None or n <= cap:
            return n * (n + 1) // 2
        return cap * (cap + 1) // 2 + (n - cap) * cap
    return upto(e) - upto(a)


def prefill_flops(cfg, length: int, world: int, layout: str) -> list[dict]:
    """Per rank: indexer and sparse-attention FLOPs of one sequence of `length` tokens over the MLA layers of `cfg`
    (a KimiConfig), under the causal mask (the indexer scores every earlier key: 2 * index_n_heads *
    index_head_dim per key; the sparse attention reads min(t + 1, index_topk) latent keys: 2 * 2 * heads *
    (kv_lora_rank + qk_rope_head_dim) per key, scores and values). A token-count model of the graphs' dominant
    terms, not a measurement; projections and MoE are token-wise and split evenly by any layout."""
    mla = cfg.num_hidden_layers - len(cfg.kda_layer_ids or [])
    idx = 2 * cfg.index_n_heads * cfg.index_head_dim * mla if cfg.index_topk is not None else 0  # K3: dense MLA
    att = 4 * cfg.num_attention_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * mla
    bs = bounds(length, world, layout)
    out = []
    for r in range(world):
        mine = [bs[c] for c in rank_chunks(world, layout, r)]
        out.append({"rank": r, "tokens": sum(e - a for a, e in mine),
                    "indexer": idx * sum(_keys(a, e, None) for a, e in mine),
                    "attention": att * sum(_keys(a, e, cfg.index_topk) for a, e in mine)})
    return out


def balance_table(cfg, lengths=(32768, 131072, 1048576), worlds=(2, 4, 8)) -> list[dict]:
    """max/mean over ranks of indexer + attention FLOPs, per (length, cp, layout)."""
    rows = []
    for L in lengths:
        for P in worlds:
            for layout in LAYOUTS:
                per = [r["indexer"] + r["attention"] for r in prefill_flops(cfg, L, P, layout)]
                rows.append({"tokens": L, "cp": P, "layout": layout, "max_tflop": max(per) / 1e12,
                             "mean_tflop": sum(per) / len(per) / 1e12, "max_over_mean": max(per) / (sum(per) / P)})
    return rows
