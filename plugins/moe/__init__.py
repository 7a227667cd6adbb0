"""kimi.MoE: the latent MoE block: sigmoid router with a correction bias used for selection only, top-k, renormalised
and scaled weights, routed experts in the latent (down-proj, stacked experts with SiTU, weighted sum, RMSNorm,
up-proj), plus the shared experts on x.

Inputs   x [..., hidden] (N = product of the leading dims), router_w [E,hidden], router_bias [E],
         w_down [L,hidden], w1 [E,I,L] (gate), w3 [E,I,L] (up), w2 [E,L,I] (down), norm_w [L], w_up [hidden,L],
         shared_gate [Is,hidden], shared_up [Is,hidden], shared_down [hidden,Is]
         (2-D weights in nn.Linear layout [out, in]: y = x @ w^T)
Output   y [..., hidden]
Attrs    top_k, renormalize (1: weights / their sum over the k), scaling (routed scaling factor),
         situ_beta, situ_linear_beta (0 = the up branch is linear), eps (latent RMSNorm epsilon)
Math     s = sigmoid(x @ router_w^T);  idx = topk(s + router_bias, k) (ties to the lower expert);
         w = s[idx] (/ sum_k s[idx] if renormalize) * scaling;
         act(u, g) = situ_beta*tanh(g/situ_beta)*sigmoid(g) * (situ_linear_beta*tanh(u/situ_linear_beta) or u);
         z = x @ w_down^T;  r = sum_k w_k * w2[e_k] act(w3[e_k] z, w1[e_k] z);
         y = RMSNorm(r) * norm_w @ w_up^T + shared_down act(shared_up x, shared_gate x).

kimi.MoEExperts: the routed part of kimi.MoE up to the latent sum r, over the experts one rank holds (expert
parallelism, passes/partition_tp.py): the router is whole (all E experts compete), the expert weights are the held
slice. Summing r over the ranks that hold every expert (kimi.AllReduce) gives kimi.MoE's r.
Inputs   x [..., hidden], router_w [E,hidden], router_bias [E], w_down [L,hidden], w1 [El,I,L], w3 [El,I,L],
         w2 [El,L,I] (El experts: global ids expert_offset .. expert_offset+El-1; I may be a slice of the
         intermediate dim, so r is then a partial sum as well)
Output   r [..., L] = sum over k with e_k held of w_k * w2[e_k] act(w3[e_k] z, w1[e_k] z), z = x @ w_down^T
Attrs    top_k, renormalize, scaling, situ_beta, situ_linear_beta as kimi.MoE; expert_offset
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference
from .body import ATTRS, EXPERTS_ATTRS, EXPERTS_INPUTS, EXPERTS_NAME, EXPERTS_OUTPUTS, INPUTS, NAME, OUTPUTS


def infer(types, attrs):
    x = types[0]
    return [TensorType(x.shape if x else None, x.dtype if x else TensorProto.FLOAT)]  # y in x's dtype


OP = register(OpDef(NAME, INPUTS, OUTPUTS, dict(ATTRS), function=body.moe, infer=infer, reference=reference.moe,
                    doc=__doc__, kind="fused"))


def infer_experts(types, attrs):
    x, w_down = types[0], types[3]
    shape = None
    if x and x.shape and w_down and w_down.shape:
        shape = (*x.shape[:-1], w_down.shape[0])
    return [TensorType(shape, x.dtype if x else TensorProto.FLOAT)]  # r in x's dtype


EXPERTS = register(OpDef(EXPERTS_NAME, EXPERTS_INPUTS, EXPERTS_OUTPUTS, dict(EXPERTS_ATTRS), function=body.moe_experts,
                         infer=infer_experts, reference=reference.moe_experts, doc=__doc__, kind="fused"))
