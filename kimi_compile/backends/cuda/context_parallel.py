"""The cuda executor's side of a context-parallel prefill (passes/partition_cp.py, docs/context_parallel.md): the
session's ragged prefill step ([B, T] token ids, start, lengths, block table, caches) becomes this rank's pieces
(kimi_compile/cp_layout.py: row j*B + b holds sequence b's chunk rank_chunks(rank)[j], with the chunk's global start,
its length and the sequence's block-table row; KDA conv / state rows repeat the sequence's), the rank graph runs, and
the results come back in the session's shapes: `logits_last` [B, vocab], the logits of each sequence's last token
(the graph runs the LM head on each piece's last token only and all-gathers those rows; the piece that holds the
sequence's end gives them), per-sequence caches from the first piece row of each sequence (every piece row holds
its sequence's state after the prefill), paged pools as written (whole, identical on every rank)."""

from __future__ import annotations

from kimi_compile import cp_layout


def run_prefill(ex, feeds: dict) -> dict:
    """One prefill step of a context-parallel artifact on rank `ex.rank` (feeds: tensors on its device)."""
    torch = ex.torch
    par = ex.manifest["parallel"]
    world, layout = int(par["cp"]), str(par.get("cp_layout", "zigzag"))
    rank = int(ex.rank) // int(par.get("tp", 1))  # world rank = cp index * tp + tp index
    ids = feeds["input_ids"]
    start = feeds["start"]
    lengths = feeds["lengths"]
    B, T = ids.shape
    lens, starts = [int(n) for n in lengths.tolist()], [int(s) for s in start.tolist()]
    bounds = [cp_layout.bounds(n, world, layout) for n in lens]
    Tl = max([2] + [e - a for bs in bounds for a, e in bs])  # the prefill graph's minimum is 2 rows
    mine = cp_layout.rank_chunks(world, layout, rank)
    rows = len(mine) * B
    ids_l = torch.zeros((rows, Tl), dtype=ids.dtype, device=ids.device)
    start_l = torch.zeros(rows, dtype=start.dtype, device=ids.device)
    len_l = torch.zeros(rows, dtype=lengths.dtype, device=ids.device)
    for j, c in enumerate(mine):
        for b in range(B):
            a, e = bounds[b][c]
            ids_l[j * B + b, : e - a] = ids[b, a:e]
            start_l[j * B + b], len_l[j * B + b] = starts[b] + a, e - a
    seq = torch.arange(B, device=ids.device).repeat(len(mine))  # row -> its sequence
    per_row = {c["name"] for c in ex.manifest["runtime"]["caches"] if c["shape"] and c["shape"][0] == "batch"}
    dev = {"input_ids": ids_l, "start": start_l, "lengths": len_l,
           "block_table": feeds["block_table"].index_select(0, seq)}
    for name, v in feeds.items():
        if name not in dev:
            dev[name] = v.index_select(0, seq) if name in per_row else v
    out = ex.program("prefill").run(dev, plan=ex.plan, graphs=False)
    gathered = out["logits_last"]  # [world * rows, 1, vocab]: each piece row's last token, every rank's in order
    last = torch.zeros((B, gathered.shape[-1]), dtype=gathered.dtype, device=gathered.device)
    for q in range(world):
        for j, c in enumerate(cp_layout.rank_chunks(world, layout, q)):
            for b in range(B):
                a, e = bounds[b][c]
                if a < e == lens[b]:  # this piece holds the sequence's last token
                    last[b] = gathered[q * rows + j * B + b, 0]
    res = {k: v for k, v in out.items() if k != "logits_last"}
    res["logits_last"] = last
    for name in per_row:
        res[name + ".out"] = out[name + ".out"][:B]  # rows j = 0: every piece row holds the sequence's new state
    return res
