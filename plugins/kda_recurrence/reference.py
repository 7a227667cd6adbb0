"""kimi.KDARecurrence: the oracle is the reference model's torch recurrences (kimi_compile.model.primitives: the
recurrent form, or the chunked form when chunk_size > 0), on numpy inputs; outputs (o, final_state) as numpy."""

from __future__ import annotations


def kda_recurrence(q, k, v, g, beta, state, chunk_size=0):
    import torch

    from kimi_compile.model.primitives import kda_chunked, kda_recurrent

    args = [torch.as_tensor(x) for x in (q, k, v, g, beta, state)]
    o, s = kda_chunked(*args, chunk_size) if chunk_size else kda_recurrent(*args)
    return o.numpy(), s.numpy()


# ---- sequence parallelism: a segment's affine state map -----------------------------------------------------------
#
# One step is affine in the state: S_t = M_t S_{t-1} + N_t with M_t = (I - beta_t k_t k_t^T) diag(exp g_t) and
# N_t = beta_t k_t v_t^T. A segment of steps is therefore S_out = A S_in + B (A [Dk, Dk], B [Dk, Dv] per head), and
# [A | B] is the delta rule itself run from the initial state [I | 0] on values [0 | v]: any implementation of the
# recurrence (the chunked kernels included) computes a segment's map with Dk more value columns. Maps compose as
# (A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2); a rank's true initial state is the prefix composition of the maps before
# it applied to the global initial state, from which it replays its segment exactly.


def segment_map(k, g, beta, v, recurrence=None):
    """(A [B, H, Dk, Dk], B [B, H, Dk, Dv]) of a segment: k, g [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H] (torch).
    `recurrence(q, k, v, g, beta, state) -> (o, final_state)` defaults to the reference model's chunked form."""
    import torch

    from kimi_compile.model.primitives import kda_chunked

    run = recurrence or (lambda q_, k_, v_, g_, b_, s_: kda_chunked(q_, k_, v_, g_, b_, s_, 64))
    Bn, T, H, Dk = k.shape
    Dv = v.shape[-1]
    eye = torch.eye(Dk, dtype=torch.float32, device=k.device).expand(Bn, H, Dk, Dk)
    init = torch.cat([eye, torch.zeros(Bn, H, Dk, Dv, dtype=torch.float32, device=k.device)], -1)
    v_aug = torch.cat([torch.zeros(Bn, T, H, Dk, dtype=v.dtype, device=v.device), v], -1)
    _, s = run(torch.zeros_like(k), k, v_aug, g, beta, init)
    return s[..., :Dk], s[..., Dk:]


def compose(later, earlier):
    """The map of `earlier` then `later` (each (A, B))."""
    A2, B2 = later
    A1, B1 = earlier
    return A2 @ A1, A2 @ B1 + B2


def initial_states(maps, s0):
    """The true initial state of every segment: [s0, A0 s0 + B0, ...] from the segments' maps in order."""
    out = [s0]
    for A, B in maps[:-1]:
        out.append(A @ out[-1] + B)
    return out
