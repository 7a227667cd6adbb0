"""Text in, text out: the checkpoint's tokenizer, carried into the artifact and loaded by the runtime.

Two shapes of checkpoint tokenizer are read, with their own libraries (no hand-written tokenizer):

    tokenizer.json                          a Hugging Face `tokenizers` file (BPE, WordPiece, ...)
    tiktoken.model + tokenizer_config.json  the released K3's tiktoken BPE ranks (base64 token, rank per line);
                                            special tokens from tokenizer_config.json's added_tokens_decoder

`tokenizer_config.json` may hold a `chat_template` (Jinja, rendered with jinja2 as transformers does: `messages`,
`add_generation_prompt`, the special tokens); a `chat_template.jinja` file takes precedence. The build copies the
files named in TOKENIZER_FILES into `tokenizer/` of the artifact (their sha256 are in the manifest like every file)
and records `manifest["tokenizer"] = {kind, files, chat_template, eos_token}`.

Imports no torch: the runtime loads tokenizers with it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_FILES", "TokenizerError", "Tokenizer", "describe", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
ARTIFACT_DIR = "tokenizer"
# The pre-tokenizer split of Kimi's tiktoken models (as in the released tokenization_kimi.py)
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class TokenizerError(ValueError):
    """A tokenizer cannot be read or used; the message names the file or what is missing."""


def _read_config(root: Path) -> dict[str, Any]:
    path = root / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return cfg


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(root: Path, cfg: dict[str, Any]) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


def describe(root: str | Path) -> dict[str, Any] | None:
    """What a checkpoint dir ships: {kind, files, chat_template, eos_token}, or None without a tokenizer."""
    root = Path(root)
    files = [f for f in TOKENIZER_FILES if (root / f).is_file()]
    if "tokenizer.json" in files:
        kind = "tokenizers"
    elif "tiktoken.model" in files:
        kind = "tiktoken"
    else:
        return None
    cfg = _read_config(root)
    return {"kind": kind, "files": files, "chat_template": _chat_template(root, cfg) is not None,
            "eos_token": _token_text(cfg.get("eos_token"))}


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, apply_chat_template(messages) -> text."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        info = describe(self.root)
        if info is None:
            raise TokenizerError(f"{self.root}: no tokenizer.json or tiktoken.model")
        self.kind = info["kind"]
        self.config = _read_config(self.root)
        self.chat_template = _chat_template(self.root, self.config)
        self._special: dict[str, int] = {}
        if self.kind == "tokenizers":
            self._impl = self._load_tokenizers()
        else:
            self._impl = self._load_tiktoken()

    # -- backends ------------------------------------------------------------------------------------------------

    def _load_tokenizers(self):
        from tokenizers import Tokenizer as HFTokenizer

        path = self.root / "tokenizer.json"
        try:
            return HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own Exception type on malformed files
            raise TokenizerError(f"{path}: not a valid tokenizers file ({e})") from None

    def _load_tiktoken(self):
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError(f"{self.root / 'tiktoken.model'}: reading it needs the tiktoken package "
                                 "(pip install tiktoken)") from None
        path = self.root / "tiktoken.model"
        ranks: dict[bytes, int] = {}
        try:
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{path}: line {n}: expected '<base64 token> <rank>' ({e})") from None
        for key, entry in (self.config.get("added_tokens_decoder") or {}).items():
            text = _token_text(entry)
            if text is not None:
                self._special[text] = int(key)
        return tiktoken.Encoding(name=self.root.name or "kimi", pat_str=self.config.get("pat_str", KIMI_PAT_STR),
                                 mergeable_ranks=ranks, special_tokens=self._special)

    # -- API ---------------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. from a chat template) become their ids."""
        if self.kind == "tokenizers":
            return list(self._impl.encode(text, add_special_tokens=False).ids)
        return list(self._impl.encode(text, allowed_special="all"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "tokenizers":
            return self._impl.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            special = set(self._special.values())
            ids = [i for i in ids if i not in special]
        return self._impl.decode(ids)

    def token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if self.kind == "tokenizers":
            return self._impl.token_to_id(token)
        return self._special.get(token)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template rendered over `messages` ([{role, content}]), as transformers renders it."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.root}: the checkpoint has no chat template (tokenizer_config.json "
                                 "chat_template or chat_template.jinja); run without --chat")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        specials = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in specials.items() if v is not None})
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.root}: the chat template fails to render ({e})") from None


def load_tokenizer(artifact_dir: str | Path, manifest: dict[str, Any]) -> Tokenizer | None:
    """The artifact's tokenizer (its files were hash-checked with the manifest), or None when it ships none."""
    if not manifest.get("tokenizer"):
        return None
    return Tokenizer(Path(artifact_dir) / ARTIFACT_DIR)
