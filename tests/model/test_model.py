import dataclasses

import pytest
import torch

from kimi_compile.config import preset
from kimi_compile.model import KimiCache
from kimi_compile.model.weights import build_model, init_random
from tests.conftest import rel

PRESETS = ["kimi-k3-tiny", "kimi-k3.1-tiny"]


def _ids(vocab, shape, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_then_decode_matches_full_forward(name, tiny_models):
    model = tiny_models[name]
    ids = _ids(1000, (2, 36), seed=11)
    full = model(ids)
    cache = KimiCache(model.config, batch_size=2, max_seq_len=48, block_size=8, kda_chunk=16)
    out = [model.prefill(ids[:, :13], cache)]
    out += [model.decode(ids[:, t], cache).unsqueeze(1) for t in range(13, 36)]
    got = torch.cat(out, dim=1)
    for t in range(36):  # chunked (full) vs step-by-step (decode) KDA: up to 1.3e-5 on the 4-head presets
        assert rel(got[:, t], full[:, t]) < 5e-5, t
    assert cache.seq_lens.tolist() == [36, 36]


@pytest.mark.parametrize("name", PRESETS)
def test_fp64_paths_agree_to_rounding(name, tiny_models):
    model = build_model(tiny_models[name].config, torch.float64)
    model.load_state_dict(tiny_models[name].state_dict())
    ids = _ids(1000, (1, 30), seed=5)
    full = model(ids)
    cache = KimiCache(model.config, 1, 32, block_size=4, kda_chunk=8, dtype=torch.float64)
    pre = model.prefill(ids[:, :9], cache)
    pre2 = model.prefill(ids[:, 9:20], cache)  # chunked prefill continues from the cache
    dec = torch.stack([model.decode(ids[:, t], cache) for t in range(20, 30)], dim=1)
    assert rel(torch.cat([pre, pre2, dec], 1), full) < 1e-12


@pytest.mark.parametrize("name", PRESETS)
def test_ragged_batch_matches_each_sequence_alone(name, tiny_models):
    model = tiny_models[name]
    lens = [5, 17, 11]
    prompts = [_ids(1000, (n,), seed=20 + i).tolist() for i, n in enumerate(lens)]
    cache = KimiCache(model.config, 3, 40, block_size=8, kda_chunk=16)
    logits = model.prefill(prompts, cache)
    nxt = [[7, 300, 999, 42], [1, 2, 3, 4], [500, 600, 700, 800]]
    dec = [model.decode(torch.tensor([nxt[b][t] for b in range(3)]), cache) for t in range(4)]
    for b, p in enumerate(prompts):
        full = model(torch.tensor([p + nxt[b]]))[0]
        assert rel(logits[b, : lens[b]], full[: lens[b]]) < 1e-5
        for t in range(4):
            assert rel(dec[t][b], full[lens[b] + t]) < 1e-5


def test_indexer_with_topk_at_least_T_is_dense_mla(tiny_models):
    dense = tiny_models["kimi-k3-tiny"]
    cfg = dataclasses.replace(tiny_models["kimi-k3.1-tiny"].config, index_topk=64)
    indexed = build_model(cfg)
    indexed.load_state_dict({**dense.state_dict(), **{k: v for k, v in tiny_models["kimi-k3.1-tiny"].state_dict()
                                                       .items() if ".indexer." in k}})
    ids = _ids(1000, (2, 40), seed=8)
    assert torch.equal(indexed(ids), dense(ids))  # prefill form: the selection mask is the causal mask, exactly
    c1, c2 = KimiCache(cfg, 2, 48, 8), KimiCache(dense.config, 2, 48, 8)
    indexed.prefill(ids[:, :30], c1), dense.prefill(ids[:, :30], c2)
    for t in range(30, 40):  # decode form gathers the selected rows: same set, summed in another order (1.5e-6)
        assert rel(indexed.decode(ids[:, t], c1), dense.decode(ids[:, t], c2)) < 5e-6


def test_small_topk_selects_the_brute_force_top_k(tiny_models):
    model = tiny_models["kimi-k3.1-tiny"]
    layer = model.model.layers[model.config.indexed_layer_ids[0]].self_attn
    ix = layer.indexer
    g = torch.Generator().manual_seed(4)
    T = 33
    x = torch.randn(1, T, 64, generator=g)
    cq = layer.q_a_layernorm(layer.q_a_proj(x))
    keys = ix.keys(x)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().unsqueeze(0)
    score = ix.scores(x, cq, keys, allowed)
    mask = ix.mask(score, allowed)
    q = ix.wq_b(cq).view(1, T, ix.n_heads, ix.head_dim)
    w = ix.weights_proj(x) * (ix.n_heads * ix.head_dim) ** -0.5
    for t in range(T):  # brute force, one query at a time, written from the definition
        s = torch.stack([(w[0, t] * torch.relu(q[0, t] @ keys[0, j])).sum() for j in range(t + 1)]).detach()
        k = min(ix.topk, t + 1)
        order = sorted(range(t + 1), key=lambda j: (-float(s[j]), j))
        assert set(torch.nonzero(mask[0, t]).flatten().tolist()) == set(order[:k]), t
        assert torch.allclose(score[0, t, : t + 1], s, atol=1e-5)


def test_pro_preset_on_meta_allocates_nothing():
    model = build_model(preset("kimi-k3.1-pro"), torch.bfloat16, device="meta")
    params = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    assert 2.7e12 < params < 2.9e12  # ~2.78 T for K3 plus the indexers


def test_decode_rejects_tokens_out_of_vocab(tiny_models):
    model = tiny_models["kimi-k3-tiny"]
    cache = KimiCache(model.config, 1, 16, 8)
    with pytest.raises(ValueError, match="input_ids"):
        model.prefill([[1, 2, 5000]], cache)
