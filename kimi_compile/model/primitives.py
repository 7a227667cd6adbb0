"""The only `kimi::` primitives of the reference model: what tracing cannot express faithfully as plain ops.

- `kimi::kda_recurrence`: the gated delta rule over a dynamic number of steps (chunked or recurrent form).
- `kimi::paged_write` / `kimi::paged_gather`: writes to and reads from a paged cache pool through slots / a block
  table. Functional: `paged_write` returns the updated pool (backends that can alias do it in place).

Each is a `torch.library.custom_op` with a fake impl, so torch.export keeps it as one node; trace.py turns each into a
single `kimi.*` ONNX node whose function body lives in plugins/.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 at least; fp64 stays fp64 (used to separate rounding from real differences in tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---- the gated delta rule -----------------------------------------------------------------------------------------


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Per-step gated delta rule (FLA `naive_recurrent_kda` semantics), fp32.

    q, k [B,T,H,K] (q already scaled), v [B,T,H,V], g [B,T,H,K] log-decay, beta [B,T,H], state [B,H,K,V].
    Per step: S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t.
    """
    dtype = v.dtype
    cd = _compute_dtype(v)
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))
    S = state.to(cd).clone()
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)
        kt = k[:, t]
        delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt * beta[:, t].unsqueeze(-1), delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o.to(dtype), S


def kda_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """Chunkwise (WY / UT transform) form of `kda_recurrent`; same inputs, same results up to rounding.

    T need not be a multiple of `chunk_size`: the tail is padded with steps that leave the state unchanged
    (k = v = q = 0, g = 0, beta = 0) and the padded outputs are dropped.
    """
    dtype = v.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C) if T else 0
    pad = N * C - T

    cd = _compute_dtype(v)

    def prep(x: Tensor) -> Tensor:
        x = x.to(cd)
        if pad:
            x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
        # [B, N*C, H, ...] -> [B, H, N, C, ...]
        return x.reshape(B, N, C, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    q, k, v, g, beta = (prep(x) for x in (q, k, v, g, beta))
    g = g.cumsum(-2)  # within each chunk
    strict_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
    # decay between positions c >= i inside a chunk, [.., C(c), C(i), K]; clamped to <= 0 (exact where used)
    gdiff = (g.unsqueeze(-2) - g.unsqueeze(-3)).clamp(max=0.0)
    Akk = torch.einsum("...ck,...cik,...ik->...ci", k, gdiff.exp(), k) * beta.unsqueeze(-1)
    A = -Akk.masked_fill(~strict_lower, 0.0)
    for i in range(1, C):  # forward substitution: (I + L)^-1
        A[..., i, :i] = A[..., i, :i] + (A[..., i, :, None] * A[..., :, :i]).sum(-2)
    A = (A + torch.eye(C, dtype=cd, device=q.device)) * beta.unsqueeze(-2)
    w = A @ (g.exp() * k)
    u = A @ v
    Aqk = torch.einsum("...ck,...cik,...ik->...ci", q, gdiff.exp(), k).masked_fill(~lower, 0.0)

    S = state.to(cd).clone()
    o = torch.empty(B, H, N, C, V, dtype=cd, device=q.device)
    for n in range(N):
        gn = g[:, :, n]
        v_new = u[:, :, n] - w[:, :, n] @ S
        o[:, :, n] = (q[:, :, n] * gn.exp()) @ S + Aqk[:, :, n] @ v_new
        g_last = gn[:, :, -1]
        S = S * g_last.exp().unsqueeze(-1) + ((g_last.unsqueeze(-2) - gn).exp() * k[:, :, n]).transpose(-1, -2) @ v_new
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T] if N else v.new_zeros(B, 0, H, V, dtype=cd)
    return o.to(dtype), S


@torch.library.custom_op("kimi::kda_recurrence", mutates_args=())
def kda_recurrence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over T steps; chunk_size > 0 selects the chunked form, 0 the recurrent one."""
    if chunk_size > 0 and q.shape[1] > 1:
        o, s = kda_chunked(q, k, v, g, beta, state, chunk_size)
    else:
        o, s = kda_recurrent(q, k, v, g, beta, state)
    return o.contiguous(), s.to(state.dtype).contiguous()


@kda_recurrence.register_fake
def _(q, k, v, g, beta, state, chunk_size):
    return v.new_empty(v.shape), state.new_empty(state.shape)


# ---- paged caches -------------------------------------------------------------------------------------------------


@torch.library.custom_op("kimi::paged_write", mutates_args=())
def paged_write(pool: Tensor, slots: Tensor, values: Tensor) -> Tensor:
    """pool [NB, BS, D] with rows `slots` (flat index block*BS + row, int64 [N]) set to values [N, D].

    Slot 0 (block 0) is the null block: padding tokens write there and no sequence owns it.
    """
    out = pool.clone()
    out.view(-1, pool.shape[-1]).index_copy_(0, slots.reshape(-1), values.reshape(-1, pool.shape[-1]).to(pool.dtype))
    return out


@paged_write.register_fake
def _(pool, slots, values):
    return pool.new_empty(pool.shape)


@torch.library.custom_op("kimi::paged_gather", mutates_args=())
def paged_gather(pool: Tensor, block_table: Tensor) -> Tensor:
    """pool [NB, BS, D], block_table [B, MB] -> [B, MB*BS, D]: row s of sequence b is position s of that sequence."""
    B, MB = block_table.shape
    return pool[block_table.reshape(-1)].reshape(B, MB * pool.shape[1], pool.shape[2]).contiguous()


@paged_gather.register_fake
def _(pool, block_table):
    B, MB = block_table.shape
    return pool.new_empty(B, MB * pool.shape[1], pool.shape[2])
