"""Cold vs warm `kimi-compile build`, and a late pass-option change, each in a fresh process, in one run.

    python bench/build_cache.py [--recipe recipes/kimi-k3.1-tiny.yaml] [--reps 3]

Writes bench/results/build_cache_<date>.json (the commit measured, device, versions, command, medians, ratio,
per-stage cache hits; bench/run_info.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(args: list[str], env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kimi_compile.cli", *args], check=True, env=env, capture_output=True)
    dt = time.perf_counter() - t0
    out = args[args.index("--out") + 1]
    return dt, json.loads((Path(out) / "manifest.json").read_text())["compile_cache"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "kimi-k3.1-tiny.yaml"))
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from run_info import commit

    from kimi_compile.build import versions

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "KIMI_COMPILE_CACHE": f"{tmp}/cache"}
        cold, cold_hits = timed(["build", a.recipe, "--out", f"{tmp}/cold"], env)
        warm = []
        for i in range(a.reps):
            dt, warm_hits = timed(["build", a.recipe, "--out", f"{tmp}/warm{i}"], env)
            warm.append(dt)
        # a late pass option changes: only infer_shapes (and the backend after it) may re-run
        text = Path(a.recipe).read_text().replace(
            "  - name: infer_shapes\n    enabled: true\n    options: {}", "  - name: infer_shapes\n    enabled: true\n"
            "    options: {data_prop: false}")
        changed = Path(tmp) / "changed.yaml"
        changed.write_text(text)
        late, late_hits = timed(["build", str(changed), "--out", f"{tmp}/late"], env)
    rows = {
        "cold_s": round(cold, 3), "cold_cache": cold_hits,
        "warm_s_median": round(statistics.median(warm), 3), "warm_s_all": [round(w, 3) for w in warm],
        "warm_cache": warm_hits, "cold_over_warm": round(cold / statistics.median(warm), 1),
        "late_option_change_s": round(late, 3), "late_option_change_cache": late_hits,
    }
    result = {
        "benchmark": "build_cache", "date": datetime.date.today().isoformat(),
        "command": " ".join([sys.executable, *sys.argv]), **commit(), "recipe": a.recipe,
        "device": {"machine": platform.machine(), "processor": platform.processor() or "unknown",
                   "cpus": os.cpu_count()},
        "versions": versions(), "results": rows,
        "note": "each build is a fresh process (imports included); warm = same recipe, same cache",
    }
    out = ROOT / "bench" / "results" / f"build_cache_{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(out)  # never a half-written result
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
