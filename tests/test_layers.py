"""The import contracts (.importlinter: layers, a torch-free runtime, GPU packages only where they belong, no import
cycles), checked with import-linter on the source laid out as installed (.ci/lint-imports)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contracts_hold():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(exe):
        pytest.fail("lint-imports (import-linter) is not installed: pip install -e '.[test]'")
    env = {**os.environ, "PATH": os.path.dirname(exe) + os.pathsep + os.environ.get("PATH", "")}
    res = subprocess.run(["bash", os.path.join(ROOT, ".ci", "lint-imports")], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout
