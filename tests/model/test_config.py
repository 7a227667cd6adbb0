import copy
import json

import pytest

from kimi_compile.config import ConfigError, from_hf_dict, load_config, preset, preset_hf_dict


@pytest.mark.parametrize("name", ["kimi-k3-tiny", "kimi-k3.1-tiny", "kimi-k3.1-small", "kimi-k3.1-pro"])
def test_presets_parse_and_round_trip(name):
    cfg = preset(name)
    again = from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg


def test_released_layer_layout():
    cfg = preset("kimi-k3.1-pro")
    assert len(cfg.kda_layer_ids) == 69 and len(cfg.mla_layer_ids) == 24
    assert cfg.mla_layer_ids[-2:] == [91, 92] and cfg.is_kda(0) and not cfg.is_kda(3)
    assert cfg.is_moe(1) and not cfg.is_moe(0)
    assert cfg.indexed_layer_ids == cfg.mla_layer_ids
    assert preset("kimi-k3-tiny").indexed_layer_ids == []


def test_flat_kimi_linear_config_is_accepted():
    flat = preset_hf_dict("kimi-k3-tiny")["text_config"]
    assert from_hf_dict(flat) == from_hf_dict(preset_hf_dict("kimi-k3-tiny"))


def _bad(mutate):
    d = copy.deepcopy(preset_hf_dict("kimi-k3.1-tiny"))
    mutate(d["text_config"], d)
    return d


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda t, d: d.update(model_type="llama"), "model_type"),
        (lambda t, d: t["linear_attn_config"].update(kda_layers=[0, 1, 2, 4]), "kda_layers"),  # 0-based by mistake
        (lambda t, d: t["linear_attn_config"].update(kda_layers=[1, 2, 3]), "layers [5]"),  # layer 5 in no list
        (lambda t, d: t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5]), "in both lists"),
        (lambda t, d: t["linear_attn_config"].update(kda_layers=[1, 1, 2, 3, 5]), "more than once"),
        (lambda t, d: t.update(hidden_size=0), "hidden_size"),
        (lambda t, d: t.update(num_experts_per_token=9), "num_experts_per_token"),
        (lambda t, d: t.update(mla_use_nope=False), "mla_use_nope"),
        (lambda t, d: t.update(hidden_act="gelu"), "hidden_act"),
        (lambda t, d: t.update(index_layers=[1]), "index_layers"),
        (lambda t, d: t.update(index_rope_head_dim=16), "index_rope_head_dim"),
        (lambda t, d: t.update(kv_lora_rank="512"), "kv_lora_rank"),
        (lambda t, d: t.pop("linear_attn_config"), "linear_attn_config"),
    ],
)
def test_bad_fields_are_named(mutate, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        from_hf_dict(_bad(mutate))


def test_bad_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="config.json not found"):
        load_config(tmp_path / "nowhere")
