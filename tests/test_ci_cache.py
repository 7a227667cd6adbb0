"""CI compile-cache reuse (README "CI: reuse the compile cache"): the suite warms one cache once (or imports the
archive .ci/run's warm step exported), and its builds consume it read-only, hitting every stage."""

from __future__ import annotations

import os

from click.testing import CliRunner

from kimi_compile.cli import main
from tests.conftest import ARCHIVE_ENV, ROOT, WARM_RECIPES


def test_suite_builds_hit_every_stage_of_the_warm_cache(warm_cache, tiny_build, quant_build):
    cache, how = warm_cache
    assert cache.read_only and how == ("archive" if os.environ.get(ARCHIVE_ENV) else "built")
    for res in (tiny_build[1], quant_build[1]):
        assert all(v["misses"] == 0 and v["hits"] > 0 for v in res.cache_hits.values()), res.cache_hits
    assert {"kimi-k3.1-tiny", "kimi-k3.1-tiny-quant"} <= set(WARM_RECIPES)


def test_exported_cache_serves_a_read_only_consumer(warm_cache, tmp_path):
    """The workflow end to end: export the warm cache, import it elsewhere, build read-only: every stage hits and
    the consumer writes nothing to its cache."""
    archive = tmp_path / "cache.tar.gz"
    r = CliRunner().invoke(main, ["cache", "export", str(archive)], env={"KIMI_COMPILE_CACHE": str(warm_cache[0].root)})
    assert r.exit_code == 0, r.output
    consumer = tmp_path / "consumer"
    r = CliRunner().invoke(main, ["cache", "import", str(archive)], env={"KIMI_COMPILE_CACHE": str(consumer)})
    assert r.exit_code == 0, r.output
    files_before = sorted(p.relative_to(consumer) for p in consumer.rglob("*"))
    env = {"KIMI_COMPILE_CACHE": str(consumer), "KIMI_COMPILE_CACHE_READONLY": "1"}
    r = CliRunner().invoke(main, ["build", os.path.join(ROOT, "recipes", "kimi-k3.1-tiny.yaml"), "--out",
                                  str(tmp_path / "art")], env=env)
    assert r.exit_code == 0, r.output
    assert "trace hit, passes 14 of 14 hit, backend hit" in r.output
    assert sorted(p.relative_to(consumer) for p in consumer.rglob("*")) == files_before
