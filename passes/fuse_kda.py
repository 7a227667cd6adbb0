"""fuse_kda: one Kimi Delta Attention layer around the kimi.KDARecurrence primitive -> kimi.KDA.

    before (per KDA layer; prefill chunk_size > 0, decode chunk_size = 0):
        cs_q, cs_k, cs_v = Split[axis=2](conv_state)
        c_q  = Concat[axis=1](cs_q, MatMul(x, w_q))                     (likewise k, v)
        y_q  = Mul(t, Sigmoid(t)),  t = Transpose(Conv[group=P](Transpose(c_q), conv_q))
        q    = Mul(Mul(Reshape(y_q), Reciprocal(Sqrt(Add(ReduceSum(Pow(., 2)), l2_eps)))), scale)   (k: no scale)
        g    = Mul(Mul(Sigmoid(Mul(exp(A_log), Add(Reshape(MatMul(MatMul(x, w_f_a), w_f_b)), dt_bias))), lb), valid)
        beta = Mul(Sigmoid(MatMul(x, w_b)), valid)            valid = Cast(Less(arange(T), Unsqueeze(lengths)))
        o, new_state = kimi.KDARecurrence[chunk_size](q, k, Reshape(y_v), g, beta, state)
        out  = MatMul(Reshape(Mul(RMSNormalization(o, o_norm), Sigmoid(Reshape(MatMul(x, w_g))))), w_o)
        new_conv_state = Concat[axis=-1](GatherElements[axis=1](c_{q,k,v}, Expand(lengths + arange(W-1))))
    after:
        out, new_conv_state, new_state = kimi.KDA[lower_bound, scale, l2_eps, eps, chunk_size](
            x, conv_state, state, lengths, w_q, w_k, w_v, conv_q, conv_k, conv_v, w_f_a, w_f_b, w_b, w_g, A_log,
            dt_bias, o_norm, w_o)
    (exp(A_log) traced as a folded constant becomes a new initializer A_log = log(.), named by content.)

Refusals (counted as `refused.<reason>`): no_l2norm, no_conv, no_projection, conv_window, no_valid_mask, gate_form,
beta_form, no_output_norm, no_output_gate, no_output_proj.
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.rewrite import (
    Builder,
    FusionPass,
    Refuse,
    attr,
    const,
    consumers,
    is_const,
    producer,
    sole_consumer,
    weight_like,
)


def _through(v: ir.Value, *ops: str) -> ir.Value:
    while v.producer() is not None and v.producer().op_type in ops and v.producer().domain == "":
        v = v.producer().inputs[0]
    return v


def _binary_const(n: ir.Node) -> tuple[ir.Value, np.ndarray] | None:
    """(the non-constant operand, the constant operand) of a binary node, else None."""
    a, b = n.inputs[0], n.inputs[1]
    if is_const(b) and not is_const(a):
        return a, const(b)
    if is_const(a) and not is_const(b):
        return b, const(a)
    return None


def _scalar(arr: np.ndarray | None, reason: str) -> float:
    if arr is None or np.size(arr) != 1:
        raise Refuse(reason, "expected a constant scalar")
    return float(np.ravel(arr)[0])


def _linear(v: ir.Value, reason: str) -> tuple[ir.Value, ir.Value]:
    """v = MatMul(x, w) with w constant -> (x, w)."""
    mm = producer(_through(v, "Reshape"), "MatMul", reason)
    if not is_const(mm.inputs[1]):
        raise Refuse(reason, f"weight of {mm.name!r} is not constant")
    return mm.inputs[0], mm.inputs[1]


def _l2norm(v: ir.Value) -> tuple[ir.Value, float]:
    """v = Mul(x, Reciprocal(Sqrt(Add(ReduceSum[-1, keepdims](Pow(x, 2)), eps)))) -> (x, eps)."""
    r = "no_l2norm"
    mul = producer(v, "Mul", r)
    for x, rv in (mul.inputs, mul.inputs[::-1]):
        rp = rv.producer()
        if rp is not None and rp.op_type == "Reciprocal":
            break
    else:
        raise Refuse(r, f"{mul.name!r} does not multiply by a reciprocal norm")
    add = producer(producer(rp.inputs[0], "Sqrt", r).inputs[0], "Add", r)
    split = _binary_const(add)
    if split is None:
        raise Refuse(r, "no constant epsilon in the norm")
    red = producer(split[0], "ReduceSum", r)
    axes = const(red.inputs[1]) if len(red.inputs) > 1 else None
    if axes is None or list(np.ravel(axes)) not in ([-1], [3]) or attr(red, "keepdims", 1) != 1:
        raise Refuse(r, "the norm does not reduce the head dim")
    pw = producer(red.inputs[0], "Pow", r)
    if pw.inputs[0] is not x or _scalar(const(pw.inputs[1]), r) != 2.0:
        raise Refuse(r, "the norm is not of the normalised tensor")
    return x, _scalar(split[1], r)


def _conv(v: ir.Value) -> dict:
    """v = silu(causal depthwise conv over Concat(conv_state part, MatMul(x, w))) -> its parts."""
    r = "no_conv"
    mul = producer(v, "Mul", r)
    for y, s in (mul.inputs, mul.inputs[::-1]):
        sp = s.producer()
        if sp is not None and sp.op_type == "Sigmoid" and sp.inputs[0] is y:
            break
    else:
        raise Refuse(r, "no SiLU after the conv")
    t2 = producer(y, "Transpose", r)
    conv = producer(t2.inputs[0], "Conv", r)
    t1 = producer(conv.inputs[0], "Transpose", r)
    if list(attr(t1, "perm", [])) != [0, 2, 1] or list(attr(t2, "perm", [])) != [0, 2, 1]:
        raise Refuse(r, "conv is not over the time axis")
    w = const(conv.inputs[1])
    if w is None or w.ndim != 3 or w.shape[1] != 1 or attr(conv, "group", 1) != w.shape[0]:
        raise Refuse(r, "not a depthwise conv with constant weights")
    if (len(conv.inputs) > 2 and conv.inputs[2] is not None) or any(p != 0 for p in attr(conv, "pads", [0, 0])) or \
            any(s != 1 for s in attr(conv, "strides", [1])) or any(d != 1 for d in attr(conv, "dilations", [1])) or \
            attr(conv, "auto_pad", "NOTSET") != "NOTSET":
        raise Refuse(r, "conv has a bias, padding, stride or dilation")
    cat = producer(t1.inputs[0], "Concat", r)
    if len(cat.inputs) != 2 or attr(cat, "axis") != 1:
        raise Refuse(r, "conv input is not [conv_state ‖ u]")
    split = producer(cat.inputs[0], "Split", r)
    if attr(split, "axis") not in (2, -1) or len(split.outputs) != 3 or len(split.inputs) > 1:
        raise Refuse(r, "conv state is not split in three equal q‖k‖v parts")
    x, wp = _linear(cat.inputs[1], "no_projection")
    return dict(x=x, w=wp, conv_w=conv.inputs[1], W=int(w.shape[2]), cat=cat.outputs[0], conv_state=split.inputs[0],
                part=list(split.outputs).index(cat.inputs[0]))


def _lengths_of(v: ir.Value, graph: ir.Graph, reason: str) -> ir.Value:
    root = _through(v, "Reshape", "Unsqueeze", "Cast")
    if root not in graph.inputs:
        raise Refuse(reason, f"{root.name!r} is not a graph input")
    return root


def _mask(v: ir.Value, graph: ir.Graph) -> ir.Value:
    """v = Cast(Reshape(Less(arange(T), Unsqueeze(lengths)))) -> lengths."""
    r = "no_valid_mask"
    less = producer(_through(v, "Reshape", "Unsqueeze", "Cast"), "Less", r)
    pos = _through(less.inputs[0], "Unsqueeze", "Reshape")
    c = const(pos)
    if c is not None:
        if not np.array_equal(np.ravel(c), np.arange(np.size(c))):
            raise Refuse(r, "row positions are not arange(T)")
    else:
        rng = producer(pos, "Range", r)
        if _scalar(const(rng.inputs[0]), r) != 0 or _scalar(const(rng.inputs[2]), r) != 1:
            raise Refuse(r, "row positions are not arange(T)")
    return _lengths_of(less.inputs[1], graph, r)


def _masked(v: ir.Value, graph: ir.Graph) -> tuple[ir.Value, ir.Value]:
    """v = Mul(a, valid-mask) -> (a, lengths)."""
    mul = producer(v, "Mul", "no_valid_mask")
    last = None
    for a, m in (mul.inputs, mul.inputs[::-1]):
        try:
            return a, _mask(m, graph)
        except Refuse as e:
            last = e
    raise last


def take_over(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Every use of `old` (graph outputs included, keeping their names) now reads `new`."""
    name, is_out = old.name, old in graph.outputs
    if new.type is None:
        new.type, new.shape = old.type, old.shape
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if is_out:
        old.name = None
        new.name = name


class FuseKDAPass(FusionPass):
    name = "fuse_kda"
    version = 1
    rule = "fuse_kda"

    def anchors(self, model):
        return [n for n in model.graph if n.op_type == "KDARecurrence" and n.domain == DOMAIN]

    def match(self, model, rec):
        g = model.graph
        q, k, v, gate, beta, state = rec.inputs
        m = dict(state=state, chunk_size=int(attr(rec, "chunk_size", 0)))
        # q = l2norm(.) * scale, k = l2norm(.)
        mul = producer(q, "Mul", "no_l2norm")
        split = _binary_const(mul)
        if split is not None and np.size(split[1]) == 1:
            q, m["scale"] = split[0], float(np.ravel(split[1])[0])
        else:
            m["scale"] = 1.0
        q4, m["l2_eps"] = _l2norm(q)
        k4, k_eps = _l2norm(k)
        if k_eps != m["l2_eps"]:
            raise Refuse("no_l2norm", "q and k norms use different epsilons")
        convs = [_conv(producer(t, "Reshape", "no_conv").inputs[0]) for t in (q4, k4, v)]
        x = convs[0]["x"]
        if any(c["x"] is not x for c in convs) or [c["part"] for c in convs] != [0, 1, 2] or \
                any(c["conv_state"] is not convs[0]["conv_state"] for c in convs):
            raise Refuse("no_projection", "q/k/v convs do not read one x and the q‖k‖v parts of one conv state")
        m.update(x=x, conv_state=convs[0]["conv_state"], w_qkv=[c["w"] for c in convs],
                 conv_w=[c["conv_w"] for c in convs])
        W = convs[0]["W"]
        # safe gate and beta, masked by the valid rows
        g0, lengths = _masked(gate, g)
        b0, b_len = _masked(beta, g)
        if b_len is not lengths:
            raise Refuse("no_valid_mask", "g and beta are masked by different lengths")
        m["lengths"] = lengths
        r = "gate_form"
        lbm = producer(g0, "Mul", r)
        split = _binary_const(lbm)
        if split is None:
            raise Refuse(r, "no constant lower bound")
        m["lower_bound"] = _scalar(split[1], r)
        am = producer(producer(split[0], "Sigmoid", r).inputs[0], "Mul", r)
        a_v, fb_v = am.inputs
        if not is_const(a_v) and (a_v.producer() is None or a_v.producer().op_type != "Exp"):
            a_v, fb_v = fb_v, a_v
        if is_const(a_v):
            a_log = np.log(const(a_v).astype(np.float64)).reshape(-1)
            m["A_log"] = None, a_log
        else:
            ex = producer(a_v, "Exp", r)
            if not is_const(ex.inputs[0]):
                raise Refuse(r, "A_log is not constant")
            m["A_log"] = ex.inputs[0], None
        add = producer(fb_v, "Add", r)
        split = _binary_const(add)
        if split is None:
            raise Refuse(r, "no constant dt_bias")
        f_v = [vv for vv in add.inputs if not is_const(vv)][0]
        m["dt_bias"] = [vv for vv in add.inputs if is_const(vv)][0]
        fa_out, m["w_f_b"] = _linear(f_v, r)
        fx, m["w_f_a"] = _linear(fa_out, r)
        if fx is not x:
            raise Refuse(r, "the gate does not read the layer input")
        bx, m["w_b"] = _linear(producer(b0, "Sigmoid", "beta_form").inputs[0], "beta_form")
        if bx is not x:
            raise Refuse("beta_form", "beta does not read the layer input")
        # new conv window: GatherElements of each [conv_state ‖ u] at lengths + arange(W-1), concatenated q‖k‖v
        gathers = []
        for c in convs:
            ge = [n for n in consumers(c["cat"]) if n.op_type == "GatherElements" and attr(n, "axis") == 1]
            if len(ge) != 1:
                raise Refuse("conv_window", "no gather of the new conv window")
            idx = producer(ge[0].inputs[1], "Expand", "conv_window").inputs[0]
            add = producer(_through(idx, "Unsqueeze", "Reshape"), "Add", "conv_window")
            split = _binary_const(add)
            if split is None or not np.array_equal(np.ravel(split[1]), np.arange(W - 1)) or \
                    _lengths_of(split[0], g, "conv_window") is not lengths:
                raise Refuse("conv_window", "window rows are not lengths + arange(W-1)")
            gathers.append(ge[0].outputs[0])
        cat = sole_consumer(gathers[0], "conv_window")
        if cat.op_type != "Concat" or list(cat.inputs) != gathers or attr(cat, "axis") not in (-1, 2):
            raise Refuse("conv_window", "the new windows are not concatenated q‖k‖v")
        m["new_conv"] = cat.outputs[0]
        # output: RMSNorm(o) * sigmoid(gate) -> o_proj
        norm = sole_consumer(rec.outputs[0], "no_output_norm")
        if norm.op_type != "RMSNormalization" or attr(norm, "axis", -1) not in (-1, 3) or \
                not is_const(norm.inputs[1]) or (len(norm.inputs) > 2 and norm.inputs[2] is not None):
            raise Refuse("no_output_norm", f"{rec.outputs[0].name!r} is not RMS-normalised per head")
        m.update(o_norm=norm.inputs[1], eps=float(attr(norm, "epsilon", 1e-5)))
        gm = sole_consumer(norm.outputs[0], "no_output_gate")
        if gm.op_type != "Mul":
            raise Refuse("no_output_gate")
        sg = gm.inputs[1] if gm.inputs[0] is norm.outputs[0] else gm.inputs[0]
        gx, m["w_g"] = _linear(producer(sg, "Sigmoid", "no_output_gate").inputs[0], "no_output_gate")
        if gx is not x:
            raise Refuse("no_output_gate", "the output gate does not read the layer input")
        rs = sole_consumer(gm.outputs[0], "no_output_proj")
        proj = sole_consumer(rs.outputs[0], "no_output_proj") if rs.op_type == "Reshape" else None
        if proj is None or proj.op_type != "MatMul" or proj.inputs[0] is not rs.outputs[0] or \
                not is_const(proj.inputs[1]):
            raise Refuse("no_output_proj")
        m.update(w_o=proj.inputs[1], out=proj.outputs[0])
        H, D = np.size(const(m["A_log"][0]) if m["A_log"][1] is None else m["A_log"][1]), np.size(const(m["o_norm"]))
        if np.size(const(m["dt_bias"])) != H * D:
            raise Refuse("gate_form", f"dt_bias has {np.size(const(m['dt_bias']))} values, expected {H}*{D}")
        return m

    def rewrite(self, model, rec, m):
        b = Builder(model.graph, rec, self.rule)
        a_log = m["A_log"][0] if m["A_log"][1] is None else weight_like(model, None, m["A_log"][1], "A_log")
        out, new_conv, new_state = b.op(
            "KDA", [m["x"], m["conv_state"], m["state"], m["lengths"], *m["w_qkv"], *m["conv_w"], m["w_f_a"],
                    m["w_f_b"], m["w_b"], m["w_g"], a_log, m["dt_bias"], m["o_norm"], m["w_o"]],
            {"lower_bound": m["lower_bound"], "scale": m["scale"], "l2_eps": m["l2_eps"], "eps": m["eps"],
             "chunk_size": m["chunk_size"]}, domain=DOMAIN, num_outputs=3)
        g = model.graph
        take_over(g, m["out"], out)
        take_over(g, m["new_conv"], new_conv)
        take_over(g, rec.outputs[1], new_state)


PASS = FuseKDAPass
