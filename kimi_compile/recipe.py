"""Recipes: the YAML that says what to build (DESIGN.md §3, "Pipeline and recipes").

A recipe is parsed into frozen dataclasses and validated as a whole: unknown keys, bad values and incompatible
combinations fail here, with the file and the key path in the message, never later in the build:

    recipes/x.yaml: passes[2].options.topk: expected a positive int, got -3

Pass and backend options are free dicts at this level; the pipeline and the backends validate them against their
own option dataclasses with `coerce_options`, which raises the same `RecipeError`. `Recipe.to_dict()` is the
resolved recipe (defaults filled in, JSON-able) that goes into the manifest and the compile-cache keys.

Schema (defaults shown; `name` and one of `model.preset` / `model.checkpoint` are required):

    name: kimi-k3.1-tiny
    model: {preset: kimi-k3.1-tiny, checkpoint: null, seed: 0, dtype: float32}
    export: {block_size: 16, max_seq_len: 256, max_batch: 8, prefill_chunk: 64}
    passes:                      # ordered; a bare string is short for {name: <string>}
      - {name: cleanup, enabled: true, options: {}}
    precision:                   # rules select tensors by role, never by node name
      - {role: indexer_qk, format: mxfp8, options: {rounding: floor, elem: e4m3, block: 32}}
    parallel: {tp: 1, ep: 1, cp: 1, sequence_parallel: false}   # tp/ep > 1: the partition_tp pass, backend cuda
    backend: {name: onnxruntime, options: {}}
    target: cpu
    verify: {tolerance: 1.0e-4, accuracy: true}

This module imports no torch: the runtime reads recipes from manifests.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "PRESETS",
    "DTYPES",
    "ROLES",
    "FORMATS",
    "BACKENDS",
    "RecipeError",
    "ModelSpec",
    "ExportSpec",
    "PassSpec",
    "MXFP8Options",
    "FP8TileOptions",
    "PlainFormatOptions",
    "PrecisionRule",
    "ParallelSpec",
    "BackendSpec",
    "VerifySpec",
    "Recipe",
    "load_recipe",
    "parallel_problems",
    "parse_recipe",
    "coerce_options",
    "with_overrides",
]

PRESETS = ("kimi-k3-tiny", "kimi-k3.1-tiny", "kimi-k3.1-small", "kimi-k3.1-pro")
DTYPES = ("float32", "bfloat16")  # bfloat16: the cuda backend, through the convert_dtype pass
ROLES = (
    "indexer_q",
    "indexer_k",
    "indexer_qk",
    "index_k_cache",
    "latent_kv_cache",
    "projection_weight",
    "projection_activation",
)
FORMATS = ("fp32", "bf16", "fp16", "mxfp8", "fp8_tile")
BACKENDS = ("onnxruntime", "cuda", "tensorrt")  # kimi_compile.backends maps each to its module

# indexer_qk is shorthand for both indexer_q and indexer_k; a recipe may not give two rules for one tensor.
_ROLE_COVERS = {"indexer_qk": ("indexer_q", "indexer_k")}
_GPU_ARCH = re.compile(r"sm\d{2,3}[a-z]?")
_SCALARS = (str, int, float, bool, type(None))


class RecipeError(ValueError):
    """A recipe (or a pass/backend options dict) is invalid. The message names the file and the key path."""

    def __init__(self, source: str, key_path: str | None = None, message: str | None = None):
        if key_path is None and message is None:  # RecipeError("<file>: <key>: <message>"), already formatted
            self.source, self.key_path, self.message = "", "", source
            super().__init__(source)
            return
        if message is None:
            raise TypeError("RecipeError(source, key_path, message) or RecipeError(formatted_message)")
        self.source = source
        self.key_path = key_path or ""
        self.message = message
        where = f"{source}: {key_path}: " if key_path else f"{source}: "
        super().__init__(where + message)


# ----------------------------------------------------------------------------------------------------------------
# Typed option coercion (used for the recipe's own sections and by the pipeline/backends for their options)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " | ".join(_describe(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {getattr(args[0], '__name__', args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return {bool: "a bool", int: "an int", float: "a float", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _got(value: Any) -> str:
    if isinstance(value, str):
        return f"{value!r} (a string)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    return repr(value)


def _coerce_value(tp: Any, value: Any, key: str, source: str, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return _check_jsonable(value, key, source)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise RecipeError(source, key, f"expected {_describe(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce_value(arg, value, key, source, meta)
            except RecipeError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise RecipeError(source, key, f"expected {_describe(tp)}, got {_got(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) in {type(c) for c in choices}:
            return value
        msg = f"expected one of {', '.join(str(c) for c in choices)}, got {value!r}"
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            if close:
                msg += f" (did you mean {close[0]!r}?)"
        raise RecipeError(source, key, msg)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(source, key, f"expected {_describe(tp)}, got {_got(value)}")
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        elem = args[0] if args else Any
        items = [_coerce_value(elem, v, f"{key}[{i}]", source, {}) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise RecipeError(source, key, f"expected a mapping, got {_got(value)}")
        return _check_jsonable(value, key, source)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise RecipeError(source, key, f"expected a mapping, got {_got(value)}")
        return coerce_options(tp, value, key, source)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(source, key, f"expected a bool (true or false), got {_got(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            adj = "a positive int" if meta.get("positive") else "an int"
            raise RecipeError(source, key, f"expected {adj}, got {_got(value)}")
        _check_range(value, "int", key, source, meta)
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                pass
            else:
                adj = "a positive float" if meta.get("positive") else "a float"
                raise RecipeError(
                    source, key,
                    f"expected {adj}, got {value!r} (a string: YAML reads 1e-4 as a string; write 1.0e-4)",
                )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            adj = "a positive float" if meta.get("positive") else "a float"
            raise RecipeError(source, key, f"expected {adj}, got {_got(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise RecipeError(source, key, f"expected a finite float, got {value!r}")
        _check_range(value, "float", key, source, meta)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(source, key, f"expected a string, got {_got(value)}")
        if meta.get("nonempty") and not value.strip():
            raise RecipeError(source, key, "expected a non-empty string")
        return value
    raise TypeError(f"coerce_options: unsupported field type {tp!r} at {key}")


def _check_range(value: float, kind: str, key: str, source: str, meta: Mapping[str, Any]) -> None:
    if meta.get("positive") and value <= 0:
        raise RecipeError(source, key, f"expected a positive {kind}, got {value!r}")
    if "min" in meta and value < meta["min"]:
        raise RecipeError(source, key, f"expected {kind} >= {meta['min']}, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise RecipeError(source, key, f"expected {kind} <= {meta['max']}, got {value!r}")


def _check_jsonable(value: Any, key: str, source: str) -> Any:
    """Deep-copies a YAML value, refusing anything that is not plain JSON (so it can enter manifests and keys)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise RecipeError(source, key, f"keys must be strings, got {_got(k)}")
            out[k] = _check_jsonable(v, _join(key, k), source)
        return out
    if isinstance(value, (list, tuple)):
        return [_check_jsonable(v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(source, key, f"expected a finite number, got {value!r}")
    if isinstance(value, _SCALARS):
        return value
    raise RecipeError(source, key, f"expected a plain YAML value, got {type(value).__name__} {value!r}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unknown_key(source: str, key_path: str, known: list[str]) -> RecipeError:
    name = key_path.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known) or 'none'})"
    return RecipeError(source, key_path, f"unknown key{hint}")


def coerce_options(cls: type, data: Mapping[str, Any] | None, key_path: str, source: str) -> Any:
    """Validates `data` against the dataclass `cls` and returns an instance.

    Field types understood: bool, int, float (an int is accepted), str, Literal[...], X | None, list[X],
    tuple[X, ...], dict (plain JSON), nested dataclasses, Any. Field metadata may add `positive=True`, `min`, `max`,
    `nonempty=True`. Missing fields take their defaults; a missing field without default, an unknown key (with the
    closest known key suggested), a wrong type or a ValueError raised by `cls.__post_init__` becomes a RecipeError
    naming `source` and the key path (`key_path.field`).
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"coerce_options: {cls!r} is not a dataclass type")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise RecipeError(source, key_path, f"expected a mapping, got {_got(data)}")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    known = [f.name for f in fields]
    for k in data:
        if not isinstance(k, str):
            raise RecipeError(source, key_path, f"keys must be strings, got {_got(k)}")
        if k not in known:
            raise _unknown_key(source, _join(key_path, k), known)
    kwargs = {}
    for f in fields:
        key = _join(key_path, f.name)
        if f.name in data:
            kwargs[f.name] = _coerce_value(hints[f.name], data[f.name], key, source, f.metadata)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(source, key, "missing required key")
    try:
        return cls(**kwargs)
    except RecipeError:
        raise
    except (ValueError, TypeError) as e:
        raise RecipeError(source, key_path or cls.__name__, str(e)) from None


# ----------------------------------------------------------------------------------------------------------------
# The recipe's sections


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where the weights come from: a preset with a seeded random checkpoint, or an HF checkpoint directory."""

    preset: Literal["kimi-k3-tiny", "kimi-k3.1-tiny", "kimi-k3.1-small", "kimi-k3.1-pro"] | None = None
    checkpoint: str | None = dataclasses.field(default=None, metadata={"nonempty": True})
    seed: int = dataclasses.field(default=0, metadata={"min": 0})
    dtype: Literal[DTYPES] = "float32"


@dataclasses.dataclass(frozen=True)
class ExportSpec:
    """Trace options: paged-cache block, the prefill graph's T range, batch bound and KDA prefill chunk."""

    block_size: int = dataclasses.field(default=16, metadata={"positive": True})
    max_seq_len: int = dataclasses.field(default=256, metadata={"positive": True})
    max_batch: int = dataclasses.field(default=8, metadata={"positive": True})
    prefill_chunk: int = dataclasses.field(default=64, metadata={"positive": True})


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One pipeline step. `options` is validated by the pipeline against the pass's option dataclass."""

    name: str = dataclasses.field(metadata={"nonempty": True})
    enabled: bool = True
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"expected a pass name in snake_case (e.g. cleanup), got {self.name!r}")


@dataclasses.dataclass(frozen=True)
class MXFP8Options:
    """MXFP8: FP8 elements with one E8M0 (power-of-two) scale per `block` elements; `rounding` of the scale."""

    rounding: Literal["floor", "ceil"] = "floor"
    elem: Literal["e4m3", "e5m2"] = "e4m3"
    block: int = dataclasses.field(default=32, metadata={"positive": True})


@dataclasses.dataclass(frozen=True)
class FP8TileOptions:
    """FP8 E4M3 per token, per head, per `tile`-element tile, with an fp32 or UE8M0 scale per tile."""

    tile: int = dataclasses.field(default=128, metadata={"positive": True})
    scale_fmt: Literal["fp32", "ue8m0"] = "fp32"


@dataclasses.dataclass(frozen=True)
class PlainFormatOptions:
    """fp32, bf16 and fp16 take no options."""


_FORMAT_OPTIONS: dict[str, type] = {
    "fp32": PlainFormatOptions,
    "bf16": PlainFormatOptions,
    "fp16": PlainFormatOptions,
    "mxfp8": MXFP8Options,
    "fp8_tile": FP8TileOptions,
}


@dataclasses.dataclass(frozen=True)
class PrecisionRule:
    """Stores the tensors of one role in one format. `options` is the format's typed option dataclass."""

    role: str
    format: str
    options: Any = dataclasses.field(default_factory=PlainFormatOptions)

    def options_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.options)


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
    """Ranks: tp tensor-parallel (heads, MLP and vocabulary split), ep expert-parallel within the tp group (ep
    divides tp: experts split ep ways, each expert's intermediate dim tp/ep ways), cp context-parallel (issue 18),
    sequence_parallel (activations between tensor-parallel regions split along the tokens; prefill)."""

    tp: int = dataclasses.field(default=1, metadata={"positive": True})
    ep: int = dataclasses.field(default=1, metadata={"positive": True})
    cp: int = dataclasses.field(default=1, metadata={"positive": True})
    sequence_parallel: bool = False
    cp_layout: Literal["zigzag", "contiguous"] = "zigzag"  # context parallel: which chunks a rank holds

    @property
    def world(self) -> int:
        return self.tp * self.cp


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """`options` is free here; the backend validates it with `coerce_options`."""

    name: Literal[BACKENDS] = "onnxruntime"
    options: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class VerifySpec:
    tolerance: float = dataclasses.field(default=1.0e-4, metadata={"positive": True})
    # with precision rules: the build's quantized-vs-unquantized accuracy report (kimi_compile/accuracy.py), run on
    # the CPU; large presets measure it on their target instead (bench/), so they turn it off
    accuracy: bool = True


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A validated recipe. Build one with `load_recipe`, `parse_recipe` or `with_overrides`, not by hand."""

    name: str
    model: ModelSpec
    export: ExportSpec = ExportSpec()
    passes: tuple[PassSpec, ...] = ()
    precision: tuple[PrecisionRule, ...] = ()
    parallel: ParallelSpec = ParallelSpec()
    backend: BackendSpec = BackendSpec()
    target: str = "cpu"
    verify: VerifySpec = VerifySpec()
    source: str = dataclasses.field(default="<str>", compare=False)

    @property
    def enabled_passes(self) -> tuple[PassSpec, ...]:
        return tuple(p for p in self.passes if p.enabled)

    def precision_rule(self, role: str) -> PrecisionRule | None:
        """The rule for tensors of `role` (an indexer_qk rule answers indexer_q and indexer_k too), or None."""
        if role not in ROLES:
            raise KeyError(f"unknown tensor role {role!r}; known: {', '.join(ROLES)}")
        for rule in self.precision:
            if role == rule.role or role in _ROLE_COVERS.get(rule.role, ()):
                return rule
        return None

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe: every key with its value or default, JSON-able; parse_recipe(to_dict()) == self."""
        return {
            "name": self.name,
            "model": dataclasses.asdict(self.model),
            "export": dataclasses.asdict(self.export),
            "passes": [
                {"name": p.name, "enabled": p.enabled, "options": _check_jsonable(p.options, "", "")}
                for p in self.passes
            ],
            "precision": [{"role": r.role, "format": r.format, "options": r.options_dict()} for r in self.precision],
            "parallel": dataclasses.asdict(self.parallel),
            "backend": {"name": self.backend.name, "options": _check_jsonable(self.backend.options, "", "")},
            "target": self.target,
            "verify": dataclasses.asdict(self.verify),
        }


_TOP_KEYS = ["name", "model", "export", "passes", "precision", "parallel", "backend", "target", "verify"]
_RULE_KEYS = ["role", "format", "options"]


def _parse_passes(value: Any, source: str) -> tuple[PassSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RecipeError(source, "passes", f"expected a list of passes, got {_got(value)}")
    out = []
    for i, item in enumerate(value):
        key = f"passes[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict):
            raise RecipeError(source, key, f"expected a pass name or a mapping with 'name', got {_got(item)}")
        if item.get("options") is None and "options" in item:
            item = {**item, "options": {}}
        out.append(coerce_options(PassSpec, item, key, source))
    return tuple(out)


def _parse_precision(value: Any, source: str) -> tuple[PrecisionRule, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise RecipeError(source, "precision", f"expected a list of rules, got {_got(value)}")
    rules: list[PrecisionRule] = []
    claimed: dict[str, tuple[int, str]] = {}  # concrete role -> (index, role) of the rule that claims it
    for i, item in enumerate(value):
        key = f"precision[{i}]"
        if not isinstance(item, dict):
            raise RecipeError(source, key, f"expected a mapping with role and format, got {_got(item)}")
        for k in item:
            if k not in _RULE_KEYS:
                raise _unknown_key(source, _join(key, str(k)), _RULE_KEYS)
        for k in ("role", "format"):
            if k not in item:
                raise RecipeError(source, _join(key, k), "missing required key")
        role = _coerce_value(Literal[ROLES], item["role"], f"{key}.role", source, {})  # type: ignore[valid-type]
        fmt = _coerce_value(Literal[FORMATS], item["format"], f"{key}.format", source, {})  # type: ignore[valid-type]
        options = coerce_options(_FORMAT_OPTIONS[fmt], item.get("options"), f"{key}.options", source)
        for concrete in _ROLE_COVERS.get(role, (role,)):
            if concrete in claimed:
                j, other = claimed[concrete]
                what = f"{role!r} covers {concrete!r}, which" if role != concrete else f"{role!r}"
                by = f"precision[{j}] ({other})" if other != concrete else f"precision[{j}]"
                raise RecipeError(
                    source, f"{key}.role", f"{what} already has a rule in {by}; give each tensor role one rule"
                )
            claimed[concrete] = (i, role)
        rules.append(PrecisionRule(role=role, format=fmt, options=options))
    return tuple(rules)


def _check_combinations(r: Recipe, source: str) -> None:
    """Incompatible combinations fail here, at the key that has to change."""
    m, e, p = r.model, r.export, r.parallel
    if m.preset is None and m.checkpoint is None:
        raise RecipeError(source, "model", "set model.preset (one of " + ", ".join(PRESETS) + ") or model.checkpoint")
    if m.preset is not None and m.checkpoint is not None:
        raise RecipeError(source, "model.checkpoint", "set model.preset or model.checkpoint, not both")
    if e.block_size > e.max_seq_len:
        raise RecipeError(
            source, "export.block_size", f"block_size {e.block_size} exceeds export.max_seq_len {e.max_seq_len}"
        )
    if e.prefill_chunk > e.max_seq_len:
        raise RecipeError(
            source, "export.prefill_chunk",
            f"prefill_chunk {e.prefill_chunk} exceeds export.max_seq_len {e.max_seq_len}",
        )
    if m.dtype != "float32":
        if r.backend.name != "cuda":
            raise RecipeError(source, "model.dtype", f"{m.dtype} graphs run on backend cuda only (onnxruntime and "
                                                     f"tensorrt build float32), got backend {r.backend.name!r}")
        if not any(ps.name == "convert_dtype" and ps.enabled for ps in r.passes):
            raise RecipeError(source, "model.dtype", f"{m.dtype} needs the convert_dtype pass in passes (it "
                                                     "converts the graph after the fusions)")
    if p.cp != 1:
        if p.sequence_parallel:
            raise RecipeError(source, "parallel.sequence_parallel", f"sequence_parallel with cp={p.cp} is not "
                                                                    "implemented (docs/context_parallel.md): the "
                                                                    "prefill is already split along the tokens")
        names = [ps.name for ps in r.passes if ps.enabled]
        if p.tp > 1 and "partition_cp" in names and "partition_tp" in names and \
                names.index("partition_cp") < names.index("partition_tp"):
            raise RecipeError(source, "passes", "partition_tp must come before partition_cp (world rank = "
                                                "cp index * tp + tp index)")
        if r.backend.name != "cuda":
            raise RecipeError(source, "parallel.cp", f"cp={p.cp} runs its ranks over torch.distributed on backend "
                                                     f"cuda, got backend {r.backend.name!r} (it runs one rank)")
        if not any(ps.name == "partition_cp" and ps.enabled for ps in r.passes):
            raise RecipeError(source, "parallel.cp", f"cp={p.cp} needs the partition_cp pass in passes (after the "
                                                     "fusions; it writes one prefill graph per rank)")
    if p.sequence_parallel and p.tp < 2:
        raise RecipeError(
            source, "parallel.sequence_parallel", f"sequence_parallel requires parallel.tp > 1, got tp={p.tp}"
        )
    if p.tp % p.ep:
        raise RecipeError(source, "parallel.ep", f"ep={p.ep} must divide parallel.tp={p.tp} (experts are split "
                                                 "within the tensor-parallel group)")
    if p.tp > 1:
        if r.backend.name != "cuda":
            raise RecipeError(source, "parallel.tp", f"tp={p.tp} runs its ranks over torch.distributed on backend "
                                                     f"cuda, got backend {r.backend.name!r} (it runs one rank)")
        if not any(ps.name == "partition_tp" and ps.enabled for ps in r.passes):
            raise RecipeError(source, "parallel.tp", f"tp={p.tp} needs the partition_tp pass in passes (after the "
                                                     "fusions; it writes one graph per rank)")
        if m.preset is not None:
            from kimi_compile.config import preset

            for key, msg in parallel_problems(preset(m.preset), p):
                raise RecipeError(source, key, f"{msg} (preset {m.preset})")
    target, backend = r.target, r.backend.name
    if not target or not re.fullmatch(r"[a-z0-9_]+", target):
        raise RecipeError(source, "target", f"expected a target such as cpu, cuda, sm90 or sm120, got {target!r}")
    if backend == "onnxruntime" and target != "cpu":
        raise RecipeError(source, "target", f"backend onnxruntime builds for target cpu, got {target!r}")
    if backend == "cuda" and not (target == "cuda" or _GPU_ARCH.fullmatch(target)):
        raise RecipeError(
            source, "target", f"backend cuda needs a GPU target (cuda or an arch like sm90), got {target!r}"
        )
    if backend == "tensorrt" and not _GPU_ARCH.fullmatch(target):
        raise RecipeError(
            source, "target",
            f"backend tensorrt builds engines for a GPU arch (e.g. sm89, sm120), got {target!r}",
        )


def parallel_problems(cfg, p: ParallelSpec) -> list[tuple[str, str]]:
    """(recipe key, message) for every size of the model `cfg` (a KimiConfig) that the parallel layout `p` cannot
    split evenly: heads and the dense MLP over tp, the vocabulary over tp, experts over ep, each expert's
    intermediate dim over tp/ep, the routed latent and the shared experts over tp."""
    out = []
    tp, ep = p.tp, p.ep

    def need(key: str, n: int, parts: int, what: str) -> None:
        if parts > 1 and n % parts:
            out.append((f"parallel.{key}", f"{key}={getattr(p, key)} does not divide {what} ({n} % {parts} = "
                                            f"{n % parts})"))

    need("tp", cfg.num_attention_heads, tp, "num_attention_heads: MLA heads are split across ranks")
    if cfg.kda_layer_ids:
        need("tp", cfg.kda_num_heads, tp, "linear_attn_config.num_heads: KDA heads are split across ranks")
    need("tp", cfg.vocab_size, tp, "vocab_size: the embedding and LM head are split across ranks")
    if any(not cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
        need("tp", cfg.intermediate_size, tp, "intermediate_size: dense MLPs are split across ranks")
    if cfg.num_experts:
        need("ep", cfg.num_experts, ep, "num_experts: experts are split across ep ranks")
        if tp // ep > 1 and cfg.moe_intermediate_size % (tp // ep):
            out.append(("parallel.tp", f"tp/ep={tp // ep} does not divide moe_intermediate_size "
                                       f"({cfg.moe_intermediate_size}): each expert is split across tp/ep ranks"))
        if cfg.routed_expert_hidden_size:
            need("tp", cfg.routed_expert_hidden_size, tp, "routed_expert_hidden_size: the latent up-projection is "
                                                          "split across ranks")
        need("tp", cfg.moe_intermediate_size * cfg.num_shared_experts, tp,
             "the shared experts' intermediate size: shared experts are split across ranks")
    return out


def parse_recipe(data: Any, source: str = "<str>") -> Recipe:
    """Validates a recipe mapping (as read from YAML) and returns a Recipe; errors name `source` and the key path."""
    if not isinstance(data, dict):
        raise RecipeError(source, "", f"a recipe is a mapping at the top level, got {_got(data)}")
    for k in data:
        if not isinstance(k, str):
            raise RecipeError(source, "", f"keys must be strings, got {_got(k)}")
        if k not in _TOP_KEYS:
            raise _unknown_key(source, k, _TOP_KEYS)
    if "name" not in data:
        raise RecipeError(source, "name", "missing required key")
    if "model" not in data:
        raise RecipeError(source, "model", "missing required key (set model.preset or model.checkpoint)")
    name = _coerce_value(str, data["name"], "name", source, {"nonempty": True})
    target = _coerce_value(str, data.get("target", "cpu"), "target", source, {"nonempty": True})
    recipe = Recipe(
        name=name,
        model=coerce_options(ModelSpec, data["model"], "model", source),
        export=coerce_options(ExportSpec, data.get("export"), "export", source),
        passes=_parse_passes(data.get("passes"), source),
        precision=_parse_precision(data.get("precision"), source),
        parallel=coerce_options(ParallelSpec, data.get("parallel"), "parallel", source),
        backend=coerce_options(BackendSpec, _none_to_empty(data.get("backend"), "options"), "backend", source),
        target=target,
        verify=coerce_options(VerifySpec, data.get("verify"), "verify", source),
        source=source,
    )
    _check_combinations(recipe, source)
    return recipe


def _none_to_empty(section: Any, key: str) -> Any:
    if isinstance(section, dict) and key in section and section[key] is None:
        return {**section, key: {}}
    return section


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {mark.line + 1}, column {mark.column + 1})", mark
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Reads and validates a YAML recipe. A relative model.checkpoint is resolved against the recipe's folder."""
    source = str(path)
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(source, "", "recipe file not found") from None
    except IsADirectoryError:
        raise RecipeError(source, "", "is a directory, expected a recipe .yaml file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(source, "", f"cannot read recipe: {e}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeError(source, "", f"invalid YAML: {where}{problem}") from None
    if data is None:
        raise RecipeError(source, "", "the recipe is empty")
    recipe = parse_recipe(data, source=source)
    ckpt = recipe.model.checkpoint
    if ckpt is not None and not os.path.isabs(os.path.expanduser(ckpt)):
        resolved = str((p.parent / ckpt).resolve())
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, checkpoint=resolved))
    return recipe


# Short names accepted by with_overrides, mapped to key paths of the recipe dict.
_OVERRIDE_ALIASES = {
    "name": "name",
    "preset": "model.preset",
    "checkpoint": "model.checkpoint",
    "model": "model.checkpoint",
    "seed": "model.seed",
    "dtype": "model.dtype",
    "block_size": "export.block_size",
    "max_seq_len": "export.max_seq_len",
    "max_batch": "export.max_batch",
    "prefill_chunk": "export.prefill_chunk",
    "backend": "backend.name",
    "backend_options": "backend.options",
    "tp": "parallel.tp",
    "ep": "parallel.ep",
    "cp": "parallel.cp",
    "cp_layout": "parallel.cp_layout",
    "sequence_parallel": "parallel.sequence_parallel",
    "target": "target",
    "tolerance": "verify.tolerance",
}


def with_overrides(recipe: Recipe, **changes: Any) -> Recipe:
    """A new, re-validated Recipe with `changes` applied (e.g. checkpoint from --model, backend from --backend).

    Keys are the short names in `_OVERRIDE_ALIASES` (checkpoint, backend, target, seed, tp, ...). A value of None
    leaves that key alone. Setting a checkpoint clears model.preset (unless a preset is given too); a relative
    checkpoint is resolved against the current directory. Errors name the override: `<recipe> (--checkpoint)`.
    """
    data = recipe.to_dict()
    given = {k: v for k, v in changes.items() if v is not None}
    for k in given:
        if k not in _OVERRIDE_ALIASES:
            close = difflib.get_close_matches(k, list(_OVERRIDE_ALIASES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"with_overrides: unknown override {k!r}{hint}")
    for k, v in given.items():
        path = _OVERRIDE_ALIASES[k]
        if path == "model.checkpoint" and isinstance(v, (str, os.PathLike)):
            v = os.path.abspath(os.path.expanduser(os.fspath(v)))
            if "preset" not in given:
                data["model"]["preset"] = None
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = v
    source = recipe.source
    if given:
        source = f"{recipe.source} (overrides: {', '.join('--' + k.replace('_', '-') for k in given)})"
    out = parse_recipe(data, source=source)
    return dataclasses.replace(out, source=recipe.source)
