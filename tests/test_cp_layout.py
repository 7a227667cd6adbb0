"""The context-parallel token layouts (kimi_compile/cp_layout.py): split then restore is the identity for any length
(ragged, shorter than the number of chunks, empty), zigzag gives rank r chunks r and 2P-1-r, the gathered rows are
found in sequence order, and zigzag balances causal work where contiguous does not."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_compile import cp_layout

layouts = st.sampled_from(cp_layout.LAYOUTS)


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 300), world=st.integers(1, 8), layout=layouts)
def test_split_then_restore_is_the_identity(length, world, layout):
    seq = list(range(length))
    parts = cp_layout.split(seq, world, layout)
    assert len(parts) == world and all(len(p) == cp_layout.pieces_per_rank(world, layout) for p in parts)
    assert cp_layout.restore(parts, world, layout) == seq
    sizes = [b - a for a, b in cp_layout.bounds(length, world, layout)]
    assert sum(sizes) == length and max(sizes) - min(sizes) <= 1  # near-equal chunks for any length
    assert length == 0 or sizes[0] > 0  # the piece at position 0 is never empty


@settings(max_examples=100, deadline=None)
@given(world=st.integers(1, 8), layout=layouts, batch=st.integers(1, 5))
def test_gathered_order_finds_every_chunk(world, layout, batch):
    """Rows gathered in rank order (rank q's local row j*B + b at q*R + j*B + b) hold each sequence's chunks in
    order: build the gathered list of (sequence, chunk) labels and read it back."""
    R = cp_layout.pieces_per_rank(world, layout) * batch
    gathered = [None] * (world * R)
    for q in range(world):
        for j, c in enumerate(cp_layout.rank_chunks(world, layout, q)):
            for b in range(batch):
                gathered[q * R + j * batch + b] = (b, c)
    order = cp_layout.gathered_order(world, layout, batch)
    n = cp_layout.chunks(world, layout)
    assert [[gathered[i] for i in rows] for rows in order] == [[(b, c) for c in range(n)] for b in range(batch)]


def test_zigzag_rank_chunks():
    assert [cp_layout.rank_chunks(4, "zigzag", r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [cp_layout.rank_chunks(2, "contiguous", r) for r in range(2)] == [(0,), (1,)]
    assert cp_layout.split(list(range(7)), 2, "zigzag") == [[[0, 1], [6]], [[2, 3], [4, 5]]]
    assert cp_layout.bounds(3, 2, "zigzag") == [(0, 1), (1, 2), (2, 3), (3, 3)]  # empty chunks last


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work(world):
    """Causal attention work of a token at position t is t + 1 keys: max/mean over ranks near 1 for zigzag, near
    (2P-1)/P for contiguous."""
    L = 4096

    def imbalance(layout):
        work = [sum(sum(t + 1 for t in piece) for piece in parts)
                for parts in cp_layout.split(list(range(L)), world, layout)]
        return max(work) / (sum(work) / world)

    assert imbalance("zigzag") < 1.001
    assert abs(imbalance("contiguous") - (2 * world - 1) / world) < 0.01


def test_bad_layout_names_the_recipe_key():
    with pytest.raises(ValueError, match="parallel.cp_layout"):
        cp_layout.chunks(2, "ring")


def test_balance_table_at_full_size():
    """Per-rank indexer + sparse-attention FLOPs of kimi-k3.1-pro (docs/context_parallel.md's table): zigzag near
    1.0 at every length; contiguous approaches (2P-1)/P as the O(L^2) indexer dominates (1M tokens)."""
    from kimi_compile.config import preset

    rows = {(r["tokens"], r["cp"], r["layout"]): r for r in cp_layout.balance_table(preset("kimi-k3.1-pro"))}
    assert len(rows) == 3 * 3 * 2
    for (L, P, layout), r in rows.items():
        if layout == "zigzag":
            assert r["max_over_mean"] < (1.03 if L == 32768 else 1.003)
        else:
            assert 1.2 < r["max_over_mean"] < (2 * P - 1) / P
    for P in (2, 4, 8):
        assert abs(rows[(1048576, P, "contiguous")]["max_over_mean"] - (2 * P - 1) / P) < 0.05
    per = cp_layout.prefill_flops(preset("kimi-k3.1-pro"), 1000, 2, "zigzag")
    assert sum(r["tokens"] for r in per) == 1000
