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

Written with onnxscript's rewriter (`onnxscript.rewriter.pattern`): `_block` generates the pattern of each `Variant`
(renormalised or not, scaled or not, tanh-capped or linear routed up branch: 8 variants), one `RewriteRule` per variant
and operand order of the root `Add` (16 rules; the matcher starts from one node, so the root cannot be an `OrValue`).
Inside a rule, `OrValue` covers what does not change the attributes: either operand order of the other Adds / Muls, a
linear as `Gemm` or `MatMul`, the `+ eps` in the renormalisation and the shared experts' up branch (capped or linear,
checked equal to the routed one). `_check` (the rules' condition) holds the constant checks (k, bias, linear and
stacked expert weights, SiTU betas), each refusing with its reason. The fused node is placed before the TopK and the
matched nodes are left to dead-node removal, as the walk did (the artifact is the same).

Near misses are reported per router candidate (each `TopK`), as the walk did: the block is cut into stages (`STAGES`,
the walk's order) and each variant's prefix pattern (the block up to a stage, `_block(upto=...)`, with the conditions
so far) is matched; a TopK that no rule fused is refused at the furthest stage any variant reaches through it, with
that stage's reason or the one its condition gave. A TopK whose whole block matches but is not fused (a value inside
the block is read outside it) is counted as `no_match`.

Refusals (counted as `refused.<reason>`): non_constant_k, router_not_sigmoid, bias_not_constant, router_not_linear,
weights_not_scores, renormalize_form, no_weighted_sum, experts_form, activation, no_latent_down, no_latent_norm,
no_latent_up, no_shared_experts.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern as orp

from kimi_compile.ops import DOMAIN
from kimi_compile.passes.fuse_kda import _binary_const, _scalar
from kimi_compile.rewrite import FusionPass, Refuse, attr, const, consumers, is_const, weight_like

# (stage, the reason a candidate that fails there is refused with), in the order the block is checked
STAGES = (("k", "non_constant_k"), ("router", "router_not_sigmoid"), ("bias", "bias_not_constant"),
          ("router_linear", "router_not_linear"), ("weights", "weights_not_scores"),
          ("renormalize", "renormalize_form"), ("weighted_sum", "no_weighted_sum"), ("down_expert", "experts_form"),
          ("activation", "activation"), ("gate_up_experts", "experts_form"), ("latent_down", "no_latent_down"),
          ("latent_norm", "no_latent_norm"), ("latent_up", "no_latent_up"), ("shared", "no_shared_experts"))
_AT = {name: i for i, (name, _) in enumerate(STAGES)}
LAST = len(STAGES) - 1
_ATTRS = ("top_k", "renormalize", "scaling", "situ_beta", "situ_linear_beta", "eps")
_INPUTS = ("x", "router_w", "router_bias", "w_down", "w1", "w3", "w2", "norm_w", "w_up", "shared_gate", "shared_up",
           "shared_down")


@dataclasses.dataclass(frozen=True)
class Variant:
    renormalize: bool  # w = gs / sum(gs)
    scaled: bool  # w = w * scaling
    capped_up: bool  # the routed SiTU's up branch is tanh-capped (situ_linear_beta > 0), else linear

    @property
    def name(self) -> str:
        return "fuse_moe." + ".".join(f"{k}{int(getattr(self, k))}" for k in ("renormalize", "scaled", "capped_up"))


VARIANTS = tuple(Variant(*bits) for bits in itertools.product((True, False), repeat=3))


# ---- pattern ---------------------------------------------------------------------------------------------------

def _comm(op, op_type: str, a, b):
    """op_type(a, b) with either operand order (Add / Mul)."""
    f = getattr(op, op_type)
    return orp.OrValue([f(a, b), f(b, a)])


def _linear(op, tag: str, x, w):
    """x @ w^T as Gemm(x, w) (attributes checked by `_check_linear`) or MatMul(x, w); the value is bound to tag."""
    return orp.OrValue([op.Gemm(x, w, _allow_other_inputs=True), op.MatMul(x, w)], name=f"{tag}_lin")


def _bounded(op, var, tag: str, t):
    """Mul(Tanh(Div(t, c1)), c2) (c1 == c2, checked by `_check_bounded`)."""
    return _comm(op, "Mul", op.Tanh(op.Div(t, var(f"{tag}_c1"))), var(f"{tag}_c2"))


def _situ(op, var, tag: str, up, gate, capped_up: bool | None):
    """SiTU(up, gate); capped_up None: either up branch, the one taken bound to `<tag>_capped` (1 / 0)."""
    g = _comm(op, "Mul", _bounded(op, var, f"{tag}_beta", gate), op.Sigmoid(gate))
    if capped_up is None:
        u = orp.OrValue([_bounded(op, var, f"{tag}_lbeta", up), up], tag_var=f"{tag}_capped", tag_values=[1, 0])
    else:
        u = _bounded(op, var, f"{tag}_lbeta", up) if capped_up else up
    return _comm(op, "Mul", g, u)


def _block(op, var, v: Variant, upto: int = LAST, root: int = 0):
    """The MoE block of variant v up to stage `upto` (the later stages' values are free variables); returns its root
    (the value the matcher starts from). The root is one node, not a choice: `root` picks the final Add's operand
    order (0: routed first) or, when the block ends at the latent up-projection, its op (0: Gemm, 1: MatMul)."""
    def at(stage: str) -> bool:
        return upto >= _AT[stage]

    x = var("x")
    if at("router"):
        r_in = _linear(op, "router", x, var("router_w")) if at("router_linear") else var("router_in")
        s = op.Sigmoid(r_in, _outputs=["s"])
        t_in = _comm(op, "Add", s, var("router_bias"))
    else:
        t_in = var("topk_in")
    _, idx = op.TopK(t_in, var("k"), _outputs=["topk_values", "idx"])
    if not at("weights"):
        return idx
    w = op.GatherElements(s, idx, _outputs=["gs"])
    if not at("renormalize"):
        return w
    if v.renormalize:
        rs = op.ReduceSum(w, var("renorm_axes"))
        w = op.Div(w, orp.OrValue([rs, _comm(op, "Add", rs, var("renorm_eps"))]), _outputs=["renorm_div"])
    if not at("weighted_sum"):
        return w
    if v.scaled:
        w = _comm(op, "Mul", w, var("scaling_c"))
    # the experts, inputs first: latent z, gate / up experts, SiTU, down expert
    ui = op.Unsqueeze(idx, var("gather_axes")) if at("down_expert") else None
    z = _linear(op, "down", x, var("w_down")) if at("latent_down") else var("z")
    if at("gate_up_experts"):
        gate = op.Einsum(z, op.GatherND(var("w1"), ui, _outputs=["w1_g"]), _outputs=["gate_e"])
        up = op.Einsum(z, op.GatherND(var("w3"), ui, _outputs=["w3_g"]), _outputs=["up_e"])
    else:
        gate, up = var("gate"), var("up")
    h = _situ(op, var, "r", up, gate, v.capped_up) if at("activation") else var("h")
    if at("down_expert"):
        ye = op.Einsum(h, op.GatherND(var("w2"), ui, _outputs=["w2_g"]), _outputs=["down_e"])
    else:
        ye = var("ye")
    unsq = op.Unsqueeze(w, var("weight_axes"))
    y = op.ReduceSum(_comm(op, "Mul", ye, unsq), var("sum_axes"), _outputs=["expert_sum"])
    if not at("latent_norm"):
        return y
    y = op.RMSNormalization(y, var("norm_w"), _allow_other_inputs=True, _outputs=["norm"])
    if not at("latent_up"):
        return y
    if not at("shared"):  # the root: one op
        if root == 0:
            return op.Gemm(y, var("w_up"), _allow_other_inputs=True, _outputs=["up_lin"])
        return op.MatMul(y, var("w_up"), _outputs=["up_lin"])
    y = _linear(op, "up", y, var("w_up"))
    sh = _situ(op, var, "s", _linear(op, "shared_up", x, var("shared_up")),
               _linear(op, "shared_gate", x, var("shared_gate")), None)
    sd = _linear(op, "shared_down", sh, var("shared_down"))
    return op.Add(y, sd) if root == 0 else op.Add(sd, y)


def _root_op(v: Variant, upto: int, root: int) -> str:
    """The op type of the root of `_block(v, upto, root)`."""
    if upto < _AT["weights"]:
        return "TopK"
    if upto == _AT["renormalize"]:
        return "Div" if v.renormalize else "GatherElements"
    if upto == _AT["weights"]:
        return "GatherElements"
    if upto < _AT["latent_norm"]:
        return "ReduceSum"
    if upto == _AT["latent_norm"]:
        return "RMSNormalization"
    if upto == _AT["latent_up"]:
        return ("Gemm", "MatMul")[root]
    return "Add"


def _pattern_function(v: Variant, upto: int = LAST, root: int = 0):
    """`_block` as a pattern function of named variables (what onnxscript's rewriter builds a pattern from)."""
    names: list[str] = []

    def collect(name):
        if name not in names:
            names.append(name)
        return orp.Var(name)

    op = orp.OpsetPatternBuilder("", record=True)
    with orp.pattern_builder(op):
        _block(op, collect, v, upto, root)

    def fn(op, *vars_):
        by_name = dict(zip(names, vars_))
        return _block(op, by_name.__getitem__, v, upto, root)

    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                          for n in ("op", *names)])
    return fn


# ---- check ------------------------------------------------------------------------------------------------------

def _node(b: dict, name: str) -> ir.Node:
    return b[name].producer()


def _axes(v: ir.Value | None) -> list | None:
    a = const(v)
    return None if a is None else list(np.ravel(a))


def _check_linear(b: dict, tag: str, reason: str) -> None:
    """The bound linear `tag` is x @ w^T with a constant 2-D w (Gemm: no transA, alpha 1, no bias)."""
    n = _node(b, f"{tag}_lin")
    w = const(n.inputs[1])
    if w is None or w.ndim != 2:
        raise Refuse(reason, f"weight of {n.name!r} is not a constant matrix")
    if n.op_type == "Gemm":
        if attr(n, "transA", 0) or attr(n, "alpha", 1.0) != 1.0 or (len(n.inputs) > 2 and n.inputs[2] is not None):
            raise Refuse(reason, f"{n.name!r} is not a plain x @ w^T")


def _check_bounded(b: dict, tag: str, reason: str) -> float:
    """Mul(Tanh(Div(t, c1)), c2): c2 a constant scalar, c1 the same constant -> c."""
    c1, c2 = b[f"{tag}_c1"], b[f"{tag}_c2"]
    if not is_const(c2):
        raise Refuse(reason, "no constant beta")
    c = _scalar(const(c2), reason)
    if not is_const(c1) or _scalar(const(c1), reason) != c:
        raise Refuse(reason, "tanh soft cap with two different betas")
    return c


def _check_expert(b: dict, tag: str, weight: str, eq: str) -> None:
    """Einsum[eq](., GatherND(weight, Unsqueeze(idx))) with the stacked weight constant [E, ., .]."""
    r = "experts_form"
    e = _node(b, f"{tag}_e")
    got = (attr(e, "equation") or "").replace(" ", "")
    if got != eq:
        raise Refuse(r, got)
    gnd = _node(b, f"{weight}_g")
    wst = const(gnd.inputs[0])
    if wst is None or wst.ndim != 3 or attr(gnd, "batch_dims", 0) != 0:
        raise Refuse(r, "expert weights are not constant and stacked [E, ., .]")


def _check(v: Variant, b: dict, upto: int = LAST) -> dict:
    """The conditions of variant v's block up to stage `upto`, in stage order -> the kimi.MoE attributes known so far;
    Refuse(reason) at the first that fails."""
    def at(stage: str) -> bool:
        return upto >= _AT[stage]

    a: dict = {}
    topk = _node(b, "idx")
    k = const(b["k"])
    if k is None or np.size(k) != 1 or int(np.ravel(k)[0]) <= 0:
        raise Refuse("non_constant_k")
    if attr(topk, "largest", 1) != 1 or attr(topk, "axis", -1) not in (-1, 1):
        raise Refuse("non_constant_k", "not a largest-k over the experts")
    a["top_k"] = int(np.ravel(k)[0])
    if at("bias") and not is_const(b["router_bias"]):
        raise Refuse("bias_not_constant")
    if at("router_linear"):
        _check_linear(b, "router", "router_not_linear")
    if not at("weights"):
        return a
    gs = b["gs"]
    if attr(gs.producer(), "axis", 0) not in (-1, 1):
        raise Refuse("weights_not_scores", "routing weights are not the uncorrected scores at the selection")
    if not at("renormalize"):
        return a
    r = "renormalize_form"
    if v.renormalize:
        eps = b.get("renorm_eps")
        if eps is not None and (not is_const(eps) or abs(_scalar(const(eps), r)) > 1e-12):
            raise Refuse(r, "renormalisation adds a non-negligible epsilon")
        if _axes(b["renorm_axes"]) not in ([-1], [1]):
            raise Refuse(r, "weights are not divided by their sum over the k")
        w = b["renorm_div"]
    else:
        if any(n.op_type == "Div" and n.inputs[0] is gs for n in consumers(gs)):
            raise Refuse(r, "weights are not divided by their sum over the k")
        w = gs
    a["renormalize"] = int(v.renormalize)
    if not at("weighted_sum"):
        return a
    r = "no_weighted_sum"
    if v.scaled:
        c = b["scaling_c"]
        if not is_const(c) or np.size(const(c)) != 1:
            raise Refuse(r, "weights are not scaled by a constant scalar")
        a["scaling"] = _scalar(const(c), r)
    else:
        sc = [n for n in consumers(w) if n.op_type == "Mul" and _binary_const(n) is not None]
        if sc and np.size(_binary_const(sc[0])[1]) == 1:
            raise Refuse(r, "weights are scaled")
        a["scaling"] = 1.0
    if _axes(b["weight_axes"]) not in ([-1], [2]):
        raise Refuse(r, "weights are not broadcast over the expert output")
    red = _node(b, "expert_sum")
    if _axes(b["sum_axes"]) != [1] or attr(red, "keepdims", 1) != 0:
        raise Refuse(r, "expert outputs are not summed over the k")
    if at("down_expert"):
        _check_expert(b, "down", "w2", "nki,nkdi->nkd")
    if at("activation"):
        a["situ_beta"] = _check_bounded(b, "r_beta", "activation")
        a["situ_linear_beta"] = _check_bounded(b, "r_lbeta", "activation") if v.capped_up else 0.0
    if at("gate_up_experts"):
        _check_expert(b, "gate", "w1", "nd,nkid->nki")
        _check_expert(b, "up", "w3", "nd,nkid->nki")
    if at("latent_down"):
        _check_linear(b, "down", "no_latent_down")
    if at("latent_norm"):
        norm = _node(b, "norm")
        if not is_const(norm.inputs[1]) or attr(norm, "axis", -1) not in (-1, 1) or \
                (len(norm.inputs) > 2 and norm.inputs[2] is not None):
            raise Refuse("no_latent_norm")
        a["eps"] = float(attr(norm, "epsilon", 1e-5))
    if at("latent_up"):
        _check_linear(b, "up", "no_latent_up")
    if at("shared"):
        r = "no_shared_experts"
        _check_linear(b, "shared_down", r)
        s_beta = _check_bounded(b, "s_beta", r)
        s_lbeta = _check_bounded(b, "s_lbeta", r) if b["s_capped"] else 0.0
        if (s_beta, s_lbeta) != (a["situ_beta"], a["situ_linear_beta"]):
            raise Refuse("activation", "shared and routed experts use different SiTU betas")
        _check_linear(b, "shared_up", r)
        _check_linear(b, "shared_gate", r)
    return a


# ---- replacement ------------------------------------------------------------------------------------------------

def _weight(model: ir.Model, b: dict, tag: str) -> ir.Value:
    """The weight of linear `tag` in nn.Linear layout: a Gemm[transB]'s as is, else transposed (weight_like)."""
    n = _node(b, f"{tag}_lin")
    if n.op_type == "Gemm" and attr(n, "transB", 0):
        return n.inputs[1]
    return weight_like(model, n.inputs[1], const(n.inputs[1]).T, "linear")  # a bf16-stored weight stays bf16


def _moe(op, model: ir.Model, v: Variant, b: dict) -> ir.Value:
    a = _check(v, b)
    w = {"x": b["x"], "router_bias": b["router_bias"], "w1": b["w1"], "w3": b["w3"], "w2": b["w2"],
         "norm_w": b["norm_w"]}
    for name, tag in (("router_w", "router"), ("w_down", "down"), ("w_up", "up"), ("shared_down", "shared_down"),
                      ("shared_up", "shared_up"), ("shared_gate", "shared_gate")):  # the walk's order of new weights
        w[name] = _weight(model, b, tag)
    return op.MoE(*[w[n] for n in _INPUTS], _domain=DOMAIN, **{k: a[k] for k in _ATTRS})


def _condition(v: Variant):
    def check(context, **b):
        try:
            _check(v, b)
        except Refuse as r:
            return orp.MatchResult().fail(r.reason)
        return True
    return check


# ---- pass -------------------------------------------------------------------------------------------------------

class FuseMoEPass(FusionPass):
    name = "fuse_moe"
    version = 2
    rule = "fuse_moe"

    def rules(self, model: ir.Model) -> orp.RewriteRuleSet:
        """One RewriteRule per variant and operand order of the root Add; the replacement reads the model (it adds
        the transposed weights)."""
        return orp.RewriteRuleSet([
            orp.RewriteRule(_pattern_function(v, LAST, root), lambda op, _v=v, **b: _moe(op, model, _v, b),
                            _condition(v), name=f"{v.name}.root{root}")
            for v in VARIANTS for root in (0, 1)])

    def run(self, model, stats):
        g, before = model.graph, len(model.graph)
        anchors = [n for n in g if n.op_type == "TopK" and n.domain == ""]
        fused: set[int] = set()
        ruleset = self.rules(model)
        for node in g:  # the rewriter's loop, without its model-wide constant folding and value renaming
            for rule in ruleset.rules:
                delta = rule.try_rewrite(model, g, node)
                if delta is None:
                    continue
                topk = delta.match.bindings["idx"].producer()
                fused.add(id(topk))
                for n in delta.new_nodes:
                    n.metadata_props["kimi.rule"] = self.rule
                    for key in ("namespace", "pkg.torch.onnx.class_hierarchy"):  # keep the layer attribution
                        if key in topk.metadata_props:
                            n.metadata_props[key] = topk.metadata_props[key]
                # as the walk did: the new node before the TopK, the block's output rewired, the rest left to the
                # dead-node removal in `finish` (not the rewriter's replace_nodes_and_values, which would rename the
                # new output after the old one)
                g.insert_before(topk, delta.new_nodes)
                ir.convenience.replace_all_uses_with(delta.match.outputs[0], delta.new_outputs[0])
                break
        refused: dict[str, int] = {}
        missed = [n for n in anchors if id(n) not in fused]
        for topk, (reason, detail) in zip(missed, _diagnose(model, missed)):
            self.refused(stats, refused, topk, Refuse(reason, detail))
        return self.finish(model, stats, before, len(fused), refused)


def _diagnose(model: ir.Model, missed: list[ir.Node]) -> list[tuple[str, str]]:
    """For each TopK no rule fused: (reason, detail) at the furthest stage that some variant's prefix pattern (with
    its conditions) reaches through that TopK."""
    if not missed:
        return []
    g = model.graph
    best = {id(n): (-1, STAGES[0][1], "") for n in missed}  # (stage it fails at, reason, detail)
    for v in VARIANTS:
        reached = {id(n): -1 for n in missed}  # the last stage matched through
        failed: dict[int, tuple[int, str, str]] = {}
        for i in range(len(STAGES)):
            for root in ((0, 1) if i >= _AT["latent_up"] else (0,)):
                refusal: list[tuple[Refuse, ir.Node]] = []  # what the condition refused, and for which TopK

                def check(context, _i=i, **b):
                    try:
                        _check(v, b, _i)
                    except Refuse as r:
                        refusal.append((r, b["idx"].producer()))
                        return False
                    return True

                pat = orp.Pattern(_pattern_function(v, i, root), check)
                op_type = _root_op(v, i, root)
                for node in [n for n in g if n.op_type == op_type and n.domain == ""]:
                    refusal.clear()
                    m = pat.match(model, g, node, check_nodes_are_removable=False)
                    topk = m.bindings["idx"].producer() if m else (refusal[0][1] if refusal else None)
                    if topk is None or reached.get(id(topk)) != i - 1:
                        continue
                    if m:
                        reached[id(topk)] = i
                    elif refusal:
                        failed.setdefault(id(topk), (i, refusal[0][0].reason, refusal[0][0].detail))
        for t in reached:
            if t in failed and reached[t] < failed[t][0]:
                got = failed[t]
            elif reached[t] < LAST:
                stage, reason = STAGES[reached[t] + 1]
                got = (reached[t] + 1, reason, f"no variant's pattern matches at stage {stage}")
            else:
                got = (len(STAGES), "no_match", "the block matches, but a value inside it is read outside it")
            if got[0] > best[t][0]:
                best[t] = got
    return [best[id(n)][1:] for n in missed]


PASS = FuseMoEPass
