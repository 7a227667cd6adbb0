"""kimi.KDA: one Kimi Delta Attention layer: q/k/v projections, causal depthwise short convs + SiLU over the carried
window, L2-normalised q/k, safe gate, beta, masking of padding rows, the gated delta rule, per-head RMSNorm times the
sigmoid output gate, and the output projection.

Inputs   x [B,T,hidden] (the normed hidden states), conv_state [B,W-1,3P] (last W-1 inputs of the q‖k‖v convs),
         state [B,H,D,D] fp32, lengths [B] int64 (valid new rows; rows t >= lengths[b] are padding),
         w_q, w_k, w_v [hidden,P] (y = x @ w), conv_q, conv_k, conv_v [P,1,W] (depthwise Conv1d weights),
         w_f_a [hidden,D], w_f_b [D,P], w_b [hidden,H], w_g [hidden,P], A_log [H], dt_bias [H,D] (or [P]),
         o_norm [D], w_o [P,hidden]                                                      (P = H*D)
Outputs  out [B,T,hidden], new_conv_state [B,W-1,3P], new_state [B,H,D,D]
Attrs    lower_bound (safe-gate bound, < 0), scale (q scale, D^-0.5), l2_eps (inside the q/k L2 norm, 1e-6),
         eps (o_norm RMSNorm epsilon), chunk_size (0 = recurrent decode form, > 0 = chunked prefill form; same
         numbers up to rounding: the ONNX body always runs the recurrence as a Scan, for any T)
Math     u = x @ w_{q,k,v};  c = [conv_state ‖ u] (along T);  y[t] = silu(sum_j conv[:, 0, j] * c[t + j]);
         q = y_q / sqrt(|y_q|^2 + l2_eps) * scale,  k = y_k / sqrt(|y_k|^2 + l2_eps)   (per head);
         g = lower_bound * sigmoid(exp(A_log)[h] * ((x @ w_f_a @ w_f_b) + dt_bias));  beta = sigmoid(x @ w_b);
         g, beta = 0 on padding rows (the state is left untouched there);
         o, new_state = gated delta rule (kimi.KDARecurrence) over (q, k, v, g, beta, state);
         out = (RMSNorm_D(o) * o_norm * sigmoid(x @ w_g)) @ w_o;  new_conv_state = c[b, lengths[b] : lengths[b]+W-1].
"""

from __future__ import annotations

from onnx import TensorProto

from kimi_compile.ops import OpDef, TensorType, register

from . import body, reference
from .body import ATTRS, INPUTS, NAME, OUTPUTS


def infer(types, attrs):
    x, conv_state, state = types[0], types[1], types[2]
    # out in x's dtype, the conv state in its own (bf16 in a bf16 graph), the recurrent state float32
    return [TensorType(x.shape if x else None, x.dtype if x else TensorProto.FLOAT),
            TensorType(conv_state.shape if conv_state else None, conv_state.dtype if conv_state else TensorProto.FLOAT),
            TensorType(state.shape if state else None, TensorProto.FLOAT)]


OP = register(OpDef(NAME, INPUTS, OUTPUTS, dict(ATTRS), function=body.kda, infer=infer, reference=reference.kda,
                    doc=__doc__, float32_ports=frozenset({"state", "new_state"}), kind="fused"))
