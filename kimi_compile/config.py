"""HF config (`kimi_k3` with `text_config`, or a flat `kimi_linear` dict) -> typed, validated `KimiConfig`; presets.

Field names and released values follow reference/kimi_k3_spec.md §1; the K3.1 indexer fields follow MODEL.md. Layer
lists are 1-based as in the published config. Everything a user can get wrong raises `ConfigError` naming the field
and what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

MODEL_TYPES = ("kimi_k3", "kimi_linear")
PRESETS = ("kimi-k3-tiny", "kimi-k3.1-tiny", "kimi-k3.1-small", "kimi-k3.1-pro")


class ConfigError(ValueError):
    """A config field is missing, malformed or unsupported; the message names it."""


@dataclasses.dataclass(frozen=True)
class KimiConfig:
    # sizes
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    # activation
    hidden_act: str
    activation_situ_beta: float | None
    activation_situ_linear_beta: float | None
    # KDA (linear_attn_config)
    kda_layers: tuple[int, ...]  # 1-based
    full_attn_layers: tuple[int, ...]  # 1-based
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float | None
    use_full_rank_gate: bool
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # MoE
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    moe_renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    # AttnRes
    attn_res_block_size: int | None
    # K3.1 indexer (index_topk None = K3, no indexer)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    index_layers: tuple[int, ...] = ()  # 1-based
    index_rope_head_dim: int = 0
    # misc
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------------------
    def is_kda(self, layer: int) -> bool:
        """0-based layer index -> True for a KDA layer (the test is `(layer+1) in kda_layers`)."""
        return (layer + 1) in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def has_indexer(self, layer: int) -> bool:
        return self.index_topk is not None and not self.is_kda(layer) and (layer + 1) in self.index_layers

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda(i)]

    @property
    def indexed_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.has_indexer(i)]

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per MLA layer: normed c_kv then k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    # ---- HF round trip -------------------------------------------------------------------------------------
    def to_text_config(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.raw) if self.raw else {}
        d.update(
            model_type="kimi_linear",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            activation_situ_beta=self.activation_situ_beta,
            activation_situ_linear_beta=self.activation_situ_linear_beta,
            linear_attn_config={
                "kda_layers": list(self.kda_layers),
                "full_attn_layers": list(self.full_attn_layers),
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "gate_lower_bound": self.gate_lower_bound,
                "use_full_rank_gate": self.use_full_rank_gate,
            },
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            mla_use_nope=True,
            mla_use_output_gate=self.mla_use_output_gate,
            num_experts=self.num_experts,
            num_experts_per_token=self.num_experts_per_token,
            num_shared_experts=self.num_shared_experts,
            moe_intermediate_size=self.moe_intermediate_size,
            routed_expert_hidden_size=self.routed_expert_hidden_size,
            latent_moe_use_norm=self.latent_moe_use_norm,
            moe_router_activation_func="sigmoid",
            moe_renormalize=self.moe_renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            first_k_dense_replace=self.first_k_dense_replace,
            moe_layer_freq=self.moe_layer_freq,
            attn_res_block_size=self.attn_res_block_size,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        if self.index_topk is not None:
            d.update(
                index_n_heads=self.index_n_heads,
                index_head_dim=self.index_head_dim,
                index_topk=self.index_topk,
                index_layers=list(self.index_layers),
                index_rope_head_dim=self.index_rope_head_dim,
            )
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` written next to a checkpoint: top-level kimi_k3 with a kimi_linear text_config."""
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "dtype": self.torch_dtype,
            "text_config": self.to_text_config(),
        }

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("raw")
        return json.loads(json.dumps(d))


# ---- parsing ---------------------------------------------------------------------------------------------------

_MISSING = object()


class _Reader:
    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is _MISSING:
            raise ConfigError(f"{self._name(key)}: required field is missing")
        return default

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1, optional: bool = False) -> Any:
        v = self.get(key, None if optional else default)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self._name(key)}: expected an integer, got {v!r}")
        if v < minimum:
            raise ConfigError(f"{self._name(key)}: expected an integer >= {minimum}, got {v}")
        return v

    def float(self, key: str, default: Any = _MISSING, *, optional: bool = False, positive: bool = False) -> Any:
        v = self.get(key, None if optional else default)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self._name(key)}: expected a number, got {v!r}")
        if positive and not v > 0:
            raise ConfigError(f"{self._name(key)}: expected a positive number, got {v}")
        return float(v)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self._name(key)}: expected true or false, got {v!r}")
        return v

    def int_list(self, key: str, default: Any = _MISSING) -> tuple[int, ...]:
        v = self.get(key, default)
        if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise ConfigError(f"{self._name(key)}: expected a list of 1-based layer numbers, got {v!r}")
        return tuple(v)


def from_hf_dict(d: Any, *, source: str = "config") -> KimiConfig:
    """Parse an HF config dict: `model_type: kimi_k3` with `text_config`, or a flat `kimi_linear` dict."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"{source}: model_type: expected one of {list(MODEL_TYPES)}, got {mt!r}")
    top = d
    where = ""
    if mt == "kimi_k3":
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config: expected an object (model_type kimi_k3 needs a text_config)")
        tmt = text.get("model_type", "kimi_linear")
        if tmt != "kimi_linear":
            raise ConfigError(f"{source}: text_config.model_type: expected 'kimi_linear', got {tmt!r}")
        d, where = text, "text_config"
    try:
        return _parse_text(d, top, where)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _parse_text(d: dict, top: dict, where: str) -> KimiConfig:
    r = _Reader(d, where)
    n_layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")

    act = r.get("hidden_act", "silu")
    if act not in ("situ", "silu"):
        raise ConfigError(f"{r._name('hidden_act')}: expected 'situ' or 'silu', got {act!r}")
    if r.get("mla_use_nope", True) is not True:
        raise ConfigError(f"{r._name('mla_use_nope')}: only NoPE MLA is supported (expected true), got false")
    router = r.get("moe_router_activation_func", "sigmoid")
    if router != "sigmoid":
        raise ConfigError(f"{r._name('moe_router_activation_func')}: only 'sigmoid' is supported, got {router!r}")
    topk_method = r.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"{r._name('topk_method')}: only 'noaux_tc' is supported, got {topk_method!r}")

    lac = r.get("linear_attn_config")
    if not isinstance(lac, dict):
        raise ConfigError(f"{r._name('linear_attn_config')}: expected an object")
    lr = _Reader(lac, r._name("linear_attn_config"))
    kda_layers = lr.int_list("kda_layers")
    full_layers = lr.int_list("full_attn_layers")
    _check_layer_cover(kda_layers, full_layers, n_layers, lr._name("kda_layers"), lr._name("full_attn_layers"))
    lb = lr.float("gate_lower_bound", optional=True)
    if lb is not None and not (-float("inf") < lb < 0):
        raise ConfigError(f"{lr._name('gate_lower_bound')}: expected a negative number, got {lb}")

    heads = r.int("num_attention_heads")
    q_lora = r.int("q_lora_rank", optional=True)
    kv_lora = r.int("kv_lora_rank")
    nope = r.int("qk_nope_head_dim")
    rope = r.int("qk_rope_head_dim", 0, minimum=0)
    v_head = r.int("v_head_dim")

    n_exp = r.int("num_experts", 0, minimum=0)
    k_exp = r.int("num_experts_per_token", 16 if n_exp else 1)
    if n_exp and k_exp > n_exp:
        raise ConfigError(f"{r._name('num_experts_per_token')}: {k_exp} exceeds num_experts={n_exp}")
    moe_inter = r.int("moe_intermediate_size", optional=not n_exp)
    n_group = r.int("num_expert_group", 1)
    topk_group = r.int("topk_group", 1)
    if n_exp and n_exp % n_group:
        raise ConfigError(f"{r._name('num_expert_group')}: {n_group} does not divide num_experts={n_exp}")
    if topk_group > n_group:
        raise ConfigError(f"{r._name('topk_group')}: {topk_group} exceeds num_expert_group={n_group}")

    bs = r.int("attn_res_block_size", optional=True)

    index_topk = r.int("index_topk", optional=True)
    idx_heads = idx_dim = None
    idx_layers: tuple[int, ...] = ()
    idx_rope = 0
    if index_topk is not None:
        if q_lora is None:
            raise ConfigError(f"{r._name('index_topk')}: the indexer needs q_lora_rank (it reads the q latent)")
        idx_heads = r.int("index_n_heads")
        idx_dim = r.int("index_head_dim")
        idx_rope = r.int("index_rope_head_dim", 0, minimum=0)
        if idx_rope:
            raise ConfigError(
                f"{r._name('index_rope_head_dim')}: a rotary indexer is not supported (K3 defines no rope_theta);"
                f" expected 0, got {idx_rope}"
            )
        idx_layers = r.int_list("index_layers", list(full_layers))
        bad = [i for i in idx_layers if i not in full_layers]
        if bad:
            raise ConfigError(f"{r._name('index_layers')}: layers {bad} are not MLA layers (full_attn_layers)")
        if len(set(idx_layers)) != len(idx_layers):
            raise ConfigError(f"{r._name('index_layers')}: duplicate entries in {list(idx_layers)}")

    cfg = KimiConfig(
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        intermediate_size=r.int("intermediate_size"),
        rms_norm_eps=r.float("rms_norm_eps", 1e-6, positive=True),
        hidden_act=act,
        activation_situ_beta=r.float("activation_situ_beta", optional=True, positive=True),
        activation_situ_linear_beta=r.float("activation_situ_linear_beta", optional=True, positive=True),
        kda_layers=kda_layers,
        full_attn_layers=full_layers,
        kda_num_heads=lr.int("num_heads"),
        kda_head_dim=lr.int("head_dim"),
        short_conv_kernel_size=lr.int("short_conv_kernel_size", 4),
        gate_lower_bound=lb,
        use_full_rank_gate=lr.bool("use_full_rank_gate", False),
        num_attention_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_head,
        mla_use_output_gate=r.bool("mla_use_output_gate", False),
        num_experts=n_exp,
        num_experts_per_token=k_exp,
        num_shared_experts=r.int("num_shared_experts", 0, minimum=0),
        moe_intermediate_size=moe_inter or 0,
        routed_expert_hidden_size=r.int("routed_expert_hidden_size", optional=True),
        latent_moe_use_norm=r.bool("latent_moe_use_norm", False),
        moe_renormalize=r.bool("moe_renormalize", True),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0, positive=True),
        num_expert_group=n_group,
        topk_group=topk_group,
        first_k_dense_replace=r.int("first_k_dense_replace", 0, minimum=0),
        moe_layer_freq=r.int("moe_layer_freq", 1),
        attn_res_block_size=bs,
        index_n_heads=idx_heads,
        index_head_dim=idx_dim,
        index_topk=index_topk,
        index_layers=idx_layers,
        index_rope_head_dim=idx_rope,
        tie_word_embeddings=bool(top.get("tie_word_embeddings", d.get("tie_word_embeddings", False))),
        bos_token_id=d.get("bos_token_id", top.get("bos_token_id")),
        eos_token_id=d.get("eos_token_id", top.get("eos_token_id")),
        torch_dtype=str(top.get("dtype", top.get("torch_dtype", d.get("dtype", "bfloat16")))),
        raw=copy.deepcopy(d),
    )
    if cfg.tie_word_embeddings:
        raise ConfigError("tie_word_embeddings: tied embeddings are not supported (K3 unties them); expected false")
    return cfg


def _check_layer_cover(kda: tuple[int, ...], full: tuple[int, ...], n: int, kda_name: str, full_name: str) -> None:
    for name, lst in ((kda_name, kda), (full_name, full)):
        bad = [i for i in lst if not 1 <= i <= n]
        if bad:
            raise ConfigError(f"{name}: entries {bad} are outside 1..num_hidden_layers={n} (layer lists are 1-based)")
        dup = sorted({i for i in lst if lst.count(i) > 1})
        if dup:
            raise ConfigError(f"{name}: entries {dup} appear more than once")
    both = sorted(set(kda) & set(full))
    if both:
        raise ConfigError(f"{kda_name}/{full_name}: layers {both} are in both lists; each layer must be in exactly one")
    missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
    if missing:
        raise ConfigError(f"{kda_name}/{full_name}: layers {missing} are in neither list; each layer must be in one")


def load_config(path: str | os.PathLike) -> KimiConfig:
    """Read a config.json file (or a checkpoint directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: config.json not found")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror})") from None
    return from_hf_dict(d, source=str(p))


# ---- presets ---------------------------------------------------------------------------------------------------


def _tiny_text(index: bool) -> dict[str, Any]:
    # the public MLX test config (kimi_k3_spec.md §1.7) grown to 6 layers, so that AttnRes (block size 2) spans three
    # blocks and the model both starts and ends its MLA groups like the released one (layers 4 and 6 are MLA); and to
    # 4 MLA heads and 4 KDA heads of 16 (same KDA width 64), so that tensor parallelism over 2 and 4 ranks splits them.
    d: dict[str, Any] = {
        "model_type": "kimi_linear",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-5,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5],
            "full_attn_layers": [4, 6],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "attn_res_block_size": 2,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "num_expert_group": 1,
        "topk_group": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if index:
        d.update(index_n_heads=4, index_head_dim=32, index_topk=8, index_layers=[4, 6], index_rope_head_dim=0)
    return d


def _small_text() -> dict[str, Any]:
    return {
        "model_type": "kimi_linear",
        "vocab_size": 32768,
        "hidden_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "intermediate_size": 5632,
        "rms_norm_eps": 1e-5,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6, 7],
            "full_attn_layers": [4, 8],
            "num_heads": 16,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_experts": 64,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 768,
        "routed_expert_hidden_size": 1024,
        "latent_moe_use_norm": True,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "first_k_dense_replace": 1,
        "attn_res_block_size": 4,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_rope_head_dim": 0,
    }


def _pro_text() -> dict[str, Any]:
    """Released Kimi K3 text config (kimi_k3_spec.md §1.2-1.3) plus the full-size K3.1 indexer."""
    kda = [i for i in range(1, 92) if i % 4 != 0]
    full = [i for i in range(4, 93, 4)] + [93]
    return {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "intermediate_size": 33792,
        "rms_norm_eps": 1e-5,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": full,
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "attn_res_block_size": 12,
        "max_position_embeddings": 1048576,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_layers": full,
        "index_rope_head_dim": 0,
    }


def preset_hf_dict(name: str) -> dict[str, Any]:
    """The HF config.json dict of a preset."""
    texts = {
        "kimi-k3-tiny": lambda: _tiny_text(index=False),
        "kimi-k3.1-tiny": lambda: _tiny_text(index=True),
        "kimi-k3.1-small": _small_text,
        "kimi-k3.1-pro": _pro_text,
    }
    if name not in texts:
        raise ConfigError(f"preset: unknown preset {name!r}; expected one of {list(PRESETS)}")
    text = texts[name]()
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "text_config": text,
    }


def preset(name: str) -> KimiConfig:
    return from_hf_dict(preset_hf_dict(name), source=f"preset {name}")
