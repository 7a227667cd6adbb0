"""Torch references for the fused lightning indexer (score + ReLU + head weighting + top-k) over a paged MXFP8 cache.

Semantics (MODEL.md "K3.1", optimizations.md §3.1-3.2):
- query row r has q[r] [H_I, D_I] and per-head weights w[r] [H_I] (already scaled);
- the index-K cache is paged: codes [num_blocks, block_size, D_I] uint8 (E4M3FN bytes) and scales
  [num_blocks, block_size, D_I // 32] uint8 (E8M0 bytes, value 2^(b-127)); token p of sequence b lives at
  block block_table[b, p // block_size], row p % block_size;
- score I[r, s] = sum_h w[r, h] * relu(q[r, h] . k[s]) for s < length(r) (decode: length = context_lens[b];
  prefill: causal, length = start_pos + t + 1);
- top-k = min(topk, length) highest scores: indices are token positions within the sequence, padded with -1 (score
  -inf); order is unspecified (compare as sets, up to ties).

`*_ref` functions compute in float64 and are the oracle; `indexer_topk_decode_eager` is the eager unfused bf16
baseline that bench/gpu_kernels.py times (and torch.compile's).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


# ---------------------------------------------------------------- MXFP8 helpers (same rule as plugins/quant/reference.py)
def mxfp8_quantize_ref(x: torch.Tensor, rounding: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D % 32 == 0), finite -> (codes uint8 [..., D], scales uint8 E8M0 [..., D // 32]); exact exponent rule."""
    x = x.float()
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = xb.abs().amax(-1)
    m, ex = torch.frexp(amax.double())  # amax = m * 2^ex, m in [0.5, 1)
    e = ex.long() - 1 - 8
    if rounding == "ceil":
        e = e + (2 * m > 1.75).long()
    elif rounding != "floor":
        raise ValueError(f"rounding must be 'floor' or 'ceil', got {rounding!r}")
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    v = torch.ldexp(xb.double(), -e[..., None].double()).float().clamp(-E4M3_MAX, E4M3_MAX)
    codes = v.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape)
    return codes, (e + 127).to(torch.uint8)


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    return codes.contiguous().view(torch.float8_e4m3fn).float()


def mxfp8_dequantize_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., D], scales uint8 [..., D // 32] -> float64 [..., D]."""
    v = e4m3_to_float(codes).double()
    s = torch.ldexp(torch.ones_like(scales, dtype=torch.float64), scales.long().double() - 127)
    return (v.reshape(*v.shape[:-1], -1, 32) * s[..., None]).reshape(v.shape)


def write_index_cache_ref(k: torch.Tensor, slot_mapping: torch.Tensor, codes_cache: torch.Tensor,
                          scales_cache: torch.Tensor, rounding: str = "floor") -> None:
    """Quantize k [N, D] to MXFP8 and write token n at flat slot slot_mapping[n] (slots < 0 are skipped)."""
    codes, scales = mxfp8_quantize_ref(k, rounding)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    codes_cache.view(-1, codes_cache.shape[-1])[slots] = codes[keep]
    scales_cache.view(-1, scales_cache.shape[-1])[slots] = scales[keep]


def gather_paged(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Rows [length, ...] of one sequence from a paged cache [num_blocks, block_size, ...]."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table_row.long()[pos // bs]
    return cache[blocks, pos % bs]


# ---------------------------------------------------------------- oracle
def _topk_rows(scores: torch.Tensor, lengths: list[int], topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    R = scores.shape[0]
    idx = torch.full((R, topk), -1, dtype=torch.int32)
    val = torch.full((R, topk), float("-inf"), dtype=torch.float64)
    for r in range(R):
        n = min(topk, lengths[r])
        if n == 0:
            continue
        v, i = torch.topk(scores[r, : lengths[r]], n)
        idx[r, :n] = i.to(torch.int32)
        val[r, :n] = v
    return idx, val


def indexer_scores_ref(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [H, D], w [H], k [L, D] -> scores [L] float64."""
    logits = k.double() @ q.double().T  # [L, H]
    return (logits.clamp_min(0) * w.double()[None, :]).sum(-1)


def indexer_topk_decode_ref(q, w, k_codes, k_scales, block_table, context_lens, topk: int = 2048,
                            return_all_scores: bool = False):
    """q [B, H, D] (bf16/float), w [B, H] -> (indices [B, topk] int32, scores [B, topk] float64) [+ full scores]."""
    q, w = q.cpu(), w.cpu()
    lens = [int(x) for x in context_lens.cpu()]
    B = q.shape[0]
    Lmax = max(lens) if lens else 0
    full = torch.full((B, max(Lmax, 1)), float("-inf"), dtype=torch.float64)
    codes, scales, bt = k_codes.cpu(), k_scales.cpu(), block_table.cpu()
    for b in range(B):
        if lens[b] == 0:
            continue
        k = mxfp8_dequantize_ref(gather_paged(codes, bt[b], lens[b]), gather_paged(scales, bt[b], lens[b]))
        full[b, : lens[b]] = indexer_scores_ref(q[b], w[b], k)
    idx, val = _topk_rows(full, lens, topk)
    return (idx, val, full) if return_all_scores else (idx, val)


def indexer_topk_prefill_ref(q, w, k_codes, k_scales, block_table_row, start_pos: int, topk: int = 2048,
                             return_all_scores: bool = False):
    """Causal prefill: q [T, H, D], w [T, H]; query t sees positions s <= start_pos + t of the one sequence."""
    T = q.shape[0]
    L = start_pos + T
    k = mxfp8_dequantize_ref(gather_paged(k_codes.cpu(), block_table_row.cpu(), L),
                             gather_paged(k_scales.cpu(), block_table_row.cpu(), L))
    logits = torch.einsum("ld,thd->tlh", k, q.cpu().double())
    full = (logits.clamp_min(0) * w.cpu().double()[:, None, :]).sum(-1)  # [T, L]
    lens = [start_pos + t + 1 for t in range(T)]
    causal = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
    full = full.masked_fill(~causal, float("-inf"))
    idx, val = _topk_rows(full, lens, topk)
    return (idx, val, full) if return_all_scores else (idx, val)


def check_topk(idx: torch.Tensor, val: torch.Tensor, full_ref: torch.Tensor, lengths, topk: int,
               rtol: float = 1e-3) -> dict:
    """Compare a kernel's (indices, scores) with the float64 scores as sets up to ties.

    Per row: exactly min(topk, len) valid, distinct, in-range indices then -1 padding; every selected index has
    ref score >= (k-th largest ref score) - tol, with tol = rtol * max|ref score| of the row (ties and the bf16
    query leave near-equal scores interchangeable); returned scores match the ref scores at those indices to tol.
    Returns {"ok": bool, "max_rank_violation": float, "max_score_err": float, "bad_rows": [...]}.
    """
    idx, val, full_ref = idx.cpu().long(), val.cpu().double(), full_ref.cpu().double()
    bad, worst_gap, worst_err = [], 0.0, 0.0
    for r in range(idx.shape[0]):
        L = int(lengths[r])
        n = min(topk, L)
        row = idx[r]
        sel, pad = row[:n], row[n:]
        ok = bool((pad == -1).all()) and bool(((sel >= 0) & (sel < L)).all()) and sel.unique().numel() == n
        if n and ok:
            ref = full_ref[r, :L]
            tol = rtol * float(ref.abs().max().clamp_min(1e-30))
            kth = float(torch.topk(ref, n).values[-1])
            gap = max(0.0, kth - float(ref[sel].min()))
            err = float((val[r, :n] - ref[sel]).abs().max())
            worst_gap, worst_err = max(worst_gap, gap / tol), max(worst_err, err / tol)
            ok = gap <= tol and err <= tol
        if not ok:
            bad.append(r)
    return {"ok": not bad, "max_rank_violation": worst_gap, "max_score_err": worst_err, "bad_rows": bad[:8]}


# ---------------------------------------------------------------- eager unfused baseline (timed, and torch.compile'd)
def indexer_topk_decode_eager(q, w, k_codes, k_scales, block_table, context_lens, topk: int = 2048,
                              max_context_len: int | None = None):
    """Eager unfused bf16: gather pages, dequantize to bf16, bmm, relu, weight, head-sum, mask, torch.topk."""
    B, H, D = q.shape
    bs = k_codes.shape[1]
    L = max_context_len if max_context_len is not None else block_table.shape[1] * bs
    nblk = (L + bs - 1) // bs
    bt = block_table[:, :nblk].long()
    codes = k_codes[bt].reshape(B, nblk * bs, D)[:, :L]  # [B, L, D]
    scales = k_scales[bt].reshape(B, nblk * bs, -1)[:, :L]
    s = torch.exp2(scales.float() - 127.0)
    k = (codes.view(torch.float8_e4m3fn).float().reshape(B, L, -1, 32) * s[..., None]).reshape(B, L, D).bfloat16()
    logits = torch.bmm(k, q.transpose(1, 2))  # [B, L, H]
    scores = (logits.float().relu() * w[:, None, :].float()).sum(-1)
    pos = torch.arange(L, device=q.device)
    scores = scores.masked_fill(pos[None, :] >= context_lens[:, None], float("-inf"))
    vals, idx = torch.topk(scores, min(topk, L), dim=-1)
    idx = torch.where(torch.isinf(vals), torch.full_like(idx, -1), idx)
    return idx.int(), vals
