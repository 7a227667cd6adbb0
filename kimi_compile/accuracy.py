"""Accuracy report for precision rules: quantized vs unquantized graphs on a fixed prompt set (issue 5).

`evaluate(traced, quant, cfg, block_size)` runs the traced (unquantized) prefill/decode graphs and the same graphs
after the quantize pass with ONNX Runtime, through the runtime's own Session (so new cache dtypes and scale pools
are exercised), on `PROMPTS` seeded prompts, and returns (JSON-able, into manifest["accuracy"]):

    logits_rel_err      ||q - r|| / ||r|| over every valid prefill row and decode step (teacher forced)
    kl                  mean KL(softmax(r) || softmax(q)) per position, nats; kl_max the worst position
    greedy_agreement    fraction of decode steps whose argmax agrees, quantized fed the reference's tokens
    greedy_prefix       per prompt, tokens generated free-running (greedy) before the first disagreement, of N
    recall              per indexed layer: |top-k(q) ∩ top-k(r)| / |top-k(r)| over causally valid keys, all rows
    caches              per paged cache: bytes per token before, after, bf16 (2 bytes per value) and after/bf16

kimi_compile.report renders the result into report.md. `rebase_feeds` serves --verify once a pass changed the cache
signature (quantize): it derives feeds for the new signature. Imports no torch.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

PROMPTS = 4
NEW_TOKENS = 16
FIXED = ("input_ids", "start", "lengths", "block_table")


def graph_caches(m: ir.Model) -> list[dict]:
    """The cache inputs of a graph as manifest["runtime"]["caches"] rows (name, symbolic shape, numpy dtype)."""
    out = []
    for v in m.graph.inputs:
        if v.name in FIXED:
            continue
        out.append({"name": v.name, "shape": [d if isinstance(d, int) else str(d) for d in v.shape],
                    "dtype": v.dtype.numpy().name})
    return out


def _with_topk_outputs(m: ir.Model) -> dict[str, int]:
    """Adds the indices of each indexed layer's TopK (the first TopK downstream of the index-K pool write) as graph
    output `topk.<layer>`; returns {output name: k}."""
    found = {}
    for v in list(m.graph.inputs):
        if not v.name.startswith("index_k.") or v.metadata_props.get("kimi.cache", v.name) != v.name:
            continue
        layer = v.name.split(".")[1]
        seen, frontier = set(), [n for n, _ in v.uses()]
        topk = None
        while frontier and topk is None:
            nxt = []
            for n in frontier:
                if id(n) in seen:
                    continue
                seen.add(id(n))
                if n.op_type == "TopK" and n.domain == "":
                    topk = n
                    break
                for o in n.outputs:
                    nxt.extend(u for u, _ in o.uses())
            frontier = nxt
        if topk is None:
            continue
        idx = topk.outputs[1]
        name = f"topk.{layer}"
        ident = ir.node("Identity", [idx], outputs=[ir.Value(name=name)])
        m.graph.append(ident)
        ident.outputs[0].dtype = ir.DataType.INT64
        m.graph.outputs.append(ident.outputs[0])
        k = topk.inputs[1].const_value
        found[name] = int(k.numpy().reshape(-1)[0]) if k is not None else -1
    return found


class _Exec:
    """ORT sessions over in-memory phase graphs; keeps the last run's outputs (for the TopK indices)."""

    def __init__(self, models: dict[str, ir.Model]):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.sessions = {}
        for phase, m in models.items():
            m = ir.external_data.load_to_model(m)
            self.sessions[phase] = ort.InferenceSession(ir.to_proto(m).SerializeToString(), so,
                                                        providers=["CPUExecutionProvider"])
        self.names = {p: [o.name for o in s.get_outputs()] for p, s in self.sessions.items()}
        self.last: dict[str, np.ndarray] = {}

    def run(self, phase: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.last = dict(zip(self.names[phase], self.sessions[phase].run(None, feeds)))
        return self.last


def _session(models: dict[str, ir.Model], vocab: int, block_size: int, max_seq_len: int):
    from kimi_compile.runtime.session import Session

    return Session(_Exec(models), {"caches": graph_caches(models["prefill"]), "max_seq_len": max_seq_len,
                                   "block_size": block_size, "vocab_size": vocab, "eos_token_id": None})


def _kl(r: np.ndarray, q: np.ndarray) -> np.ndarray:
    def logsm(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lr, lq = logsm(r), logsm(q)
    return (np.exp(lr) * (lr - lq)).sum(-1)


def _recall(ref: np.ndarray, got: np.ndarray, pos: np.ndarray) -> tuple[int, int]:
    """(hits, total) of ref's causally valid selected keys (index <= position) found in got; rows [..., k]."""
    hits = total = 0
    for r, g, p in zip(ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1]), pos.reshape(-1)):
        valid = set(int(i) for i in r if i <= p)
        total += len(valid)
        hits += len(valid & set(int(i) for i in g))
    return hits, total


def prompts(vocab: int, seed: int = 0, n: int = PROMPTS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(12, 41))).tolist() for _ in range(n)]


def evaluate(traced: dict[str, ir.Model], quantized: dict[str, ir.Model], cfg, block_size: int, *,
             new_tokens: int = NEW_TOKENS, seed: int = 0, n_prompts: int = PROMPTS) -> dict:
    from kimi_compile.trace_spec import cache_layouts

    ref_m = {p: m.clone() if hasattr(m, "clone") else m for p, m in traced.items()}
    q_m = {p: m.clone() if hasattr(m, "clone") else m for p, m in quantized.items()}
    ks = {}
    for ms in (ref_m, q_m):
        for m in ms.values():
            ks = _with_topk_outputs(m) or ks
    ps = prompts(cfg.vocab_size, seed, n_prompts)
    max_len = max(len(p) for p in ps) + new_tokens + 1
    rs, qs = _session(ref_m, cfg.vocab_size, block_size, max_len), _session(q_m, cfg.vocab_size, block_size, max_len)
    rc, qc = rs.new_cache(len(ps), max_len), qs.new_cache(len(ps), max_len)
    lens = np.array([len(p) for p in ps])
    rl, ql = rs.prefill(ps, rc), qs.prefill(ps, qc)
    pos = np.broadcast_to(np.arange(rl.shape[1]), rl.shape[:2])
    valid = pos < lens[:, None]
    diffs, refs, kls = [], [], []
    hits = {k: [0, 0] for k in ks}

    def add(r, q, mask, positions):
        diffs.append(((q - r)[mask]).astype(np.float64))
        refs.append(r[mask].astype(np.float64))
        kls.append(_kl(r[mask], q[mask]))
        for k in ks:
            if k in rs.backend.last and k in qs.backend.last:
                a, b = rs.backend.last[k], qs.backend.last[k]
                h, t = _recall(a[mask], b[mask], positions[mask])
                hits[k][0] += h
                hits[k][1] += t

    add(rl, ql, valid, pos)
    nxt = np.array([rl[b, lens[b] - 1].argmax() for b in range(len(ps))])
    agree = [(ql[np.arange(len(ps)), lens - 1].argmax(-1) == nxt)]
    seq_pos = lens.copy()
    for _ in range(new_tokens - 1):
        r1, q1 = rs.decode(nxt.tolist(), rc), qs.decode(nxt.tolist(), qc)
        m = np.ones((len(ps), 1), bool)
        add(r1[:, None], q1[:, None], m, seq_pos[:, None])
        seq_pos = seq_pos + 1
        nxt_q = q1.argmax(-1)
        nxt = r1.argmax(-1)
        agree.append(nxt_q == nxt)
    d, r = np.concatenate(diffs), np.concatenate(refs)
    kl = np.concatenate(kls)
    # free-running greedy: tokens before the first disagreement
    gr = _session(ref_m, cfg.vocab_size, block_size, max_len).generate(ps, new_tokens, stop_at_eos=False)
    gq = _session(q_m, cfg.vocab_size, block_size, max_len).generate(ps, new_tokens, stop_at_eos=False)
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(gr, gq)]
    before = {c["name"]: c for c in cache_layouts(cfg, block_size, traced["prefill"])}
    after = cache_layouts(cfg, block_size, quantized["prefill"])
    caches = []
    for name, c in before.items():
        if not c["paged"]:
            continue
        parts = [a for a in after if a.get("cache") == name]
        values = int(np.prod([d for d in c["shape"][1:]])) // block_size
        b_after = sum(a["bytes_per_token"] for a in parts)
        caches.append({"cache": name, "kind": c["kind"], "bytes_per_token_before": c["bytes_per_token"],
                       "bytes_per_token_after": b_after, "bytes_per_token_bf16": 2 * values,
                       "ratio_vs_bf16": round(b_after / (2 * values), 4),
                       "pools": [f"{a['name']} {a['dtype']} {a['format']}" for a in parts]})
    return {
        "prompts": len(ps), "prompt_lengths": lens.tolist(), "new_tokens": new_tokens, "seed": seed,
        "logits_rel_err": float(np.linalg.norm(d) / np.linalg.norm(r)),
        "kl": float(kl.mean()), "kl_max": float(kl.max()),
        "greedy_agreement": float(np.concatenate(agree).mean()),
        "greedy_prefix": prefix,
        "recall": {k.split(".")[1]: (round(h / t, 4) if t else None) for k, (h, t) in hits.items()},
        "topk": {k.split(".")[1]: v for k, v in ks.items()},
        "caches": caches,
    }


def rebase_feeds(m: ir.Model, feeds: dict[str, np.ndarray], prior: dict[str, np.ndarray] | None) -> dict:
    """Feeds for a graph whose cache signature changed: the fixed inputs are kept; each cache is `prior[name +
    ".out"]` (decode after a rebased prefill) or zeros of the graph input's dtype and shape."""
    out = {k: feeds[k] for k in FIXED}
    B = feeds["block_table"].shape[0]
    nb = next((v.shape[0] for k, v in feeds.items() if k not in FIXED and k.startswith(("kv.", "index_k."))), 0)
    for c in graph_caches(m):
        if prior is not None and c["name"] + ".out" in prior:
            out[c["name"]] = prior[c["name"] + ".out"]
            continue
        shape = [B if d == "batch" else nb if d == "num_blocks" else d for d in c["shape"]]
        out[c["name"]] = np.zeros(shape, np.dtype(c["dtype"]))
    return out
