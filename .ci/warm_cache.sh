#!/usr/bin/env bash
# Build the recipes the test suite builds (tests/conftest.py WARM_RECIPES) into the compile cache named by
# KIMI_COMPILE_CACHE, each artifact under OUT_DIR/<recipe>: the two traces first (one per preset), then the recipes
# that reuse them, each wave at once. CI's warm job (.ci/run) and the GPU round's prebuild (bench/gpu_round.sh) use
# it; the caller exports the cache. Exits 1 if any build fails.
#
#   KIMI_COMPILE_CACHE=<dir> [PYTHON=python3] bash .ci/warm_cache.sh OUT_DIR
set -uo pipefail
: "${KIMI_COMPILE_CACHE:?set KIMI_COMPILE_CACHE to the compile cache to warm}"
out=${1:?usage: KIMI_COMPILE_CACHE=<dir> bash .ci/warm_cache.sh OUT_DIR}
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
export KIMI_COMPILE_CACHE KIMI_COMPILE_CACHE_MAX_BYTES=${KIMI_COMPILE_CACHE_MAX_BYTES:-4G}

wave() {  # build recipes $@ at once, fail if any fails
  local pids=() p rc=0 r
  for r in "$@"; do
    "$PY" -m kimi_compile build "recipes/$r.yaml" --out "$out/$r" --quiet > /dev/null &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
first="kimi-k3.1-tiny kimi-k3-tiny"
rest=$("$PY" -c "from tests.conftest import WARM_RECIPES; print(' '.join(r for r in WARM_RECIPES if r not in '$first'.split()))") \
  || exit 1
wave $first && wave $rest
