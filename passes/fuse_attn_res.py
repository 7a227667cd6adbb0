"""fuse_attn_res: Block Attention Residual mixes -> two stages (kimi.AttnResStage1 once per bank state,
kimi.AttnResMerge per mixing point, fused with the RMSNorm that follows the mix).

    before (each mixing point: before attention, before the FFN, and the final mix):
        stack = Concat[axis=0](Unsqueeze(b_0), ..., Unsqueeze(b_{n-1}), Unsqueeze(partial))
        alpha = Softmax[axis=0](Mul(MatMul(stack, w_eff), Reciprocal(Sqrt(Add(ReduceMean(Pow(stack, 2)), eps)))))
        mix   = ReduceSum[axis=0](Mul(Unsqueeze(alpha, -1), stack));  out = RMSNormalization(mix, norm_w)
    after (mixing points grouped by their finished sources b_0..b_{n-1}):
        o1, m1, l1 = kimi.AttnResStage1[eps](Concat(b_0..b_{n-1}), W_group)      once per group
        out        = kimi.AttnResMerge[slot, eps, norm_eps](o1, m1, l1, partial, w_eff, norm_w)   per point

Refusals: no_logit_scale, stack_mismatch, not_a_stack, query_not_constant, eps_not_constant, no_weighted_sum,
no_following_norm.
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from kimi_compile.ops import DOMAIN
from kimi_compile.rewrite import Builder, FusionPass, Refuse, attr, const, consumers, is_const, producer, weight_like


class FuseAttnResPass(FusionPass):
    name = "fuse_attn_res"
    version = 1
    rule = "fuse_attn_res"
    rewrite_each = False

    def anchors(self, model):
        return [n for n in model.graph if n.op_type == "Softmax" and n.domain == "" and attr(n, "axis", -1) == 0]

    def match(self, model, sm):
        mul = producer(sm.inputs[0], "Mul", "no_logit_scale")
        a, b = (x.producer() for x in mul.inputs)
        if a is None or b is None:
            raise Refuse("no_logit_scale")
        mm, rec = (a, b) if a.op_type == "MatMul" else (b, a)
        if mm.op_type != "MatMul" or rec.op_type != "Reciprocal":
            raise Refuse("no_logit_scale", f"{a.op_type} * {b.op_type}")
        stack = mm.inputs[0]
        w_eff = const(mm.inputs[1])
        if w_eff is None or w_eff.ndim != 1:
            raise Refuse("query_not_constant")
        add = producer(producer(rec.inputs[0], "Sqrt", "no_logit_scale").inputs[0], "Add", "no_logit_scale")
        mean = producer(add.inputs[0], "ReduceMean", "no_logit_scale")
        eps = const(add.inputs[1])
        if eps is None:
            raise Refuse("eps_not_constant")
        pw = producer(mean.inputs[0], ("Pow", "Mul"), "no_logit_scale")
        if pw.inputs[0] is not stack:
            raise Refuse("stack_mismatch", "the RMS is not taken over the mixed sources")
        cat = producer(stack, "Concat", "not_a_stack")
        if attr(cat, "axis") != 0:
            raise Refuse("not_a_stack")
        sources = [producer(v, "Unsqueeze", "not_a_stack").inputs[0] for v in cat.inputs]
        uses = consumers(sm.outputs[0])
        if len(uses) != 1 or uses[0].op_type != "Unsqueeze":
            raise Refuse("no_weighted_sum")
        wmul = consumers(uses[0].outputs[0])
        if len(wmul) != 1 or wmul[0].op_type != "Mul" or stack not in wmul[0].inputs:
            raise Refuse("no_weighted_sum")
        red = consumers(wmul[0].outputs[0])
        if len(red) != 1 or red[0].op_type != "ReduceSum" or list(np.ravel(const(red[0].inputs[1]))) != [0]:
            raise Refuse("no_weighted_sum")
        mix = red[0].outputs[0]
        norm = consumers(mix)
        if len(norm) != 1 or norm[0].op_type != "RMSNormalization" or not is_const(norm[0].inputs[1]):
            raise Refuse("no_following_norm", "the mix feeds something other than one RMSNorm")
        return dict(bank=sources[:-1], partial=sources[-1], w=w_eff, eps=float(np.ravel(eps)[0]), cat=cat,
                    norm=norm[0])

    def rewrite_all(self, model, found):
        order = {id(n): i for i, n in enumerate(model.graph)}
        groups: dict[tuple, list] = {}
        for node, m in found:
            groups.setdefault(tuple(id(v) for v in m["bank"]), []).append(m)
        for group in groups.values():
            group.sort(key=lambda m: order[id(m["cat"])])
            first = group[0]
            b = Builder(model.graph, first["cat"], self.rule)
            ax0 = b.const([0], np.int64)
            bank = b.op("Concat", [b.op("Unsqueeze", [v, ax0]) for v in first["bank"]], {"axis": 0})
            queries = weight_like(model, None, np.stack([m["w"] for m in group]), "attn_res_queries")
            o1, m1, l1 = b.op("AttnResStage1", [bank, queries], {"eps": first["eps"]}, domain=DOMAIN, num_outputs=3)
            for slot, m in enumerate(group):
                nb = Builder(model.graph, m["norm"], self.rule)
                q = weight_like(model, None, m["w"], "attn_res_query")
                out = nb.op("AttnResMerge", [o1, m1, l1, m["partial"], q, m["norm"].inputs[1]],
                            {"slot": slot, "eps": m["eps"], "norm_eps": float(attr(m["norm"], "epsilon", 1e-5))},
                            domain=DOMAIN)
                ir.convenience.replace_all_uses_with(m["norm"].outputs[0], out)


PASS = FuseAttnResPass
