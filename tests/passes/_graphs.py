"""Small graphs with the cache signature of a traced MLA layer (for the pass tests)."""

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h

from kimi_compile.verify import ort_run
from kimi_compile.functions import attach_functions

NB, BS, B, MB, N = 5, 4, 2, 2, 6


def mla_layer(*, kv_dims=(16, 8), ik=32, gather_to="Einsum", weight=(64, 48), extra_pool_use=False,
              ik_last=None) -> ir.Model:
    """index_k.3 / kv.3 pools written by kimi.PagedWrite and read by kimi.PagedGather; the index-K read meets q_I in
    an Einsum (the score contraction); x @ W a projection."""
    L = sum(kv_dims)
    ik_shape = [NB, BS, ik_last if ik_last is not None else ik]
    inputs = [h.make_tensor_value_info("index_k.3", T.FLOAT, ik_shape),
              h.make_tensor_value_info("kv.3", T.FLOAT, [NB, BS, L]),
              h.make_tensor_value_info("slots", T.INT64, [N]),
              h.make_tensor_value_info("block_table", T.INT64, [B, MB]),
              h.make_tensor_value_info("k", T.FLOAT, [N, ik]),
              h.make_tensor_value_info("q", T.FLOAT, [B, 3, ik]),
              h.make_tensor_value_info("lat", T.FLOAT, [N, kv_dims[0]]),
              h.make_tensor_value_info("rope", T.FLOAT, [N, kv_dims[1]]),
              h.make_tensor_value_info("x", T.FLOAT, [B, weight[0]])]
    w = np.random.default_rng(1).standard_normal(weight).astype(np.float32)
    nodes = [h.make_node("Concat", ["lat", "rope"], ["kv_vals"], axis=-1),
             h.make_node("PagedWrite", ["kv.3", "slots", "kv_vals"], ["kv.3.out"], domain="kimi"),
             h.make_node("PagedGather", ["kv.3.out", "block_table"], ["kv_seq"], domain="kimi"),
             h.make_node("Identity", ["kv_seq"], ["kv_read"]),
             h.make_node("PagedWrite", ["index_k.3", "slots", "k"], ["index_k.3.out"], domain="kimi"),
             h.make_node("PagedGather", ["index_k.3.out", "block_table"], ["ik_seq"], domain="kimi"),
             h.make_node("MatMul", ["x", "W"], ["proj"])]
    if gather_to == "Einsum":
        nodes.append(h.make_node("Einsum", ["q", "ik_seq"], ["scores"], equation="bhd,bsd->bhs"))
    else:
        nodes.append(h.make_node("ReduceSum", ["ik_seq"], ["scores"], keepdims=0))
    score_shape = [B, 3, MB * BS] if gather_to == "Einsum" else []
    outputs = [h.make_tensor_value_info("scores", T.FLOAT, score_shape),
               h.make_tensor_value_info("kv_read", T.FLOAT, [B, MB * BS, L]),
               h.make_tensor_value_info("proj", T.FLOAT, [B, weight[1]])]
    outputs += [h.make_tensor_value_info("kv.3.out", T.FLOAT, [NB, BS, L]),
                h.make_tensor_value_info("index_k.3.out", T.FLOAT, ik_shape)]
    if extra_pool_use:
        nodes.append(h.make_node("Identity", ["index_k.3"], ["pool_copy"]))
        outputs.append(h.make_tensor_value_info("pool_copy", T.FLOAT, ik_shape))
    g = h.make_graph(nodes, "layer", inputs, outputs, [onnx.numpy_helper.from_array(w, "W")])
    proto = h.make_model(g, opset_imports=[h.make_opsetid("", 23), h.make_opsetid("kimi", 1)])
    m = ir.serde.deserialize_model(proto)
    attach_functions(m)
    return m


def feeds_for(m: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Random activations, zero pools of the graph's own dtypes, distinct slots, a block table over blocks 1..4."""
    rng = np.random.default_rng(seed)
    out = {}
    for v in m.graph.inputs:
        shape = [int(d) for d in v.shape]
        if v.name == "slots":
            out[v.name] = rng.permutation(np.arange(BS, NB * BS))[:N].astype(np.int64)
        elif v.name == "block_table":
            out[v.name] = np.array([[1, 2], [3, 4]], np.int64)
        elif "." in v.name:
            out[v.name] = np.zeros(shape, v.dtype.numpy())
        else:
            out[v.name] = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 300.0], shape)).astype(np.float32)
    return out


def run(m: ir.Model, feeds) -> dict[str, np.ndarray]:
    return ort_run(m, feeds)


def ops(m: ir.Model) -> dict[str, int]:
    hist: dict[str, int] = {}
    for n in m.graph:
        k = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
        hist[k] = hist.get(k, 0) + 1
    return dict(sorted(hist.items()))
