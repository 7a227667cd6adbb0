"""HF checkpoints <-> the reference model: published key names and shapes (kimi_k3_spec.md §3).

Layout handled: `config.json` plus `model.safetensors`, or shards listed in `model.safetensors.index.json`. Keys carry
the `language_model.` prefix (kimi_k3) or none (flat kimi_linear). Mappings:
- routed experts `block_sparse_moe.experts.{e}.w1|w2|w3.weight` <-> stacked `experts.w1|w2|w3` [E, ...]; MXFP4
  experts (`.weight_packed` uint8 E2M1 pairs, low nibble first, + `.weight_scale` uint8 E8M0, group 32) are
  dequantized on load;
- `A_log` stored padded (>= num_heads entries; the first num_heads are used);
- AttnRes `*_res_proj.weight` / `*_res_norm.weight`, and the legacy `*_res.proj_weight` / `*_res.norm_weight`;
- `e_score_correction_bias` under `gate.` or directly under `block_sparse_moe.`.
Tensors under `vision_tower.`, `mm_projector.` and `mtp.` are not part of the text model: they are skipped and listed
in `model.load_report`. Anything else missing, unexpected, mis-shaped, of a wrong dtype or unreadable is reported in
one `CheckpointError` listing every problem.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kimi_compile.config import ConfigError, KimiConfig, from_hf_dict, load_config, preset_hf_dict
from kimi_compile.model.model import KimiK3ForCausalLM

log = logging.getLogger(__name__)

PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "mtp.", "model.mtp.", "multi_modal_projector.")
FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


class CheckpointError(ValueError):
    """The checkpoint does not match the config; `problems` lists every issue found."""

    def __init__(self, where: str, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:50]) + (f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else "")
        super().__init__(f"{where}: {len(problems)} problem(s) in the checkpoint:\n  {shown}")


# ---- building ----------------------------------------------------------------------------------------------------


def build_model(cfg: KimiConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> KimiK3ForCausalLM:
    """Construct the model. On `device="meta"` no weight memory is allocated (planning the full-size model)."""
    with torch.device(device):
        model = KimiK3ForCausalLM(cfg)
    model.to(dtype)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in FP32_PARAMS:
            p.data = p.data.float()
    return model.eval()


@torch.no_grad()
def init_random(model: KimiK3ForCausalLM, seed: int) -> KimiK3ForCausalLM:
    """Seeded random weights at scales that keep activations O(1) (so numerics tests mean something)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if leaf == "A_log":
            v = torch.rand(shape, generator=gen) * (math.log(16) - 0) + 0.0  # exp(A_log) in [1, 16)
        elif leaf == "dt_bias":
            v = torch.randn(shape, generator=gen) * 0.5
        elif leaf == "e_score_correction_bias":
            v = torch.randn(shape, generator=gen) * 0.1
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("k_norm.bias"):
            v = 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("_res.proj.weight"):
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[-1]) * 0.5
        elif "conv1d" in name:
            v = torch.randn(shape, generator=gen) * 0.5
        elif leaf == "weight" and name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=gen)
        else:  # projections: fan-in scaled; stacked experts use their last dim as fan-in too
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        p.copy_(v.to(p.dtype))
    del cfg
    return model


# ---- key mapping -------------------------------------------------------------------------------------------------

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_LEGACY_RES = re.compile(r"^(.*)(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)_weight$")
_RES = re.compile(r"^(.*)(self_attention_res|mlp_res|output_attn_res)_(proj|norm)\.weight$")


def to_hf_state_dict(model: KimiK3ForCausalLM) -> dict[str, Tensor]:
    """Model parameters under their published names (experts unstacked, A_log padded)."""
    cfg = model.config
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        m = re.match(r"^(.*)(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)\.weight$", name)
        if m:
            out[PREFIX + f"{m.group(1)}{m.group(2)}_{m.group(3)}.weight"] = t
        elif re.search(r"\.experts\.w[123]$", name):
            base, w = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                out[PREFIX + f"{base}.{e}.{w}.weight"] = t[e]
        elif name.endswith(".A_log"):
            padded = -(-cfg.kda_num_heads // 64) * 64
            out[PREFIX + name] = torch.cat([t, t.new_zeros(padded - t.shape[0])])
        else:
            out[PREFIX + name] = t
    return out


def _model_key(hf_key: str) -> str | tuple[str, int, str] | None:
    """Published key (without prefix) -> model state_dict key, or (stacked key, expert, kind) for experts."""
    m = _EXPERT.match(hf_key)
    if m:
        return (f"{m.group(1)}.{m.group(3)}", int(m.group(2)), m.group(4))
    m = _LEGACY_RES.match(hf_key) or _RES.match(hf_key)
    if m:
        return f"{m.group(1)}{m.group(2)}.{m.group(3)}.weight"
    if hf_key.endswith("block_sparse_moe.e_score_correction_bias"):
        return hf_key.replace("block_sparse_moe.e_score_correction_bias", "block_sparse_moe.gate.e_score_correction_bias")
    return hf_key


def _hf_name(model_key: str) -> str:
    return re.sub(r"(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)\.weight$", r"\1_\2.weight", model_key)


def dequantize_mxfp4(packed: Tensor, scale: Tensor, *, where: str = "") -> Tensor:
    """MXFP4 -> fp32: packed uint8 [out, in/2] (element 2i in the low nibble), scale uint8 E8M0 [out, in/32]."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{where}: MXFP4 weight_packed/weight_scale must be uint8, got {packed.dtype}/{scale.dtype}")
    p = packed.numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)
    vals = E2M1_VALUES[codes]
    if scale.shape != (p.shape[0], codes.shape[1] // 32):
        raise ValueError(f"{where}: weight_scale shape {tuple(scale.shape)} does not match weight_packed "
                         f"{tuple(packed.shape)} (expected {(p.shape[0], codes.shape[1] // 32)})")
    s = np.ldexp(np.float32(1.0), scale.numpy().astype(np.int32) - 127).astype(np.float32)
    return torch.from_numpy(vals * np.repeat(s, 32, axis=1))


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 [out, in] -> (packed uint8 [out, in/2], E8M0 scale uint8 [out, in/32]); OCP floor rule, RNE, saturating."""
    x = w.float().numpy().reshape(w.shape[0], -1, 32)
    amax = np.abs(x).max(-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127).clip(-127, 127)
    scaled = x / np.ldexp(1.0, exp.astype(np.int32))[..., None]
    mags = E2M1_VALUES[:8]
    a = np.minimum(np.abs(scaled), 6.0)
    # nearest representable magnitude, ties to the even code
    diff = np.abs(a[..., None] - mags)
    best = diff.min(-1, keepdims=True)
    cand = np.where(diff == best, np.arange(8), 99)
    even = np.where(cand % 2 == 0, cand, 99).min(-1)
    code = np.where(even < 99, even, cand.min(-1))
    code = code + np.where((scaled < 0) & (code > 0), 8, 0)
    code = code.reshape(w.shape[0], -1).astype(np.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy((exp + 127).astype(np.uint8))


# ---- saving ------------------------------------------------------------------------------------------------------


def save_pretrained(model: KimiK3ForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int | None = None,
                    mxfp4_experts: bool = False) -> Path:
    """Write config.json and safetensors (sharded with an index when `max_shard_bytes` is set) atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().contiguous() for k, v in to_hf_state_dict(model).items()}
    if mxfp4_experts:
        for k in [k for k in tensors if _EXPERT.match(k[len(PREFIX):])]:
            packed, scale = quantize_mxfp4(tensors.pop(k))
            tensors[k.replace(".weight", ".weight_packed")] = packed
            tensors[k.replace(".weight", ".weight_scale")] = scale
    cfg = model.config.to_hf_dict()
    if mxfp4_experts:
        cfg["text_config"]["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32, "type": "float",
                                                      "symmetric": True, "strategy": "group"},
                                          "targets": ["re:.*block_sparse_moe\\.experts\\..*"]}},
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if max_shard_bytes is None:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            shards: list[dict[str, Tensor]] = [{}]
            size = 0
            for k in sorted(tensors):
                nbytes = tensors[k].numel() * tensors[k].element_size()
                if shards[-1] and size + nbytes > max_shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][k] = tensors[k]
                size += nbytes
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def random_checkpoint(preset: str, seed: int, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                      **save_kwargs) -> Path:
    """A seeded random checkpoint of a preset written as an HF checkpoint directory."""
    cfg = from_hf_dict(preset_hf_dict(preset), source=f"preset {preset}")
    model = init_random(build_model(cfg, torch.float32), seed).to(dtype)
    return save_pretrained(model, path, **save_kwargs)


# ---- loading -----------------------------------------------------------------------------------------------------


def _open_files(path: Path) -> dict[str, list[str]]:
    """safetensors file name -> keys, from the index or the single file."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    problems: list[str] = []
    files: dict[str, list[str]] = {}
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except json.JSONDecodeError as e:
            raise CheckpointError(str(index), [f"not valid JSON ({e.msg} at line {e.lineno})"]) from None
        except (KeyError, TypeError):
            raise CheckpointError(str(index), ["expected an object with a 'weight_map' object"]) from None
        for key, fname in weight_map.items():
            files.setdefault(fname, [])
        listed = weight_map
    elif (path / "model.safetensors").is_file():
        files["model.safetensors"] = []
        listed = None
    else:
        raise CheckpointError(str(path), ["no model.safetensors or model.safetensors.index.json found"])
    for fname in list(files):
        f = path / fname
        if not f.is_file():
            problems.append(f"{fname}: shard listed in the index is missing")
            del files[fname]
            continue
        try:
            with safe_open(str(f), framework="pt") as h:
                files[fname] = list(h.keys())
            _check_complete(f)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            problems.append(f"{fname}: unreadable or truncated safetensors file ({e})")
            files.pop(fname, None)
    if listed is not None:
        for key, fname in listed.items():
            if fname in files and key not in files[fname]:
                problems.append(f"{key}: listed in the index under {fname} but not stored there")
    if problems:
        raise CheckpointError(str(path), problems)
    return files


def _check_complete(f: Path) -> None:
    """A safetensors file whose data section is shorter than its header says is truncated."""
    with open(f, "rb") as h:
        n = int.from_bytes(h.read(8), "little")
        header = json.loads(h.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if f.stat().st_size < 8 + n + end:
        raise ValueError(f"file has {f.stat().st_size} bytes, header needs {8 + n + end}")


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32, *, strict: bool = True
                    ) -> KimiK3ForCausalLM:
    """Load an HF checkpoint directory into the reference model (see module docstring for the accepted layout)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(str(path), ["not a directory"])
    cfg = load_config(path)
    files = _open_files(path)
    model = build_model(cfg, torch.float32, device="meta")
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    values: dict[str, Tensor] = {}
    experts: dict[tuple[str, int], dict[str, Tensor]] = {}
    problems: list[str] = []
    skipped: list[str] = []
    for fname, keys in files.items():
        with safe_open(str(path / fname), framework="pt") as h:
            for full in keys:
                key = full[len(PREFIX):] if full.startswith(PREFIX) else full
                if key.startswith(SKIPPED_PREFIXES):
                    skipped.append(full)
                    continue
                mk = _model_key(key)
                try:
                    t = h.get_tensor(full)
                except Exception as e:
                    problems.append(f"{full}: unreadable ({e})")
                    continue
                if isinstance(mk, tuple):
                    stacked, e, kind = mk
                    if stacked not in expected:
                        problems.append(f"{full}: unexpected tensor (no such expert layer in this config)")
                        continue
                    experts.setdefault((stacked, e), {})[kind] = t
                    continue
                if mk not in expected:
                    problems.append(f"{full}: unexpected tensor")
                    continue
                if mk in values:
                    problems.append(f"{full}: stored twice (also under another spelling)")
                    continue
                values[mk] = t
    # experts: stack per layer, dequantizing MXFP4
    for key, (shape, _) in expected.items():
        if not re.search(r"\.experts\.w[123]$", key):
            continue
        E = shape[0]
        rows = []
        for e in range(E):
            parts = experts.pop((key, e), None)
            hf = f"{PREFIX}{key.rsplit('.', 1)[0]}.{e}.{key.rsplit('.', 1)[1]}"
            if parts is None:
                problems.append(f"{hf}.weight: missing")
                continue
            if "weight" in parts:
                t = parts["weight"]
            elif "weight_packed" in parts and "weight_scale" in parts:
                try:
                    t = dequantize_mxfp4(parts["weight_packed"], parts["weight_scale"], where=hf)
                except ValueError as err:
                    problems.append(str(err))
                    continue
            else:
                problems.append(f"{hf}: MXFP4 expert needs both weight_packed and weight_scale, got {sorted(parts)}")
                continue
            if tuple(t.shape) != shape[1:]:
                problems.append(f"{hf}: shape {tuple(t.shape)}, expected {shape[1:]}")
                continue
            if not t.is_floating_point():
                problems.append(f"{hf}: dtype {t.dtype}, expected a floating-point tensor")
                continue
            rows.append(t.float())
        if len(rows) == E:
            values[key] = torch.stack(rows)
    for (stacked, e), parts in experts.items():
        problems.append(f"{stacked}.{e}: unexpected expert (config has fewer experts)")
    for key, (shape, _) in expected.items():
        if key not in values:
            if not re.search(r"\.experts\.w[123]$", key):
                problems.append(f"{PREFIX}{_hf_name(key)}: missing (expected shape {list(shape)})")
            continue
        t = values[key]
        if not t.is_floating_point():
            problems.append(f"{PREFIX}{_hf_name(key)}: dtype {t.dtype}, expected a floating-point tensor")
            continue
        if key.endswith(".A_log"):
            if t.dim() != 1 or t.shape[0] < shape[0]:
                problems.append(f"{PREFIX}{key}: shape {list(t.shape)}, expected [>= {shape[0]}] (padded head list)")
                continue
            values[key] = t = t[: shape[0]]
        if tuple(t.shape) != shape:
            problems.append(f"{PREFIX}{_hf_name(key)}: shape {list(t.shape)}, expected {list(shape)}")
    if problems and strict:
        raise CheckpointError(str(path), problems)
    model = build_model(cfg, torch.float32, device="cpu")
    model.load_state_dict({k: v.float() for k, v in values.items()}, strict=strict)
    model = model.to(dtype)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in FP32_PARAMS:
            p.data = p.data.float()
    model.load_report = {"path": str(path), "skipped": skipped, "tensors": len(values)}
    if skipped:
        log.info("load_pretrained %s: skipped %d non-text tensors (%s ...)", path, len(skipped), skipped[0])
    return model.eval()


__all__ = ["CheckpointError", "ConfigError", "build_model", "dequantize_mxfp4", "init_random", "load_pretrained",
           "quantize_mxfp4", "random_checkpoint", "save_pretrained", "to_hf_state_dict"]
