"""The oracle of the context-parallel KDA ops (torch; the cuda kernels are these functions): a rank's rows are its
pieces of each sequence (kimi_compile/cp_layout.py), the gathered inputs hold every rank's pieces in rank order.

    conv windows   a piece's true initial conv window is its sequence's window before the prefill advanced by the
                   pre-conv inputs u of every earlier chunk: the last W-1 rows of [window ‖ tail_0 ‖ tail_1 ‖ ...]
                   where tail_c holds chunk c's last min(len_c, W-1) rows of u (conv_tail)
    states         chunk c's affine map S -> A_c S + B_c (plugins/kda_recurrence/reference.py segment_map, computed
                   from the chunk's true conv window: segment_map_op); the true initial state of chunk c is the maps
                   of chunks < c applied in order to the sequence's state before the prefill (initial_states)
    replay         each piece runs the KDA layer (plugins/kda/cuda.py) from its true window and state: its outputs
                   equal the sequential layer's to fp32 rounding; the new conv window and state are the sequence's
                   (after its last chunk), the same on every rank and every piece row of that sequence
"""

from __future__ import annotations

import numpy as np

from kimi_compile import cp_layout


def _layout(rows: int, a: dict) -> tuple[int, list[list[int]], tuple[int, ...]]:
    world, layout, rank = int(a["world"]), str(a["layout"]), int(a["rank"])
    per = cp_layout.pieces_per_rank(world, layout)
    if rows % per:
        raise ValueError(f"kimi.KDA context parallel: {rows} rows are not {per} pieces per sequence ({layout})")
    batch = rows // per
    return batch, cp_layout.gathered_order(world, layout, batch), cp_layout.rank_chunks(world, layout, rank)


def conv_tail(x, lengths, w_q, w_k, w_v, width: int):
    """x [R, T, hidden] -> [R, W-1, 3P]: the last W-1 rows of [zeros(W-1) ‖ u[:lengths]] (u = x @ w_{q,k,v})."""
    import torch

    R, T, _ = x.shape
    u = torch.cat([x @ w_q.to(x.dtype), x @ w_k.to(x.dtype), x @ w_v.to(x.dtype)], -1)
    cat = torch.cat([torch.zeros(R, width - 1, u.shape[-1], dtype=u.dtype, device=u.device), u], 1)
    rows = lengths.reshape(R, 1) + torch.arange(width - 1, device=x.device).reshape(1, width - 1)
    return torch.gather(cat, 1, rows.unsqueeze(-1).expand(R, width - 1, u.shape[-1]))


def windows(conv_state, tails, lengths_all, a: dict):
    """(true initial window of every local row, its sequence's window after the prefill), each [R, W-1, C]."""
    import torch

    R, Wm1 = conv_state.shape[0], conv_state.shape[1]
    batch, order, mine = _layout(R, a)
    init, final = torch.empty_like(conv_state), torch.empty_like(conv_state)
    lens = [int(n) for n in lengths_all.tolist()]
    for b in range(batch):
        win, starts = conv_state[b], []
        for i in order[b]:
            starts.append(win)
            m = min(lens[i], Wm1)
            if m:
                win = torch.cat([win, tails[i, Wm1 - m:].to(win.dtype)])[-Wm1:]
        for j, c in enumerate(mine):
            init[j * batch + b], final[j * batch + b] = starts[c], win
    return init, final


def states(state, maps, a: dict):
    """(true initial state of every local row, its sequence's state after the prefill), each [R, H, Dk, Dv];
    maps [P*R, H, Dk, Dk + Dv] = [A | B] of every piece."""
    import torch

    from kimi_compile.plugins.kda_recurrence.reference import initial_states

    R, Dk = state.shape[0], state.shape[2]
    batch, order, mine = _layout(R, a)
    init, final = torch.empty_like(state), torch.empty_like(state)
    for b in range(batch):
        seq = [(maps[i, ..., :Dk].float(), maps[i, ..., Dk:].float()) for i in order[b]]
        starts = initial_states(seq, state[b].float())
        A, B = seq[-1]
        end = A @ starts[-1] + B
        for j, c in enumerate(mine):
            init[j * batch + b], final[j * batch + b] = starts[c], end
    return init, final


def _valid_only(x, lengths):
    """x with its padding rows (t >= lengths) zeroed: whatever upstream ops left there (an empty piece's rows) must
    not reach a map or a state through 0 * inf."""
    import torch

    T = x.shape[1]
    valid = torch.arange(T, device=x.device).reshape(1, T) < lengths.reshape(-1, 1)
    return torch.where(valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def segment_map_op(x, conv_state, lengths, tails, lengths_all, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b,
                   w_b, A_log, dt_bias, a: dict, recurrence=None):
    """[A | B] [R, H, Dk, Dk + Dv] of every local piece, from its true conv window. `recurrence` runs the delta rule
    over the augmented state (plugins/kda_recurrence/reference.py segment_map): None = the reference model's chunked
    form in float32; a kernel (the GPU's chunk_kda) takes k and v in the layer's compute dtype, as the replay does."""
    import torch

    from kimi_compile.plugins.kda.cuda import prepare
    from kimi_compile.plugins.kda_recurrence.reference import segment_map

    win, _ = windows(conv_state, tails, lengths_all, a)
    x = _valid_only(x, lengths)
    q, k, v, g, beta = prepare(x, win, lengths, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b, w_b, A_log,
                               dt_bias, a)
    dt = torch.float32 if recurrence is None else v.dtype
    A, B = segment_map(k.to(dt), g.float(), beta.float(), v.to(dt), recurrence)
    return torch.cat([A, B], -1)


def replay(x, conv_state, state, lengths, tails, lengths_all, maps, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a,
           w_f_b, w_b, w_g, A_log, dt_bias, o_norm, w_o, a: dict):
    """(out [R, T, hidden], the sequence's new conv window, the sequence's new state) per local row."""
    from kimi_compile.plugins.kda.cuda import kda

    win, win_end = windows(conv_state, tails, lengths_all, a)
    s_in, s_end = states(state, maps, a)
    out, _, _ = kda((_valid_only(x, lengths), win, s_in.contiguous(), lengths, w_q, w_k, w_v, conv_q, conv_k, conv_v,
                     w_f_a, w_f_b, w_b, w_g, A_log, dt_bias, o_norm, w_o), a)
    return out, win_end, s_end


# ---- numpy entry points (the registered references): the torch functions on host tensors -------------------------

def _torch(args):
    import torch

    return [torch.as_tensor(np.asarray(v)) for v in args]


def kda_conv_tail(x, lengths, w_q, w_k, w_v, conv_q, **a):
    return conv_tail(*_torch([x, lengths, w_q, w_k, w_v]), np.shape(conv_q)[-1]).numpy()


def kda_segment_map(x, conv_state, lengths, tails, lengths_all, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b,
                    w_b, A_log, dt_bias, **a):
    return segment_map_op(*_torch([x, conv_state, lengths, tails, lengths_all, w_q, w_k, w_v, conv_q, conv_k, conv_v,
                                   w_f_a, w_f_b, w_b, A_log, dt_bias]), a).numpy()


def kda_segment_replay(x, conv_state, state, lengths, tails, lengths_all, maps, w_q, w_k, w_v, conv_q, conv_k, conv_v,
                       w_f_a, w_f_b, w_b, w_g, A_log, dt_bias, o_norm, w_o, **a):
    outs = replay(*_torch([x, conv_state, state, lengths, tails, lengths_all, maps, w_q, w_k, w_v, conv_q, conv_k,
                           conv_v, w_f_a, w_f_b, w_b, w_g, A_log, dt_bias, o_norm, w_o]), a)
    return tuple(o.numpy() for o in outs)
