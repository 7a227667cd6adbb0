"""The reference model agrees with the independent MLX implementation (mlx_lm.models.kimi_k3) on the same
checkpoint, across the config switches a real checkpoint may flip. Skipped when mlx / mlx-lm are not installed
(`pip install "mlx[cpu]" mlx-lm`)."""

import copy

import numpy as np
import pytest
import torch

from kimi_compile.config import from_hf_dict, preset_hf_dict
from kimi_compile.model import load_pretrained, random_checkpoint
from kimi_compile.model.weights import build_model, init_random, save_pretrained

mx = pytest.importorskip("mlx.core")
mlx_utils = pytest.importorskip("mlx_lm.utils")

BASE = preset_hf_dict("kimi-k3-tiny")
LAC = BASE["text_config"]["linear_attn_config"]
VARIANTS = {
    "released_shape": {},
    "low_rank_output_gate": {"linear_attn_config": {**LAC, "use_full_rank_gate": False}},
    "no_q_lora": {"q_lora_rank": None},
    "no_attn_res": {"attn_res_block_size": None},
    "attn_res_block_3": {"attn_res_block_size": 3},
    "no_latent_moe": {"routed_expert_hidden_size": None, "latent_moe_use_norm": False},
    "latent_without_norm": {"latent_moe_use_norm": False},
    "no_shared_experts": {"num_shared_experts": 0},
    "no_dense_layer": {"first_k_dense_replace": 0},
    "softplus_gate": {"linear_attn_config": {**LAC, "gate_lower_bound": None}},
    "no_mla_output_gate": {"mla_use_output_gate": False},
    "situ_defaults": {"activation_situ_beta": None, "activation_situ_linear_beta": None},
    "grouped_routing": {"num_expert_group": 2, "topk_group": 1},
    "no_renormalize": {"moe_renormalize": False},
    "routed_scaling": {"routed_scaling_factor": 2.5},
    "moe_every_other_layer": {"moe_layer_freq": 2},
}


def _mlx_logits(path, ids):
    model, _ = mlx_utils.load_model(path)
    return np.array(model(mx.array(ids)).astype(mx.float32))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_mlx(name, tmp_path):
    d = copy.deepcopy(BASE)
    d["text_config"].update(VARIANTS[name])
    save_pretrained(init_random(build_model(from_hf_dict(d)), seed=1), tmp_path / "ck")
    ids = np.random.default_rng(0).integers(0, 1000, (1, 20))
    ref = load_pretrained(tmp_path / "ck")(torch.tensor(ids)).detach().numpy()
    out = _mlx_logits(tmp_path / "ck", ids)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-4


def test_mxfp4_experts_match_mlx(tmp_path):
    path = random_checkpoint("kimi-k3-tiny", 0, tmp_path / "fp4", mxfp4_experts=True)
    ids = np.random.default_rng(1).integers(0, 1000, (1, 16))
    ref = load_pretrained(path)(torch.tensor(ids)).detach().numpy()
    assert np.linalg.norm(_mlx_logits(path, ids) - ref) / np.linalg.norm(ref) < 1e-4
