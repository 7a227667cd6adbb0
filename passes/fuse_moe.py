"""fuse_moe: the latent MoE block (router, top-k, renormalised weights, latent experts, shared experts) -> kimi.MoE.

    before (per MoE layer, prefill and decode alike; xf = x flattened to [N, hidden]):
        s      = Sigmoid(MatMul(xf, router_w^T));     _, idx = TopK[k](Add(s, e_score_correction_bias))
        w      = Mul(Div(gs, ReduceSum[-1](gs)), scaling)       gs = GatherElements(s, idx)   (Div, Mul optional)
        z      = Gemm[transB](xf, w_down)
        h      = SiTU(Einsum["nd,nkid->nki"](z, GatherND(w3, idx)), Einsum["nd,nkid->nki"](z, GatherND(w1, idx)))
        r      = ReduceSum[1](Mul(Einsum["nki,nkdi->nkd"](h, GatherND(w2, idx)), Unsqueeze(w)))
        y      = Add(Gemm[transB](RMSNormalization(r, norm_w), w_up), Gemm[transB](SiTU(xf su^T, xf sg^T), sd))
        SiTU(u, g) = Mul(Mul(Mul(Tanh(Div(g, b)), b), Sigmoid(g)), Mul(Tanh(Div(u, lb)), lb))   (or ... , u)
    after:
        y = kimi.MoE[top_k, renormalize, scaling, situ_beta, situ_linear_beta, eps](
            xf, router_w, router_bias, w_down, w1, w3, w2, norm_w, w_up, shared_gate, shared_up, shared_down)
    (2-D weights in nn.Linear layout; a MatMul-layout weight is transposed into a new initializer named by content.)

Refusals (counted as `refused.<reason>`): non_constant_k, router_not_sigmoid, bias_not_constant, router_not_linear,
weights_not_scores, renormalize_form, no_weighted_sum, experts_form, activation, no_latent_down, no_latent_norm,
no_latent_up, no_shared_experts.
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.passes.fuse_kda import _binary_const, _scalar
from kimi_compile.rewrite import (Builder, FusionPass, Refuse, attr, const, consumers, is_const, producer,
                                  sole_consumer, weight_like)


def _eq(n: ir.Node) -> str:
    return (attr(n, "equation") or "").replace(" ", "")


def _linear(model: ir.Model, v: ir.Value, reason: str) -> tuple[ir.Value, ir.Value]:
    """v = Gemm[transB=1](x, w) or MatMul(x, w^T) with a constant weight -> (x, w in nn.Linear layout [out, in])."""
    n = producer(v, ("Gemm", "MatMul"), reason)
    w = const(n.inputs[1])
    if w is None or w.ndim != 2:
        raise Refuse(reason, f"weight of {n.name!r} is not a constant matrix")
    if n.op_type == "Gemm":
        if attr(n, "transA", 0) or attr(n, "alpha", 1.0) != 1.0 or (len(n.inputs) > 2 and n.inputs[2] is not None):
            raise Refuse(reason, f"{n.name!r} is not a plain x @ w^T")
        if attr(n, "transB", 0):
            return n.inputs[0], n.inputs[1]
    return n.inputs[0], weight_like(model, n.inputs[1], w.T, "linear")  # a bf16-stored weight stays bf16


def _pick(n: ir.Node, op_type: str) -> tuple[ir.Value, ir.Node] | None:
    """For a binary node: (the other operand, the producer of type op_type), whichever order, else None."""
    for a, b in (n.inputs, n.inputs[::-1]):
        p = b.producer()
        if p is not None and p.op_type == op_type and p.domain == "":
            return a, p
    return None


def _bounded(v: ir.Value, reason: str) -> tuple[ir.Value, float]:
    """v = Mul(Tanh(Div(t, c)), c) -> (t, c)."""
    mul = producer(v, "Mul", reason)
    split = _binary_const(mul)
    if split is None:
        raise Refuse(reason, "no constant beta")
    div = producer(producer(split[0], "Tanh", reason).inputs[0], "Div", reason)
    c = _scalar(split[1], reason)
    if not is_const(div.inputs[1]) or _scalar(const(div.inputs[1]), reason) != c:
        raise Refuse(reason, "tanh soft cap with two different betas")
    return div.inputs[0], c


def situ(v: ir.Value) -> tuple[ir.Value, ir.Value, float, float]:
    """v = SiTU(up, gate) -> (up, gate, beta, linear_beta); linear_beta 0 when the up branch is linear."""
    r = "activation"
    mul = producer(v, "Mul", r)
    for a, u in (mul.inputs, mul.inputs[::-1]):
        am = a.producer()
        if am is None or am.op_type != "Mul":
            continue
        picked = _pick(am, "Sigmoid")
        if picked is None:
            continue
        capped, sig = picked
        try:
            gate, beta = _bounded(capped, r)
        except Refuse:
            continue
        if sig.inputs[0] is not gate:
            continue
        try:
            up, lbeta = _bounded(u, r)
        except Refuse:
            up, lbeta = u, 0.0
        return up, gate, beta, lbeta
    raise Refuse(r, f"{v.name!r} is not SiTU(up, gate)")


class FuseMoEPass(FusionPass):
    name = "fuse_moe"
    version = 1
    rule = "fuse_moe"

    def anchors(self, model):
        return [n for n in model.graph if n.op_type == "TopK" and n.domain == ""]

    def match(self, model, topk):
        k = const(topk.inputs[1])
        if k is None or np.size(k) != 1 or int(np.ravel(k)[0]) <= 0:
            raise Refuse("non_constant_k")
        if attr(topk, "largest", 1) != 1 or attr(topk, "axis", -1) not in (-1, 1):
            raise Refuse("non_constant_k", "not a largest-k over the experts")
        m = dict(top_k=int(np.ravel(k)[0]))
        # router: TopK(Add(Sigmoid(x @ W^T), bias))
        add = producer(topk.inputs[0], "Add", "router_not_sigmoid")
        picked = _pick(add, "Sigmoid")
        if picked is None:
            raise Refuse("router_not_sigmoid")
        bias_v, sig = picked
        if not is_const(bias_v):
            raise Refuse("bias_not_constant")
        xf, m["router_w"] = _linear(model, sig.inputs[0], "router_not_linear")
        m.update(x=xf, router_bias=bias_v)
        s, idx = sig.outputs[0], topk.outputs[1]
        # routing weights: GatherElements(s, idx) [/ sum] [* scaling]
        ge = [n for n in consumers(idx) if n.op_type == "GatherElements"]
        if len(ge) != 1 or ge[0].inputs[0] is not s or attr(ge[0], "axis", 0) not in (-1, 1):
            raise Refuse("weights_not_scores", "routing weights are not the uncorrected scores at the selection")
        w = ge[0].outputs[0]
        m["renormalize"], m["scaling"] = 0, 1.0
        div = [n for n in consumers(w) if n.op_type == "Div" and n.inputs[0] is w]
        if div:
            den = div[0].inputs[1]
            dp = den.producer()
            if dp is not None and dp.op_type == "Add":  # sum + tiny eps (1e-20 does not change an fp32 sum)
                split = _binary_const(dp)
                if split is None or abs(_scalar(split[1], "renormalize_form")) > 1e-12:
                    raise Refuse("renormalize_form", "renormalisation adds a non-negligible epsilon")
                den = split[0]
            red = producer(den, "ReduceSum", "renormalize_form")
            axes = const(red.inputs[1]) if len(red.inputs) > 1 else None
            if red.inputs[0] is not w or axes is None or list(np.ravel(axes)) not in ([-1], [1]):
                raise Refuse("renormalize_form", "weights are not divided by their sum over the k")
            m["renormalize"], w = 1, div[0].outputs[0]
        sc = [n for n in consumers(w) if n.op_type == "Mul" and _binary_const(n) is not None]
        if sc and np.size(_binary_const(sc[0])[1]) == 1:
            m["scaling"], w = _scalar(_binary_const(sc[0])[1], "no_weighted_sum"), sc[0].outputs[0]
        # weighted sum of the expert outputs
        r = "no_weighted_sum"
        unsq = sole_consumer(w, r)
        if unsq.op_type != "Unsqueeze" or list(np.ravel(const(unsq.inputs[1]))) not in ([-1], [2]):
            raise Refuse(r, "weights are not broadcast over the expert output")
        wmul = sole_consumer(unsq.outputs[0], r)
        red = sole_consumer(wmul.outputs[0], r) if wmul.op_type == "Mul" else None
        axes = const(red.inputs[1]) if red is not None and red.op_type == "ReduceSum" and len(red.inputs) > 1 else None
        if axes is None or list(np.ravel(axes)) != [1] or attr(red, "keepdims", 1) != 0:
            raise Refuse(r, "expert outputs are not summed over the k")
        ye = wmul.inputs[0] if wmul.inputs[1] is unsq.outputs[0] else wmul.inputs[1]
        # experts: gathered stacked weights, SiTU
        r = "experts_form"

        def expert(v: ir.Value, eq: str) -> tuple[ir.Value, ir.Value]:
            e = producer(v, "Einsum", r)
            if _eq(e) != eq:
                raise Refuse(r, _eq(e))
            gnd = producer(e.inputs[1], "GatherND", r)
            wst = const(gnd.inputs[0])
            ui = gnd.inputs[1].producer()
            if wst is None or wst.ndim != 3 or attr(gnd, "batch_dims", 0) != 0:
                raise Refuse(r, "expert weights are not constant and stacked [E, ., .]")
            if ui is None or ui.op_type != "Unsqueeze" or ui.inputs[0] is not idx:
                raise Refuse(r, "expert weights are not gathered at the selection")
            return e.inputs[0], gnd.inputs[0]

        h, m["w2"] = expert(ye, "nki,nkdi->nkd")
        up, gate, beta, lbeta = situ(h)
        z, m["w1"] = expert(gate, "nd,nkid->nki")
        z3, m["w3"] = expert(up, "nd,nkid->nki")
        if z3 is not z:
            raise Refuse(r, "gate and up experts read different inputs")
        m.update(situ_beta=beta, situ_linear_beta=lbeta)
        zx, m["w_down"] = _linear(model, z, "no_latent_down")
        if zx is not xf:
            raise Refuse("no_latent_down", "the latent is not projected from the router's input")
        # latent norm, up-projection, shared experts
        norm = sole_consumer(red.outputs[0], "no_latent_norm")
        if norm.op_type != "RMSNormalization" or not is_const(norm.inputs[1]) or \
                attr(norm, "axis", -1) not in (-1, 1) or (len(norm.inputs) > 2 and norm.inputs[2] is not None):
            raise Refuse("no_latent_norm")
        m.update(norm_w=norm.inputs[1], eps=float(attr(norm, "epsilon", 1e-5)))
        upn = sole_consumer(norm.outputs[0], "no_latent_up")
        if upn.op_type not in ("Gemm", "MatMul"):
            raise Refuse("no_latent_up")
        _, m["w_up"] = _linear(model, upn.outputs[0], "no_latent_up")
        r = "no_shared_experts"
        out = sole_consumer(upn.outputs[0], r)
        if out.op_type != "Add":
            raise Refuse(r)
        sh = out.inputs[1] if out.inputs[0] is upn.outputs[0] else out.inputs[0]
        sh_h, m["shared_down"] = _linear(model, sh, r)
        try:
            s_up, s_gate, s_beta, s_lbeta = situ(sh_h)
        except Refuse as e:
            raise Refuse(r, e.detail) from None
        if (s_beta, s_lbeta) != (beta, lbeta):
            raise Refuse("activation", "shared and routed experts use different SiTU betas")
        ux, m["shared_up"] = _linear(model, s_up, r)
        gx, m["shared_gate"] = _linear(model, s_gate, r)
        if ux is not xf or gx is not xf:
            raise Refuse(r, "shared experts do not read the router's input")
        m["out"] = out.outputs[0]
        return m

    def rewrite(self, model, topk, m):
        b = Builder(model.graph, topk, self.rule)
        y = b.op("MoE", [m[n] for n in ("x", "router_w", "router_bias", "w_down", "w1", "w3", "w2", "norm_w", "w_up",
                                        "shared_gate", "shared_up", "shared_down")],
                 {a: m[a] for a in ("top_k", "renormalize", "scaling", "situ_beta", "situ_linear_beta", "eps")},
                 domain=DOMAIN)
        ir.convenience.replace_all_uses_with(m["out"], y)


PASS = FuseMoEPass
