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
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference
from .body import ATTRS, INPUTS, NAME, OUTPUTS


def infer(types, attrs):
    x = types[0]
    return [TensorType(x.shape if x else None, TensorProto.FLOAT)]


OP = register(OpDef(NAME, INPUTS, OUTPUTS, dict(ATTRS), function=body.moe, infer=infer, reference=reference.moe,
                    doc=__doc__, kind="fused"))
