"""cuda backend kernels for Block Attention Residuals. Default on the GPU: one Triton kernel per stage
(plugins/attn_res/triton.py: AttnResMerge's merge and RMSNorm in one launch instead of 29 torch operations,
AttnResStage1's scores, softmax statistics and weighted sum in one instead of 17). Fallback (the CPU, shapes or dtypes
the kernels refuse, no triton): the two stages as fp32 torch compositions (any device)."""

from __future__ import annotations

import torch

from kimi_compile.lowering import Kernel, out_slot, warn_fallback_once


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def stage1(x, a):
    """bank [K,B,T,D], queries [L,D] -> o1 [L,B,T,D], m1 [L,B,T], l1 [L,B,T] (semantics: plugins/attn_res)."""
    bank, queries = x
    b = bank.float()
    s = torch.einsum("kbtd,ld->lkbt", b, queries.float()) * _inv_rms(b, a["eps"]).unsqueeze(0)
    m1 = s.amax(1)
    e = torch.exp(s - m1.unsqueeze(1))
    o1 = torch.einsum("lkbt,kbtd->lbtd", e, b)
    return o1.to(bank.dtype), m1, e.sum(1)


def merge(x, a, out=None):
    """o1, m1, l1 (stage 1), partial [B,T,D], query [D], norm_weight [D] -> RMSNorm(mix) [B,T,D]; the last
    product is rounded into the executor's slot when it gives one (out)."""
    o1, m1, l1, partial, query, norm_w = x
    slot = a["slot"]
    p = partial.float()
    sp = (p @ query.float()) * _inv_rms(p, a["eps"])
    m = torch.maximum(m1[slot], sp)
    e1, ep = torch.exp(m1[slot] - m), torch.exp(sp - m)
    mix = (o1[slot].float() * e1.unsqueeze(-1) + p * ep.unsqueeze(-1)) / (l1[slot] * e1 + ep).unsqueeze(-1)
    y = mix * _inv_rms(mix, a["norm_eps"]).unsqueeze(-1)
    dst = out_slot(out, 0, partial.shape, partial.dtype)
    if dst is None:
        return ((y * norm_w.float()).to(partial.dtype),)
    return (torch.mul(y, norm_w.float(), out=dst),)


_FLOATS = ("FLOAT", "BFLOAT16", "FLOAT16")


def _triton_supports(values, attrs) -> str | None:
    """Build-time check on the graph values: float tensors where the kernels read them, triton installed (shapes
    and strides are checked when the kernel runs: `unsupported_merge` / `unsupported_stage1`)."""
    from kimi_compile.plugins.attn_res import triton as tk

    for v in values:
        if v is not None and v.dtype is not None and v.dtype.name not in _FLOATS:
            return f"the Triton kernel reads float32 / bfloat16 / float16 tensors, got {v.dtype.name} ({v.name})"
    if getattr(tk, "triton", None) is None:
        return "triton is not installed"
    return None


def merge_triton(x, a, out=None):
    from kimi_compile.plugins.attn_res import triton as tk

    o1, m1, l1, partial, query, norm_w = x
    why = tk.unsupported_merge(o1, m1, l1, partial, query, norm_w, int(a["slot"]))
    if why is not None:  # a shape the build could not see: say so once, run the fallback kernel
        warn_fallback_once("kimi.AttnResMerge", why, "torch.attn_res_merge")
        return merge(x, a, out)
    return (tk.attn_res_merge(o1, m1, l1, partial, query, norm_w, int(a["slot"]), a["eps"], a["norm_eps"],
                              out=out_slot(out, 0, partial.shape, partial.dtype)),)


def stage1_triton(x, a, out=None):
    from kimi_compile.plugins.attn_res import triton as tk

    bank, queries = x
    why = tk.unsupported_stage1(bank, queries)
    if why is not None:
        warn_fallback_once("kimi.AttnResStage1", why, "torch.attn_res_stage1")
        return stage1(x, a)
    K, B, T, D = bank.shape
    L = queries.shape[0]
    slots = (out_slot(out, 0, (L, B, T, D), bank.dtype), out_slot(out, 1, (L, B, T), torch.float32),
             out_slot(out, 2, (L, B, T), torch.float32))
    return tk.attn_res_stage1(bank, queries, a["eps"], out=slots if all(t is not None for t in slots) else None)



CUDA = {
    "AttnResStage1": Kernel(stage1_triton, supports=_triton_supports, devices=("cuda",), name="triton.attn_res_stage1",
                            fallback=Kernel(stage1, devices=("cuda", "cpu"), name="torch.attn_res_stage1"), out=True),
    "AttnResMerge": Kernel(merge_triton, supports=_triton_supports, devices=("cuda",), name="triton.attn_res_merge",
                           fallback=Kernel(merge, devices=("cuda", "cpu"), name="torch.attn_res_merge", out=True),
                           out=True),
}
