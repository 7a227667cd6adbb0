"""kimi_compile/tokenizer.py and text prompts: the checkpoint's tokenizer travels into the artifact (hashed), `run
--prompt` prints text, `--chat` applies the chat template, `--json` returns ids and text."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kimi_compile.artifact import ArtifactError, load_manifest
from kimi_compile.cli import main
from kimi_compile.runtime import load
from kimi_compile.runtime.session import RuntimeInputError
from kimi_compile.tokenizer import Tokenizer, TokenizerError, describe
from tests.conftest import CHAT_TEMPLATE, write_tokenizer


def test_artifact_carries_the_tokenizer_hashed(text_build):
    m = load_manifest(text_build)
    assert m["tokenizer"] == {"kind": "tokenizers", "files": ["tokenizer.json", "tokenizer_config.json"],
                              "chat_template": True, "eos_token": "<|im_end|>"}
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= set(m["files"])
    assert m["summary"]["tokenizer"] == "tokenizers, chat template"


def test_tampered_tokenizer_is_refused(text_build, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(text_build, bad)
    path = bad / "tokenizer" / "tokenizer_config.json"
    path.write_text(path.read_text().replace("im_end", "im_END"))
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer_config.json"):
        load(bad)


def test_run_prompt_prints_text_matching_the_ids_path(text_build):
    sess = load(text_build)
    ids = sess.encode_text("The cat sat on")
    want = sess.generate([ids], 6)[0]
    r = CliRunner().invoke(main, ["run", str(text_build), "--prompt", "The cat sat on", "--max-new-tokens", "6"])
    assert r.exit_code == 0, r.output
    assert r.output.rstrip("\n") == sess.decode_text(want)
    r = CliRunner().invoke(main, ["run", str(text_build), "--prompt", "The cat sat on", "--max-new-tokens", "6",
                                  "--json"])
    doc = json.loads(r.output)
    assert doc["prompts"] == ["The cat sat on"] and doc["prompt_ids"] == [ids]
    assert doc["tokens"] == want and doc["text"] == [sess.decode_text(want)]


def test_batch_of_text_prompts_and_chat_template(text_build):
    sess = load(text_build)
    r = CliRunner().invoke(main, ["run", str(text_build), "--chat", "--prompt", "Hello!", "--prompt",
                                  "How are you today?", "--max-new-tokens", "4", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    templated = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert sess.tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}]) == templated
    assert doc["prompt_ids"][0] == sess.encode_text(templated)
    assert sess.tokenizer.token_id("<|im_start|>") == doc["prompt_ids"][0][0] == 1  # a special token, one id
    assert len(doc["tokens"]) == 2 and len(doc["text"]) == 2
    assert doc["tokens"] == sess.generate(doc["prompt_ids"], 4)


def test_run_usage_errors_are_one_line(text_build, tiny_build):
    cases = [
        (["run", str(text_build)], "either as text"),
        (["run", str(text_build), "--prompt", "a", "--prompt-ids", "1"], "either as text"),
        (["run", str(text_build), "--chat", "--prompt-ids", "1"], "--chat applies"),
        (["run", str(tiny_build[1].artifact), "--prompt", "hello"], "this artifact has no tokenizer"),
    ]
    for args, msg in cases:
        r = CliRunner().invoke(main, args)
        assert r.exit_code != 0 and msg in r.output and "Traceback" not in r.output, (args, r.output)


def test_runtime_with_tokenizer_imports_no_torch(text_build):
    code = ("import sys; from kimi_compile.runtime import load; s = load(%r); "
            "print(s.decode_text(s.generate([s.encode_text('hi there')], 2)[0])); "
            "assert 'torch' not in sys.modules, 'torch was imported'") % str(text_build)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_no_chat_template_is_a_clear_error(tmp_path):
    write_tokenizer(tmp_path, 400)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = Tokenizer(tmp_path)
    assert tok.decode(tok.encode("The cat sat on the mat.")) == "The cat sat on the mat."
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def _tiktoken_checkpoint(root) -> None:
    """The released K3's shape: tiktoken.model (base64 token, rank) + tokenizer_config.json with the special
    tokens in added_tokens_decoder and a chat_template."""
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"at", b" c", b" cat"]
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in
                                                 enumerate(ranks)))
    n = len(ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "<|im_start|>", "special": True},
                                 str(n + 1): {"content": "<|im_end|>", "special": True}},
        "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))


def test_tiktoken_checkpoint(tmp_path):
    pytest.importorskip("tiktoken")
    _tiktoken_checkpoint(tmp_path)
    assert describe(tmp_path) == {"kind": "tiktoken", "files": ["tiktoken.model", "tokenizer_config.json"],
                                  "chat_template": True, "eos_token": "<|im_end|>"}
    tok = Tokenizer(tmp_path)
    ids = tok.encode("the cat")
    assert ids == [257, 261] and tok.decode(ids) == "the cat"  # 'the', ' cat' merged by rank
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "the cat"}]))
    assert chat[0] == tok.token_id("<|im_start|>") == 262 and 263 in chat
    assert "<|im_end|>" not in tok.decode(chat)  # special tokens skipped when decoding


def test_unreadable_tokenizer_files_name_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: not a valid tokenizers file"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tiktoken.model").write_text("only-one-field\n")
    with pytest.raises(TokenizerError, match="tiktoken.model: line 1"):
        Tokenizer(tmp_path)
    assert describe(tmp_path / "nothing") is None


def test_encode_without_tokenizer_says_what_to_do(tiny_build):
    sess = load(tiny_build[1].artifact)
    assert sess.tokenizer is None
    with pytest.raises(RuntimeInputError, match="give token ids"):
        sess.encode_text("hello")
