"""cuda backend kernels for kimi.MoE and kimi.MoEExperts: router, top-k and the latent experts as grouped GEMMs over
the tokens sorted by expert (static shapes: N*k rows whatever the routing, so the step can be captured in a CUDA
graph).

Experts read only their own rows: up to MAX_EXPERT_ROWS rows (decode at small batches) two Triton launches, each
sorted row a product with its expert's weights (plugins/moe/triton.py `experts`); more rows `torch._grouped_mm`
(CUTLASS grouped GEMM, Hopper, bf16) on the GPU; elsewhere (CPU, fp32) the same sorted layout through a gathered
batched product. On CUDA tensors four Triton kernels
(plugins/moe/triton.py) replace torch compositions: the router's selection after its sigmoid, the rows' layout by
expert (a histogram and a key sort in one tile), the SiTU activation of the experts and of the shared expert, and
the routed sum over k with its RMSNorm; the torch forms run on the CPU and wherever a kernel declines. Selection and weights follow the op's contract exactly (fp32 router scores, ties to the lower expert). Deterministic: the k expert rows of a token are
summed in a fixed order (no atomics), so two runs of a step give the same bits.
"""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel, out_slot


def _act(u: torch.Tensor, g: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return a * (linear_beta * torch.tanh(u / linear_beta) if linear_beta > 0 else u)


def _situ(u: torch.Tensor, g: torch.Tensor, a, dt: torch.dtype) -> torch.Tensor:
    """act(u, g) in dt, computed in fp32: the Triton kernel on CUDA tensors (one launch), else the torch form."""
    if u.is_cuda and a["situ_beta"] > 0:
        from kimi_compile.plugins.moe import triton as tk

        if tk.unsupported(u, g) is None:
            return tk.situ(u, g, a["situ_beta"], a["situ_linear_beta"], dt)
    return _act(u.float(), g.float(), a["situ_beta"], a["situ_linear_beta"]).to(dt)


def _route(s: torch.Tensor, bias: torch.Tensor, k: int, a):
    """(idx, weights) from the Triton router kernel on CUDA tensors, else None (the caller's torch form)."""
    if not s.is_cuda:
        return None
    from kimi_compile.plugins.moe import triton as tk

    return tk.route(s, bias, k, bool(a["renormalize"]), a["scaling"])


def _layout(flat: torch.Tensor, k: int, E: int):
    """(order, expert, token, offs) of the rows sorted by expert: the Triton layout kernel on CUDA tensors where it
    applies (one launch), else the torch form (a stable sort and a count)."""
    if flat.is_cuda:
        from kimi_compile.plugins.moe import triton as tk

        got = tk.layout(flat, k, E)
        if got is not None:
            return got
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
        0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    return order, flat.index_select(0, order), order // k, torch.cumsum(counts, 0, dtype=torch.int32)


def _norm(r: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()


_GATHER_BYTES = 1 << 28


def _grouped(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x (sorted by expert; `expert` per row, `offs` cumulative row ends) times w[e]^T, w [E, out, in]."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    # each row gathers its expert's matrix: in slices of rows whose gathered matrices fit _GATHER_BYTES (a 4096-token
    # float32 prefill chunk of the small preset would gather 192 GiB at once); static shapes, so still capturable
    rows = max(1, _GATHER_BYTES // max(1, w[0].numel() * w.element_size()))
    if x.shape[0] <= rows:
        return torch.bmm(w.index_select(0, expert), x.unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.bmm(w.index_select(0, expert[i:i + rows]), x[i:i + rows].unsqueeze(-1)).squeeze(-1)
                      for i in range(0, x.shape[0], rows)])


def _routed(h, router_w, router_bias, w_down, w1, w3, w2, a, offset: int = 0, rows: bool = False) -> torch.Tensor:
    """r [N, L] fp32: the weighted latent sum over the held experts (global ids offset .. offset + w1.shape[0] - 1);
    a selected expert held elsewhere gets weight 0 and a clamped index (N*k rows whatever the routing). `rows`: the
    k weighted expert rows of each token instead, [N * k, L] (token-major), for a caller that sums them itself."""
    dt = h.dtype
    k, E = int(a["top_k"]), w1.shape[0]
    xf = h.reshape(-1, h.shape[-1])
    s = torch.sigmoid(xf.float() @ router_w.float().t())
    picked = _route(s, router_bias, k, a)
    if picked is None:
        choice = s + router_bias.float()
        idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]  # ties -> lower expert
        wk = s.gather(-1, idx)
        if a["renormalize"]:
            wk = wk / wk.sum(-1, keepdim=True)
        wk = wk * a["scaling"]
    else:
        idx, wk = picked
    if offset or E != router_w.shape[0]:
        local = idx - offset
        held = (local >= 0) & (local < E)
        idx, wk = torch.where(held, local, 0), torch.where(held, wk, 0.0)
    z = xf @ w_down.t().to(dt)
    flat = idx.reshape(-1)
    order, expert, token, offs = _layout(flat, k, E)
    w1, w3, w2 = w1.to(dt), w3.to(dt), w2.to(dt)
    r = None
    if z.is_cuda and a["situ_beta"] > 0:  # a few rows (decode): two Triton launches, rows read their expert's weights
        from kimi_compile.plugins.moe import triton as tk

        r = tk.experts(z, token, expert, order, wk.reshape(-1).float(), w1, w3, w2, a["situ_beta"],
                       a["situ_linear_beta"])
    if r is None:
        zs = z.index_select(0, token)
        act = _situ(_grouped(zs, w3, expert, offs), _grouped(zs, w1, expert, offs), a, dt)
        r_sorted = _grouped(act, w2, expert, offs).float() * wk.reshape(-1).index_select(0, order).unsqueeze(-1)
        # back to [N, k] order (each row written once) and a sum over k: deterministic, unlike index_add_'s atomics
        r = torch.empty_like(r_sorted).index_copy_(0, order, r_sorted)
    return r if rows else r.reshape(xf.shape[0], k, -1).sum(1)


def moe(x, a, out=None):
    """kimi.MoE; out: the executor's slot for the output, where the routed and shared sums are added into when it
    is the output's contiguous shape and dtype."""
    (h, router_w, router_bias, w_down, w1, w3, w2, norm_w, w_up, sh_gate, sh_up, sh_down) = x
    shape, dt = h.shape, h.dtype
    xf = h.reshape(-1, shape[-1])
    k = int(a["top_k"])
    rk = _routed(h, router_w, router_bias, w_down, w1, w3, w2, a, rows=True)
    rn = None
    if h.is_cuda:  # the sum over k and the RMSNorm in one kernel where it applies
        from kimi_compile.plugins.moe import triton as tk

        rn = tk.sum_norm(rk, k, norm_w, a["eps"], dt)
    if rn is None:
        rn = _norm(rk.reshape(xf.shape[0], k, -1).sum(1), norm_w, a["eps"]).to(dt)
    y = rn @ w_up.t().to(dt)
    shared = _situ(xf @ sh_up.t().to(dt), xf @ sh_gate.t().to(dt), a, dt) @ sh_down.t().to(dt)
    dst = out_slot(out, 0, shape, y.dtype)
    if dst is not None:
        torch.add(y, shared, out=dst.view(y.shape))
        return (dst,)
    return ((y + shared).reshape(shape),)


def moe_experts(x, a):
    """kimi.MoEExperts: r [..., L] over the held experts (expert parallelism)."""
    (h, router_w, router_bias, w_down, w1, w3, w2) = x
    r = _routed(h, router_w, router_bias, w_down, w1, w3, w2, a, int(a["expert_offset"]))
    return (r.to(h.dtype).reshape(*h.shape[:-1], r.shape[-1]),)


CUDA = {"MoE": Kernel(moe, devices=("cuda", "cpu"), name="torch.grouped_moe", out=True),
        "MoEExperts": Kernel(moe_experts, devices=("cuda", "cpu"), name="torch.grouped_moe_experts")}
