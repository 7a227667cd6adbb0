#!/usr/bin/env bash
# One GPU round of issue 20, in phases that fit the lent machine's 10-minute calls (the .gpu/r*.sh helpers the
# result files of rounds 16-17 name were these phases, kept outside the tree). Run from the repository root:
#
#   KIMI_COMMIT=<full sha, expanded where the history is> OUT=<dir> bash bench/gpu_round.sh PHASE [PHASE ...]
#
# Phases (each writes under $OUT; every phase after `setup` expects it to have run on the same machine):
#   setup      install the carried wheels (.whl/*.whl, e.g. fla-core) and this tree (-e, no index), no GPU work
#   build      build the small CUDA artifact (bench/e2e_gpu.py --sections build; about 200 s, Triton cache cold)
#   prebuild   the tiny builds the tests share (the suite's warm compile cache as an archive, the tiny artifacts
#              tests/backends/test_cuda_gpu.py takes) -> artifacts/gpu-tests; `tests` runs it first where missing
#   tests      the kernel GPU tests (nine files, pytest -n $KIMI_GPU_WORKERS, default 12) -> $OUT/tests.txt;
#              with artifacts/kimi-k3.1-small-cuda present its small-preset test runs too
#   kernels    bench/gpu_kernels.py --sections floors,kda_prefill,indexer,mla --quick --no-compile --skip-prefill
#              --reps 20 -> $OUT/gpu_kernels.json (baselines from .ext/lib where carried: bench/baselines)
#   e2e        decode at 32K (B = 1, 2, 8, 32) and the TTFT of a 32K prompt on the built artifact
#              -> $OUT/e2e_decode.json, $OUT/e2e_ttft.json
#   order_ab   the built artifact's decode (B = 1, 8, 32 at 32K) with the indexer as built (sorted=0, no rank stage)
#              and forced sorted, interleaved in one process (bench/topk_order_ab.py) -> $OUT/topk_order_ab.json
# Issue 20's "done when" is `tests kernels` in one call on the H200 (tests first: the second run of the tests on a
# warm Triton cache took 288.8 s on an H100 with 12 workers before `prebuild` existed, 137.8 s of it one worker's
# share of the tiny builds (pytest --durations in gpu_kernels_2026-12-07_h100_r18.json); the kernel rows about
# 80 s), after `setup prebuild build` in an earlier call on the same machine. `prebuild` needs no GPU (116 s on 2
# cores here, 157 s on the lent H100); its cache archive is keyed by torch's version, so it is built on the machine
# that runs the tests. `prebuild tests kernels` in one call does not fit 10 minutes: on an H100 (round twenty) prebuild
# and the tests reached their 355 s limit 10 tests short, leaving 200 s of a kernel section that needs about 215.
# Each phase prints its elapsed time. The timed phases (kernels, e2e, order_ab) first kill test processes a `tests`
# cut by `timeout` may have left (`no_strays`: pytest-xdist workers sharing the GPU and the host).
set -uo pipefail
: "${KIMI_COMMIT:?set KIMI_COMMIT to the full sha of the tree measured (bench/results/README.md says why)}"
: "${OUT:?set OUT to the folder the results go to}"
export KIMI_COMMIT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
ART=$PWD/artifacts/kimi-k3.1-small-cuda
PRE=$PWD/artifacts/gpu-tests
GPU_TESTS=(tests/plugins/test_kda_prefill_fused.py tests/plugins/test_triton_kernels.py
           tests/plugins/test_kda_decode_fused.py tests/plugins/test_moe_triton.py tests/plugins/test_attn_res_triton.py
           tests/plugins/test_triton_matmul_nz.py tests/plugins/test_kda_cp_gpu.py tests/backends/test_cuda_gpu.py
           tests/backends/test_kernel_cache.py)
mkdir -p "$OUT"
t0=$SECONDS
say() { echo "[gpu_round] $* ($((SECONDS - t0)) s)"; }

phase_setup() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader \
    | tee "$OUT/device.txt"
  local w
  for w in .whl/*.whl; do
    [ -e "$w" ] && "$PY" -m pip install -q --no-deps --no-index "$w"
  done
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
  # the editable install maps plugins/ and passes/ under kimi_compile (setup.py); where the machine's setuptools
  # cannot, PYTHONPATH and two links give the same import names
  if ! "$PY" -c "import kimi_compile.plugins.indexer_topk.triton" 2>/dev/null; then
    ln -sfn ../plugins kimi_compile/plugins && ln -sfn ../passes kimi_compile/passes \
      && say "setup: linked plugins/ and passes/"
  fi
}

phase_build() {
  "$PY" bench/e2e_gpu.py --sections build --out "$OUT/e2e_build.json"
}

phase_prebuild() {
  # The tiny builds each of the tests' xdist workers would otherwise repeat at once (the suite's warm compile cache:
  # 137.8 s of one worker's setup in a warm H100 run of 288.8 s, with others building the same), built once here on
  # all cores by CI's warm job (.ci/warm_cache.sh): the cache exported for KIMI_TEST_CACHE_ARCHIVE (keyed by this
  # machine's torch, so built where the tests run) and the artifacts tests/backends/test_cuda_gpu.py takes from
  # KIMI_GPU_TEST_ARTIFACTS (<recipe>.ort, <recipe>.cuda, kimi-k3.1-tiny-cuda). Needs no GPU.
  local pids=() p rc=0 r
  rm -rf "$PRE" && mkdir -p "$PRE/artifacts" || return 1
  local -x KIMI_COMPILE_CACHE="$PRE/cache" KIMI_COMPILE_CACHE_MAX_BYTES=4G  # for this phase only
  PYTHON="$PY" bash .ci/warm_cache.sh "$PRE/warm" || rc=1
  for r in kimi-k3.1-tiny kimi-k3-tiny; do
    [ $rc -eq 0 ] && mv "$PRE/warm/$r" "$PRE/artifacts/$r.ort"
    "$PY" -m kimi_compile build "recipes/$r.yaml" --backend cuda --target cuda --out "$PRE/artifacts/$r.cuda" \
      --quiet > /dev/null & pids+=($!)
  done
  "$PY" -m kimi_compile build recipes/kimi-k3.1-tiny-cuda.yaml --out "$PRE/artifacts/kimi-k3.1-tiny-cuda" --quiet \
    > /dev/null & pids+=($!)
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ $rc -eq 0 ] && "$PY" -m kimi_compile cache export "$PRE/cache.tar.gz" > /dev/null || rc=1
  return $rc
}

phase_tests() {
  local sel=(-k "not small_preset")
  if [ -d "$ART" ]; then export KIMI_SMALL_ARTIFACT="$ART"; sel=(); fi
  [ -f "$PRE/cache.tar.gz" ] || { phase_prebuild; say "prebuild: exit $?"; }
  if [ -f "$PRE/cache.tar.gz" ]; then
    export KIMI_TEST_CACHE_ARCHIVE="$PRE/cache.tar.gz" KIMI_GPU_TEST_ARTIFACTS="$PRE/artifacts"
  fi
  "$PY" -m pytest -q -n "${KIMI_GPU_WORKERS:-12}" -rfEs -p no:cacheprovider --durations=8 \
    "${GPU_TESTS[@]}" "${sel[@]}" 2>&1 | tee "$OUT/tests.txt" | tail -15
  return "${PIPESTATUS[0]}"
}

no_strays() {
  # An earlier phase cut by `timeout` can leave its pytest-xdist workers running; they would share the GPU and the
  # host with the rows timed next. Kill them (never this script's own ancestors) and say so.
  local anc=" $$ " p=$$ pid strays=""
  while [ "$p" -gt 1 ] 2>/dev/null; do p=$(ps -o ppid= -p "$p" | tr -d ' '); anc+="$p "; done
  for pid in $(pgrep -f -- "-m pytest|execnet|xdist" || true); do
    [[ "$anc" == *" $pid "* ]] || strays+="$pid "
  done
  [ -z "$strays" ] && return 0
  say "killing stray test processes before timing: $strays"
  kill $strays 2>/dev/null; sleep 2; kill -9 $strays 2>/dev/null
  return 0
}

phase_kernels() {
  no_strays
  "$PY" bench/gpu_kernels.py --sections floors,kda_prefill,indexer,mla --quick --no-compile --skip-prefill --reps 20 \
    --out "$OUT/gpu_kernels.json"
}

phase_e2e() {
  no_strays
  [ -d "$ART" ] || { echo "gpu_round: e2e needs the artifact $ART (run the build phase first)" >&2; return 1; }
  "$PY" bench/e2e_gpu.py --sections decode --decode 1x32768,2x32768,8x32768,32x32768 --eager-decode "" \
    --ref-decode "" --steps 32 --out "$OUT/e2e_decode.json" || return 1
  "$PY" bench/e2e_gpu.py --sections ttft --ttft 32768 --ref-ttft "" --out "$OUT/e2e_ttft.json"
}

phase_order_ab() {
  no_strays
  [ -d "$ART" ] || { echo "gpu_round: order_ab needs the artifact $ART (run the build phase first)" >&2; return 1; }
  "$PY" bench/topk_order_ab.py --out "$OUT/topk_order_ab.json"
}

[ $# -gt 0 ] || { sed -n 2,25p "$0"; exit 2; }
rc=0
for p in "$@"; do
  case "$p" in
    setup|build|prebuild|tests|kernels|e2e|order_ab) ;;
    *) echo "gpu_round: unknown phase '$p' (known: setup build prebuild tests kernels e2e order_ab)" >&2; exit 2 ;;
  esac
done
for p in "$@"; do
  "phase_$p"; r=$?
  say "$p: exit $r"
  [ $r -eq 0 ] || rc=$r
done
exit $rc
