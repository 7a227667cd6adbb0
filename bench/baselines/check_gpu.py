"""The baselines (bench/baselines) on one sm_90 GPU: each against plain torch at small shapes (inputs made in our
cache formats and converted, so the converters are checked too), then timed at the target shapes; writes JSON.

    python bench/baselines/check_gpu.py [--out $OUT/baselines.json] [--only flashmla,deepgemm,flashkda,fla]
                                        [--no-time]

On the GPU machine, with .ext/lib and .whl carried (both git-excluded):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site

Timing: `reps` calls captured in one CUDA graph (eager when capture fails; the row says which), replayed, median of
5 replays per call; inputs converted beforehand. A baseline that cannot load gets a row with its reason.
Target shapes: FlashMLA 128 heads x 576 / 512, top-k 2048, 64-token pages, B=32 (64K context) and B=1 (128K);
DeepGEMM 64 heads x 128, 64-token pages, B=32 x 64K and B=1 x 128K, + torch.topk(2048); FlashKDA B=1, T=32768,
H=96 and 12, fp32 final state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import baselines as bl  # noqa: E402

DEV = "cuda"
BS = 64


def time_ms(fn, reps: int = 20) -> tuple[float, str]:
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run, mode = graph.replay, "graph"
    except Exception:  # noqa: BLE001 - fall back to eager launches
        torch.cuda.synchronize()
        run, mode = (lambda: [fn() for _ in range(reps)]), "eager"
    run()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times), mode


def paged(b: int, ctx: int, gen: torch.Generator):
    """block_table [B, MB] int32 over a shuffled pool of B * MB pages."""
    mb = -(-ctx // BS)
    return torch.randperm(b * mb, generator=gen, device=DEV).to(torch.int32).view(b, mb)


def e4m3_codes(shape, gen) -> torch.Tensor:  # finite E4M3 bit patterns (no NaN 0x7f / 0xff)
    return (torch.randn(shape, generator=gen, device=DEV) * 2).to(torch.float8_e4m3fn).view(torch.uint8)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---- FlashMLA sparse decode ----

def mla_inputs(b: int, ctx: int, topk: int, heads: int, gen, invalid: float = 0.0):
    bt = paged(b, ctx, gen)
    nb = bt.numel()
    codes = e4m3_codes((nb, BS, 512), gen)
    scales = torch.randint(118, 124, (nb, BS, 4), generator=gen, device=DEV, dtype=torch.uint8)
    rope = (torch.randn(nb, BS, 64, generator=gen, device=DEV) * 0.1).bfloat16()
    idx = torch.stack([torch.randperm(ctx, generator=gen, device=DEV)[:topk] for _ in range(b)]).view(b, 1, topk)
    idx = torch.where(torch.rand(idx.shape, generator=gen, device=DEV) < invalid, -1, idx)
    q = torch.randn(b, 1, heads, 576, generator=gen, device=DEV).bfloat16()
    return q, codes, scales, rope, bt, idx


def mla_ref(q, codes, scales, rope, bt, idx, sm_scale):
    lat = (codes.view(torch.float8_e4m3fn).float().view(*codes.shape[:2], 4, 128)
           * bl.flashmla.e8m0_to_float(scales)[..., None]).flatten(2)
    kv = torch.cat([lat, rope.float()], -1).flatten(0, 1)                    # [NB * BS, 576]
    rows = bl.to_flashmla_indices(idx, bt, BS).long()                        # [B, 1, k]
    k = kv[rows.clamp_min(0)]                                                # [B, 1, k, 576]
    s = torch.einsum("bthd,btkd->bthk", q.float(), k) * sm_scale
    s = s.masked_fill((rows < 0)[:, :, None, :], float("-inf"))
    return torch.einsum("bthk,btkd->bthd", torch.softmax(s, -1).nan_to_num(), k[..., :512])


def check_flashmla(gen):
    sm_scale = 576 ** -0.5
    out = {}
    for heads in (128, 64):
        q, codes, scales, rope, bt, idx = mla_inputs(2, 1000, 128, heads, gen, invalid=0.1)
        kv = bl.to_flashmla_cache(codes, scales, rope)
        got, _ = bl.flashmla_sparse_decode(q, kv, bl.to_flashmla_indices(idx, bt, BS), sm_scale)
        out[f"rel_err_h{heads}"] = rel(got, mla_ref(q, codes, scales, rope, bt, idx, sm_scale))
    out["ok"] = max(out.values()) < 1e-2
    return out


def time_flashmla(b, ctx, gen):
    q, codes, scales, rope, bt, idx = mla_inputs(b, ctx, 2048, 128, gen)
    kv, rows = bl.to_flashmla_cache(codes, scales, rope), bl.to_flashmla_indices(idx, bt, BS)
    plan = bl.flashmla_plan(b, 1, 128, 2048)
    outb = torch.empty(b, 1, 128, 512, dtype=torch.bfloat16, device=DEV)
    ms, mode = time_ms(lambda: bl.flashmla_sparse_decode(q, kv, rows, 576 ** -0.5, plan, out=outb))
    ms_plan, _ = time_ms(lambda: bl.flashmla_plan(b, 1, 128, 2048))
    return {"kernel": "flashmla_sparse_decode", "B": b, "ctx": ctx, "topk": 2048, "heads": 128, "ms": ms,
            "mode": mode, "plan_ms": ms_plan, "note": "attention + combine, schedule (plan) computed once"}


# ---- DeepGEMM paged MQA logits ----

def idx_inputs(b, ctx, gen):
    bt = paged(b, ctx, gen)
    nb = bt.numel()
    codes = e4m3_codes((nb, BS, 128), gen)
    scales = torch.randint(120, 126, (nb, BS, 4), generator=gen, device=DEV, dtype=torch.uint8)
    q = torch.randn(b, 1, 64, 128, generator=gen, device=DEV).bfloat16()
    w = torch.rand(b, 1, 64, generator=gen, device=DEV) / 8
    return q, w, codes, scales, bt, torch.full((b,), ctx, dtype=torch.int32, device=DEV)


def logits_ref(q, w, kv, bt, lens):
    """sum_h w[b, h] relu(q[b, h] . k[s]) over s < lens[b] (-inf past), k rows [NB, BS, 128] fp32."""
    b, mx = q.shape[0], int(lens.max())
    pos = torch.arange(mx, device=DEV)
    rows = bt.long()[:, pos // BS] * BS + pos % BS                           # [B, mx]
    k = kv.flatten(0, 1)[rows]                                               # [B, mx, 128]
    s = torch.einsum("bhd,bsd->bhs", q[:, 0].float(), k).relu()
    out = torch.einsum("bh,bhs->bs", w.reshape(b, -1).float(), s)
    return out.masked_fill(pos[None] >= lens[:, None], float("-inf"))


def check_deepgemm(gen):
    q, w, codes, scales, bt, _ = idx_inputs(3, 1500, gen)
    lens = torch.tensor([1500, 700, 64], dtype=torch.int32, device=DEV)
    fused, (q8, w8) = bl.to_deepgemm_cache(codes, scales), bl.to_deepgemm_q(q, w)
    got = bl.deepgemm_paged_mqa_logits(q8, fused, w8, lens, bt, bl.deepgemm_plan(lens), 1500)
    got = got.masked_fill(torch.arange(1500, device=DEV)[None] >= lens[:, None], float("-inf"))
    nb = fused.shape[0]  # their exact inputs, dequantized
    theirs = fused.view(nb, -1)[:, :BS * 128].view(torch.float8_e4m3fn).float().view(nb, BS, 128) \
        * fused.view(nb, -1)[:, BS * 128:].view(torch.float32)[..., None]
    ref_theirs = logits_ref(q8.float(), w8, theirs, bt, lens)
    ours = codes.view(torch.float8_e4m3fn).float().view(nb, BS, 4, 32) * bl.flashmla.e8m0_to_float(scales)[..., None]
    ref_ours = logits_ref(q, w, ours.view(nb, BS, 128), bt, lens)
    fin = torch.isfinite(ref_ours)
    top = [set(torch.topk(x[i], 64).indices.tolist()) for x in (got, ref_ours) for i in range(3)]
    out = {"rel_err_vs_their_inputs": rel(got[fin], ref_theirs[fin]),
           "rel_err_vs_our_inputs": rel(got[fin], ref_ours[fin]),
           "top64_overlap_vs_ours": min(len(top[i] & top[i + 3]) / 64 for i in range(3))}
    out["ok"] = out["rel_err_vs_their_inputs"] < 1e-4
    return out


def time_deepgemm(b, ctx, gen):
    q, w, codes, scales, bt, lens = idx_inputs(b, ctx, gen)
    fused, (q8, w8) = bl.to_deepgemm_cache(codes, scales), bl.to_deepgemm_q(q, w)
    meta = bl.deepgemm_plan(lens)
    buf = torch.empty(b, bl.lib("deepgemm").deepgemm_logits_stride(ctx), device=DEV)
    logits = lambda: bl.deepgemm_paged_mqa_logits(q8, fused, w8, lens, bt, meta, ctx, out=buf)  # noqa: E731
    ms, mode = time_ms(logits)
    ms_topk, _ = time_ms(lambda: torch.topk(logits(), 2048, dim=-1))
    ms_plan, _ = time_ms(lambda: bl.deepgemm_plan(lens))
    return {"kernel": "deepgemm_paged_mqa_logits", "B": b, "ctx": ctx, "heads": 64, "ms": ms, "mode": mode,
            "with_topk2048_ms": ms_topk, "plan_ms": ms_plan, "note": "schedule (plan) computed once; q, K requantized"}


# ---- FlashKDA / fla-core chunked prefill ----

def kda_inputs(b, t, h, gen):
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)  # noqa: E731
    q, k, v, g = (r(b, t, h, 128).bfloat16() for _ in range(4))
    return q, k, v, g, r(b, t, h).bfloat16(), r(h) * 0.5, r(h, 128) * 0.5


def kda_ref(q, k, v, g, beta, scale, a_log, dt_bias, lower_bound, cu):
    """Plain fp32 recurrence over the packed sequences cu: S [K, V]; S = diag(a_t) S; S += beta k (v - S^T k)^T;
    o = S^T q (fla's naive_recurrent_kda). Returns (o [1, T, H, V], final states [N, H, V, K])."""
    t_all, h = q.shape[1], q.shape[2]
    q, k = (x[0].float() * torch.rsqrt((x[0].float() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * scale
    a = torch.exp(lower_bound * torch.sigmoid(a_log.exp()[:, None] * (g[0].float() + dt_bias)))
    beta = torch.sigmoid(beta[0].float())
    o, states = torch.zeros(t_all, h, 128, device=DEV), []
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        st = torch.zeros(h, 128, 128, device=DEV)
        for t in range(s0, s1):
            st = st * a[t][..., None]
            u = v[0, t].float() - torch.einsum("hkv,hk->hv", st, k[t])
            st = st + beta[t][:, None, None] * k[t][..., None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", st, q[t])
        states.append(st.transpose(-1, -2))
    return o[None], torch.stack(states)


def check_flashkda(gen):
    q, k, v, g, beta, a_log, dt_bias = kda_inputs(1, 200, 4, gen)
    cu = torch.tensor([0, 37, 200], dtype=torch.int64, device=DEV)
    final = torch.zeros(2, 4, 128, 128, device=DEV)
    got = bl.flashkda_prefill(q, k, v, g, beta, 128 ** -0.5, a_log, dt_bias, -5.0, final_state=final, cu_seqlens=cu)
    ref, ref_state = kda_ref(q, k, v, g, beta, 128 ** -0.5, a_log, dt_bias, -5.0, cu)
    out = {"rel_err_out": rel(got, ref), "rel_err_state": rel(final, ref_state)}
    out["ok"] = max(out.values()) < 3e-2
    return out


def time_flashkda(t, h, gen):
    q, k, v, g, beta, a_log, dt_bias = kda_inputs(1, t, h, gen)
    final = torch.empty(1, h, 128, 128, device=DEV)
    ws = torch.empty(bl.flashkda.flashkda_workspace_bytes(t, h), dtype=torch.uint8, device=DEV)
    out = torch.empty_like(v)
    ms, mode = time_ms(lambda: bl.flashkda_prefill(q, k, v, g, beta, 128 ** -0.5, a_log, dt_bias, -5.0,
                                                   final_state=final, out=out, workspace=ws), reps=5)
    return {"kernel": "flashkda_prefill", "B": 1, "T": t, "H": h, "ms": ms, "mode": mode,
            "note": "L2 norm, safe gate, beta sigmoid in-kernel; fp32 final state, no initial state"}


def time_fla(t, h, gen):
    from fla.ops.kda import chunk_kda
    q, k, v, g, beta, a_log, dt_bias = kda_inputs(1, t, h, gen)
    call = lambda: chunk_kda(q, k, v, g, beta, scale=128 ** -0.5, output_final_state=True,  # noqa: E731
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             safe_gate=True, lower_bound=-5.0, A_log=a_log, dt_bias=dt_bias.flatten())
    ms, mode = time_ms(call, reps=5)
    return {"kernel": "fla chunk_kda", "B": 1, "T": t, "H": h, "ms": ms, "mode": mode,
            "note": "fla-core 0.6.0, FlashKDA's in-kernel work (L2 norm, safe gate, beta sigmoid); fp32 final state"}


CASES = {
    "flashmla": (check_flashmla, [(time_flashmla, (32, 65536)), (time_flashmla, (1, 131072))]),
    "deepgemm": (check_deepgemm, [(time_deepgemm, (32, 65536)), (time_deepgemm, (1, 131072))]),
    "flashkda": (check_flashkda, [(time_flashkda, (32768, 96)), (time_flashkda, (32768, 12))]),
    "fla": (None, [(time_fla, (32768, 96)), (time_fla, (32768, 12))]),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--no-time", action="store_true")
    args = ap.parse_args()
    info = bl.LIB_DIR / "BUILD_INFO.txt"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": {}, "timings": [],
           "build": info.read_text().splitlines() if info.exists() else None}
    for name in args.only.split(","):
        check, timings = CASES[name]
        reason = bl.unavailable(name)
        if reason:
            res["checks"][name] = {"unavailable": reason}
            print(f"[{name}] unavailable: {reason}", flush=True)
            continue
        gen = torch.Generator(DEV).manual_seed(0)
        steps = ([(check, ())] if check else []) + ([] if args.no_time else timings)
        for fn, a in steps:
            try:
                row = fn(*a, gen)
            except Exception as e:  # noqa: BLE001 - report and go on
                row = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
            if fn is check:
                res["checks"][name] = row
            else:
                res["timings"].append({**row, "args": a})
            print(f"[{name}] {fn.__name__}{a}: {row}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
