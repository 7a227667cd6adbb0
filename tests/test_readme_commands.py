"""The README and the CLI agree: the synopsis under "## Use" names only commands, options and choices the CLI has
(and every option the CLI has), and every example command in the README runs, in README order, in a scratch
folder (`path/to/checkpoint` is a tiny checkpoint with a tokenizer; builds hit the suite's warm compile cache).
Commands in the GPU sections (a GPU or the full TensorRT builder to run, a 7 GB build) are parsed against the CLI,
not run. The set-up commands (venv, pip) and the test command are left to CI, which runs them."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kimi_compile.cli import main
from tests.conftest import ROOT

README = Path(ROOT) / "README.md"


def _blocks(text: str) -> list[tuple[str, str, str]]:
    """[(section title, fence language, body)] of every fenced block."""
    out, section = [], ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```"):
            lang, body = line[3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((section, lang, "\n".join(body)))
        i += 1
    return out


def _synopsis() -> list[str]:
    return [b for s, _, b in _blocks(README.read_text()) if s == "Use"][0].splitlines()


def _command(path: list[str]) -> click.Command:
    cmd: click.Command = main
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


def _options(cmd: click.Command) -> dict[str, click.Option]:
    return {o: p for p in cmd.params if isinstance(p, click.Option) for o in p.opts if o.startswith("--")}


@pytest.mark.parametrize("line", _synopsis(), ids=lambda s: s.split()[1])
def test_synopsis_matches_the_cli(line):
    words = line.split()
    assert words[0] == "kimi-compile"
    cmd = _command([words[1]])
    documented = set(re.findall(r"--[a-z][a-z-]*", line))
    if isinstance(cmd, click.Group):  # cache: the group's options, then its subcommands
        subs = {w for part in words[2:] for w in part.split("|") if w.isalpha() and w.islower()}
        assert subs == set(cmd.commands), (subs, sorted(cmd.commands))
        have = set(_options(cmd))
    else:
        have = set(_options(cmd)) - {"--help"}
        for opt, choices in re.findall(r"(--[a-z-]+) ([a-z0-9]+(?:\|[a-z0-9]+)+)", line):
            p = _options(cmd)[opt]
            if isinstance(p.type, click.Choice):
                assert set(choices.split("|")) == set(p.type.choices), (opt, choices)
    assert documented == have, f"README documents {sorted(documented - have)}; CLI has {sorted(have - documented)}"
    assert {w for w in words[1:2]} <= set(main.commands)


GPU_SECTIONS = ("GPU", "H200", "TensorRT")


def _examples() -> list[tuple[str, str]]:
    """[(kind, text)]: ("cli", one kimi-compile command line), ("bash", a script that sets variables), ("parse", a
    command of a GPU section) or ("polygraphy", a polygraphy command line)."""
    out = []
    for section, lang, body in _blocks(README.read_text()):
        if section == "Use" or lang == "python":
            continue
        gpu = any(w in section for w in GPU_SECTIONS)
        if lang == "bash" and "export " in body and not gpu:
            out.append(("bash", body))
            continue
        text = body.replace("\\\n", " ")
        for line in text.splitlines():
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("kimi-compile "):
                    out.append(("parse" if gpu else "cli", part))
                elif part.startswith("polygraphy "):
                    out.append(("polygraphy", part))
    return out


def test_readme_has_the_examples_the_issue_asks_for():
    lines = [t for k, t in _examples() if k == "cli"]
    assert any("--prompt " in t for t in lines) and any(t.startswith("kimi-compile debug") for t in lines)
    assert any("--chat" in t for t in lines)
    assert any(k == "polygraphy" and "debug reduce" in t for k, t in _examples())


def test_readme_examples_run(tmp_path, monkeypatch, suite_cache, text_checkpoint):
    monkeypatch.chdir(tmp_path)
    os.symlink(os.path.join(ROOT, "recipes"), tmp_path / "recipes")
    env = {"KIMI_COMPILE_CACHE": str(suite_cache.root), "KIMI_COMPILE_CACHE_READONLY": "0"}
    ran = 0
    for kind, text in _examples():
        text = text.replace("path/to/checkpoint", str(text_checkpoint))
        for placeholder in ("SUSPECT", "GOOD"):  # the reducer recipe's two artifacts: here the tiny one twice
            text = text.replace(placeholder, "artifacts/kimi-k3.1-tiny")
        if kind == "parse":  # options and arguments must parse; running needs a GPU
            args = shlex.split(text, comments=True)[1:]
            with main.make_context("kimi-compile", list(args), resilient_parsing=False) as ctx:
                sub = main.get_command(ctx, args[0])
                sub.make_context(args[0], list(args[1:]), parent=ctx)
            continue
        if kind == "cli":
            args = shlex.split(text, comments=True)[1:]
            r = CliRunner().invoke(main, args, env=env)
            ok = (0, 1) if args[0] == "debug" else (0,)  # debug exits 1 when it finds a difference: a result
            assert r.exit_code in ok and "Traceback" not in r.output, (text, r.output[-2000:])
            if args[0] == "debug" and "--against reference" in text:
                assert r.exit_code == 0, r.output  # the tiny artifact matches its trace
        elif kind == "bash":  # the CI snippet: its warm cache starts as a copy of the suite's, so the job hits
            shutil.copytree(suite_cache.root, tmp_path / ".kimi-cache", dirs_exist_ok=True)
            path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", text], capture_output=True, text=True,
                               env={**os.environ, "PATH": path}, cwd=tmp_path)
            assert r.returncode == 0, (text, r.stdout[-2000:], r.stderr[-2000:])
            assert "trace hit, passes 14 of 14 hit, backend hit" in r.stderr
        else:  # polygraphy: the options the recipe uses exist in this polygraphy (running it takes minutes)
            words = shlex.split(text.split(" --check ")[0])
            sub = words[1:3] if words[1] in ("debug", "data") else words[1:2]
            help_text = subprocess.run([os.path.join(os.path.dirname(sys.executable), "polygraphy"), *sub, "-h"],
                                       capture_output=True, text=True).stdout
            for opt in {w.split("=")[0] for w in words if w.startswith("-")}:
                assert opt in help_text, (sub, opt)
        ran += 1
    assert ran >= 10
    assert (tmp_path / "artifacts" / "k31-text" / "tokenizer" / "tokenizer.json").is_file()
