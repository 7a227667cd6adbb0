import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_compile.config import ConfigError
from kimi_compile.model import CheckpointError, load_pretrained, random_checkpoint, save_pretrained
from kimi_compile.model.weights import dequantize_mxfp4, quantize_mxfp4
from tests.conftest import rel

P = "language_model.model.layers."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint("kimi-k3.1-tiny", seed=7, path=tmp_path_factory.mktemp("c") / "tiny")


def test_published_names_and_shapes(ckpt):
    t = load_file(str(ckpt / "model.safetensors"))
    assert t[P + "0.self_attn.A_log"].shape == (64,)  # padded beyond the 2 heads, like the released [128] for 96
    assert t[P + "0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)
    assert t[P + "1.block_sparse_moe.experts.7.w2.weight"].shape == (32, 32)
    assert t[P + "3.self_attn.indexer.k_norm.bias"].shape == (32,)
    assert t[P + "3.self_attn_res_proj.weight".replace("self_attn_res", "self_attention_res")].shape == (1, 64)
    assert "language_model.model.output_attn_res_norm.weight" in t and "language_model.lm_head.weight" in t


def test_round_trip_is_bit_exact(ckpt, tmp_path):
    m = load_pretrained(ckpt)
    save_pretrained(m, tmp_path / "again")
    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((ckpt / "config.json").read_text()) == json.loads((tmp_path / "again" / "config.json").read_text())


def test_sharded_checkpoint_loads_identically(ckpt, tmp_path):
    m = load_pretrained(ckpt)
    save_pretrained(m, tmp_path / "sharded", max_shard_bytes=100_000)
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    m2 = load_pretrained(tmp_path / "sharded")
    ids = torch.tensor([[1, 5, 9, 400]])
    assert torch.equal(m(ids), m2(ids))


def test_legacy_attn_res_names_and_vision_tensors(ckpt, tmp_path):
    t = load_file(str(ckpt / "model.safetensors"))
    legacy = {}
    for k, v in t.items():
        k = k.replace("self_attention_res_proj.weight", "self_attention_res.proj_weight")
        k = k.replace("mlp_res_norm.weight", "mlp_res.norm_weight")
        legacy[k] = v
    legacy["vision_tower.patch_embed.weight"] = torch.zeros(2, 2)
    d = tmp_path / "legacy"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(legacy, str(d / "model.safetensors"))
    m = load_pretrained(d)
    assert m.load_report["skipped"] == ["vision_tower.patch_embed.weight"]
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.equal(m(ids), load_pretrained(ckpt)(ids))


def test_mxfp4_experts_are_dequantized_on_load(tmp_path):
    path = random_checkpoint("kimi-k3-tiny", seed=2, path=tmp_path / "fp4", mxfp4_experts=True)
    t = load_file(str(path / "model.safetensors"))
    packed, scale = t[P + "2.block_sparse_moe.experts.3.w1.weight_packed"], t[P + "2.block_sparse_moe.experts.3.w1.weight_scale"]
    assert packed.dtype == torch.uint8 and packed.shape == (32, 16) and scale.shape == (32, 1)
    m = load_pretrained(path)
    ref = random_checkpoint("kimi-k3-tiny", seed=2, path=tmp_path / "bf")
    w = load_file(str(ref / "model.safetensors"))[P + "2.block_sparse_moe.experts.3.w1.weight"]
    got = m.model.layers[2].block_sparse_moe.experts.w1[3]
    assert torch.equal(got, dequantize_mxfp4(*quantize_mxfp4(w)))
    assert 0 < rel(got, w) < 0.2  # 4-bit: close, not equal


def test_mxfp4_codec_known_values():
    w = torch.zeros(1, 32)
    w[0, :8] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, -4.0, 6.0])
    packed, scale = quantize_mxfp4(w)
    assert scale.tolist() == [[127]]  # amax 6 -> 2^(floor(log2 6) - 2) = 1
    assert packed[0, :4].tolist() == [0x10, 0x32, 0x54, 0x7E]
    assert torch.equal(dequantize_mxfp4(packed, scale), w)


def _corrupt(ckpt, tmp_path, edit):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    t = load_file(str(ckpt / "model.safetensors"))
    edit(t, d)
    return d


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda t, d: (t.pop(P + "0.self_attn.q_proj.weight"), t.pop(P + "1.mlp_res_norm.weight")),
         ["0.self_attn.q_proj.weight: missing", "1.mlp_res_norm.weight: missing", "2 problem(s)"]),
        (lambda t, d: t.update({P + "0.self_attn.q_proj.weight": torch.zeros(3, 3)}), ["shape [3, 3], expected [64, 64]"]),
        (lambda t, d: t.update({P + "0.input_layernorm.weight": torch.zeros(64, dtype=torch.int32)}), ["dtype torch.int32"]),
        (lambda t, d: t.update({P + "0.bogus.weight": torch.zeros(1)}), ["0.bogus.weight: unexpected"]),
        (lambda t, d: t.pop(P + "1.block_sparse_moe.experts.5.w3.weight"), ["experts.5.w3.weight: missing"]),
    ],
)
def test_bad_checkpoints_list_every_problem(ckpt, tmp_path, edit, needles):
    def write(t, d):
        edit(t, d)
        save_file(t, str(d / "model.safetensors"))

    d = _corrupt(ckpt, tmp_path, write)
    with pytest.raises(CheckpointError) as e:
        load_pretrained(d)
    for n in needles:
        assert n in str(e.value)


def test_truncated_file_and_bad_json(ckpt, tmp_path):
    d = _corrupt(ckpt, tmp_path, lambda t, d: save_file(t, str(d / "model.safetensors")))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_pretrained(d)
    (d / "config.json").write_text('{"model_type": "kimi_k3", ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_pretrained(d)
    (d / "model.safetensors.index.json").write_text("[]")
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match="weight_map"):
        load_pretrained(d)


def test_missing_shard_is_named(ckpt, tmp_path):
    m = load_pretrained(ckpt)
    save_pretrained(m, tmp_path / "s", max_shard_bytes=100_000)
    victim = sorted((tmp_path / "s").glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name + ": shard listed in the index is missing"):
        load_pretrained(tmp_path / "s")
