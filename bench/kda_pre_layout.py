# The KDA prefill pre-kernel's grid layout and tile size, measured against the committed kernel on a GPU (bitwise-equal
# outputs, direct launches, L2 flushed): bench/results/kda_pre_layout_2026-12-06_h100.json. An experiment: it copies
# the kernel's body with the layout as a parameter, and leaves the tree in the next commit (docs/kernels/kda.md).
#     KIMI_COMMIT=<sha> OUT=<dir> python bench/kda_pre_layout.py
import json, os, sys, statistics, torch, triton, triton.language as tl
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
from kimi_compile.plugins.kda import triton as ktk
from kimi_compile.plugins.kda.triton import _conv_tile, _window_src
OUT = os.environ.get("OUT", "."); DEV = "cuda"; res = {}
flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
def tm(fn, reps=10):
    ts = []
    for _ in range(reps + 2):
        flush.zero_(); s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts[2:])

@triton.jit
def _pre_var(U, CS, CW, FP, BP, LEN, OQ, OK, OV, OB, T, su_b, su_t, scs_b, scs_t, sf_b, sf_t,
             sb_b, sb_t, scale, l2_eps, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, ORDER: tl.constexpr):
    if ORDER == 0:
        bid = tl.program_id(0).to(tl.int64); it = tl.program_id(1); h = tl.program_id(2)
    else:
        h = tl.program_id(0); it = tl.program_id(1); bid = tl.program_id(2).to(tl.int64)
    t = it * BT + tl.arange(0, BT)
    tm_ = t < T
    dd = tl.arange(0, D)
    c = h * D + dd
    P = H * D
    n = tl.minimum(tl.load(LEN + bid).to(tl.int32), T)
    valid = tm_ & (t < n)
    i = tl.arange(0, 4)
    wm = (i < 3) & (tl.full([4], it, tl.int32) == 0)
    nq = _window_src(U, CS, bid, n + i, c, wm, su_b, su_t, scs_b, scs_t)
    nk = _window_src(U, CS, bid, n + i, P + c, wm, su_b, su_t, scs_b, scs_t)
    nv = _window_src(U, CS, bid, n + i, 2 * P + c, wm, su_b, su_t, scs_b, scs_t)
    orow = ((bid * T + t[:, None]) * H + h) * D + dd[None, :]
    q = _conv_tile(U, CS, CW, bid, t, c, tm_, su_b, su_t, scs_b, scs_t)
    q = q * (tl.rsqrt(tl.sum(q * q, 1) + l2_eps) * scale)[:, None]
    tl.store(OQ + orow, q.to(OQ.dtype.element_ty), mask=tm_[:, None])
    k = _conv_tile(U, CS, CW, bid, t, P + c, tm_, su_b, su_t, scs_b, scs_t)
    k = k * tl.rsqrt(tl.sum(k * k, 1) + l2_eps)[:, None]
    tl.store(OK + orow, k.to(OK.dtype.element_ty), mask=tm_[:, None])
    v = _conv_tile(U, CS, CW, bid, t, 2 * P + c, tm_, su_b, su_t, scs_b, scs_t)
    tl.store(OV + orow, v.to(OV.dtype.element_ty), mask=tm_[:, None])
    pad = tm_ & ~valid
    tl.store(FP + bid * sf_b + t[:, None] * sf_t + c[None, :],
             tl.full([BT, D], float("-inf"), FP.dtype.element_ty), mask=pad[:, None])
    braw = tl.load(BP + bid * sb_b + t * sb_t + h, mask=tm_, other=0.0).to(tl.float32)
    tl.store(OB + (bid * T + t) * H + h, tl.sigmoid(braw) * valid.to(tl.float32), mask=tm_)
    tl.debug_barrier()
    wp = CS + bid * scs_b + i[:, None] * scs_t
    tl.store(wp + c[None, :], nq.to(CS.dtype.element_ty), mask=wm[:, None])
    tl.store(wp + P + c[None, :], nk.to(CS.dtype.element_ty), mask=wm[:, None])
    tl.store(wp + 2 * P + c[None, :], nv.to(CS.dtype.element_ty), mask=wm[:, None])

def pre_var(u, cs, cw, f, b, lengths, scale, l2_eps, order, bt, nw):
    B, T, P3 = u.shape; H = b.shape[-1]; D = P3 // 3 // H
    oq = torch.empty(B, T, H, D, dtype=u.dtype, device=u.device); ok, ov = torch.empty_like(oq), torch.empty_like(oq)
    ob = torch.empty(B, T, H, dtype=torch.float32, device=u.device)
    grid = (B, triton.cdiv(T, bt), H) if order == 0 else (H, triton.cdiv(T, bt), B)
    _pre_var[grid](u, cs, cw.contiguous(), f, b, lengths, oq, ok, ov, ob, T, u.stride(0), u.stride(1), cs.stride(0),
                   cs.stride(1), f.stride(0), f.stride(1), b.stride(0), b.stride(1), scale, l2_eps, H=H, D=D, BT=bt,
                   ORDER=order, num_warps=nw)
    return oq, ok, ov, ob

torch.manual_seed(0)
for B, T, H in ((1, 32768, 96), (1, 32768, 12)):
    D = 128; C = H * D; case = f"B={B},T={T},H={H}"
    u = torch.randn(B, T, 3 * C, device=DEV, dtype=torch.bfloat16)
    f = torch.randn(B, T, C, device=DEV, dtype=torch.bfloat16); b = torch.randn(B, T, H, device=DEV, dtype=torch.bfloat16)
    cw = torch.randn(3 * C, 4, device=DEV, dtype=torch.bfloat16) * 0.5
    win0 = torch.randn(B, 3, 3 * C, device=DEV, dtype=torch.bfloat16)
    lengths = torch.full((B,), T, device=DEV, dtype=torch.int64); lengths[0] = T - 100
    w1 = win0.clone(); f1 = f.clone()
    ref = ktk.kda_prefill_prepare(u, w1, cw, f1, b, lengths, scale=D ** -0.5, l2_eps=1e-6)
    win = win0.clone()
    rows = {"committed": tm(lambda: ktk.kda_prefill_prepare(u, win, cw, f, b, lengths, scale=D ** -0.5, l2_eps=1e-6))}
    for order, bt, nw in ((0, 32, 4), (1, 32, 4), (1, 64, 4), (1, 32, 8)):
            if True:
                name = f"order{order}_bt{bt}_w{nw}"
                try:
                    w2 = win0.clone(); f2 = f.clone()
                    o = pre_var(u, w2, cw, f2, b, lengths, D ** -0.5, 1e-6, order, bt, nw)
                    eq = all(torch.equal(x, y) for x, y in zip(o, (ref[0], ref[1], ref[2], ref[4]))) and torch.equal(w2, w1) and torch.equal(f2, f1)
                    win = win0.clone()
                    rows[name] = {"us": tm(lambda: pre_var(u, win, cw, f, b, lengths, D ** -0.5, 1e-6, order, bt, nw)), "bitwise_equal": eq}
                except Exception as e:
                    rows[name] = {"error": str(e)[:200]}
    res[f"kda_pre {case}"] = rows
    print(case, json.dumps(rows)[:900], flush=True)
    del u, f, b, ref
    torch.cuda.empty_cache()

json.dump(res, open(os.path.join(OUT, "r8.json"), "w"), indent=1)
