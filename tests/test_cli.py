"""kimi_compile/cli.py and what a newcomer hit (issue 22, item 8): --out safety, stage progress also when piped,
--quiet and --log-json, no blanket warning filter, the capacity limits, a readable summary, inspect and --diff,
artifact permissions."""

from __future__ import annotations

import json
import logging
import os
import stat
import warnings

import pytest
from click.testing import CliRunner

from kimi_compile.cli import main
from kimi_compile.events import NOISY_LOGGERS
from kimi_compile.runtime import load
from kimi_compile.runtime.session import RuntimeInputError
from tests.conftest import ROOT

TINY = os.path.join(ROOT, "recipes", "kimi-k3.1-tiny.yaml")


@pytest.fixture
def env(suite_cache):
    """The CLI builds against the suite's warm cache (every stage hits)."""
    return {"KIMI_COMPILE_CACHE": str(suite_cache.root), "KIMI_COMPILE_CACHE_READONLY": "0"}


def _build(args, env):
    return CliRunner().invoke(main, ["build", TINY, *args], env=env)


def test_out_dir_that_is_not_an_artifact_is_refused_never_emptied(tmp_path, env):
    keep = tmp_path / "artifacts"
    keep.mkdir()
    (keep / "README.md").write_text("mine")
    (keep / "other-artifact").mkdir()
    r = _build(["--out", str(keep)], env)
    assert r.exit_code == 1 and "is not a kimi-compile artifact" in r.output and "README.md" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert sorted(p.name for p in keep.iterdir()) == ["README.md", "other-artifact"]
    assert (keep / "README.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifacts"]  # no staging left beside it


def test_empty_dir_and_existing_artifact_are_replaced(tmp_path, env):
    out = tmp_path / "art"
    out.mkdir()
    assert _build(["--out", str(out), "--quiet"], env).exit_code == 0
    first = json.loads((out / "manifest.json").read_text())
    r = _build(["--out", str(out), "--quiet"], env)
    assert r.exit_code == 0 and r.output.strip() == str(out)  # --quiet: the path only
    graphs = {k: v for k, v in first["files"].items() if k.startswith("graphs/")}
    assert {k: v for k, v in json.loads((out / "manifest.json").read_text())["files"].items()
            if k.startswith("graphs/")} == graphs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_artifact_folders_are_readable_like_their_files(tmp_path, env):
    out = tmp_path / "art"
    old = os.umask(0o022)
    try:
        assert _build(["--out", str(out), "--quiet"], env).exit_code == 0
    finally:
        os.umask(old)
    for d in (out, out / "graphs"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755, d
    assert stat.S_IMODE((out / "manifest.json").stat().st_mode) == 0o644


def test_progress_names_every_stage_when_piped_and_summary_is_a_table(tmp_path, env):
    r = _build(["--out", str(tmp_path / "a")], env)  # CliRunner's output is not a terminal
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    for stage in ("trace: prefill and decode graphs", "passes: 7 passes x 2 phases", "backend: onnxruntime for cpu",
                  f"artifact: writing {tmp_path / 'a'}"):
        assert any(line.endswith(stage) for line in lines), stage
    assert any("trace done in" in line and "(cache hit)" in line for line in lines)
    assert "{" not in r.output  # no Python dict: the summary is a table
    summary = {line.split("  ")[0].strip(): line for line in lines if "  " in line}
    assert "trace hit, passes 14 of 14 hit, backend hit" in summary["compile cache"]
    for key in ("model", "backend", "target", "graphs", "op coverage", "cache", "capacity"):
        assert key in summary, key


def test_log_json_and_quiet(tmp_path, env):
    log = tmp_path / "events.jsonl"
    r = _build(["--out", str(tmp_path / "a"), "--quiet", "--log-json", str(log)], env)
    assert r.exit_code == 0 and r.output.strip() == str(tmp_path / "a")
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [x["stage"] for x in recs if x["event"] == "start"]
    ends = {x["stage"]: x for x in recs if x["event"] == "end"}
    assert starts == ["trace", "passes", "backend", "artifact"] and set(ends) == set(starts)
    assert ends["trace"]["cached"] is True and all(x["seconds"] >= 0 for x in ends.values())
    assert [x["t"] for x in recs] == sorted(x["t"] for x in recs)
    assert recs[-1]["event"] == "done" and recs[-1]["summary"]["model"] == "kimi-k3.1-tiny"


def test_verbose_keeps_third_party_loggers_quiet_and_warnings_unfiltered(tmp_path, env):
    before = list(warnings.filters)
    r = CliRunner().invoke(main, ["-v", "build", TINY, "--out", str(tmp_path / "a"), "--quiet"], env=env)
    assert r.exit_code == 0, r.output
    assert logging.getLogger("kimi_compile").level == logging.INFO
    assert all(logging.getLogger(n).level == logging.ERROR for n in NOISY_LOGGERS)
    added = [f for f in warnings.filters if f not in before]
    assert all(f[0] == "ignore" and f[1] is not None for f in added), added  # only known messages, never all
    assert ("ignore", None, Warning, None, 0) not in warnings.filters


def test_the_build_raises_no_warning_of_its_own(text_build_run):
    _, caught = text_build_run
    assert not [w for w in caught if "training mode" in w], caught


def test_capacity_limits_are_refused_with_the_numbers(tiny_build):
    art = str(tiny_build[1].artifact)
    sess = load(art)
    assert (sess.max_seq_len, sess.max_batch) == (256, 8)
    with pytest.raises(RuntimeInputError, match=r"9 sequences exceed this artifact's export.max_batch \(8\)"):
        sess.generate([[1, 2]] * 9, 1)
    with pytest.raises(RuntimeInputError, match=r"= 257 tokens exceed .*export.max_seq_len \(256\)"):
        sess.generate([list(range(1, 251))], 7)
    assert len(sess.generate([[1, 2]] * 8, 1)) == 8  # at the limit: fine
    r = CliRunner().invoke(main, ["run", art, "--prompt-ids", ";".join(["1,2"] * 9), "--max-new-tokens", "1"])
    assert r.exit_code == 1 and "export.max_batch (8)" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["run", art, "--prompt-ids", "1,2", "--max-new-tokens", "300"])
    assert r.exit_code == 1 and "302 tokens exceed this artifact's export.max_seq_len (256)" in r.output
    r = CliRunner().invoke(main, ["inspect", art])
    assert "max_seq_len 256 tokens per sequence, max_batch 8 sequences" in r.output


def test_inspect_opens_with_a_summary_and_diff_says_no_differences(tiny_build):
    art = str(tiny_build[1].artifact)
    r = CliRunner().invoke(main, ["inspect", art, "--diff", art])
    assert r.exit_code == 0, r.output
    head = r.output.splitlines()[:14]
    for key in ("model", "backend", "target", "graphs", "cache"):
        assert any(line.startswith(key) for line in head), (key, head)
    assert f"no differences in ops relative to {art}" in r.output
    doc = json.loads(CliRunner().invoke(main, ["inspect", art, "--json"]).output)
    for phase in ("prefill", "decode"):
        fallbacks = {k for row in doc["op_coverage"][phase]["by_component"] for k in row["fallback_ops"]}
        assert not {k for k in fallbacks if k.startswith("kimi.")}, fallbacks  # PagedWrite is a primitive


def test_report_md_op_coverage_is_a_table(tiny_build):
    text = (tiny_build[1].artifact / "report.md").read_text()
    assert "## Op coverage: prefill" in text and "| layer kind | component | fused ops |" in text
    assert "| mla+indexer | attention | kimi.IndexerTopK x2, kimi.SparseMLA x2 |" in text
    assert '"by_component"' not in text
