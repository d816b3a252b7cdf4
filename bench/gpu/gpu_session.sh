#!/usr/bin/env bash
# One script for a session that has a GPU machine: configure and build, run the gpu tests, the sanitizers and
# the benchmarks, and leave every log under $OUT (the device tool's output folder; ./gpu-session-out otherwise).
#
#   bash bench/gpu/gpu_session.sh check     # build + ctest -L gpu + compute-sanitizer memcheck
#   bash bench/gpu/gpu_session.sh sanitize  # build (a no-op when warm) + racecheck, synccheck, initcheck
#   bash bench/gpu/gpu_session.sh bench     # build (a no-op when warm) + kvret-bench-gpu + torch_peer.py
#   bash bench/gpu/gpu_session.sh all       # everything (more than one 10-minute device call on a cold machine)
#
# Environment: BUILD (build folder, default build-gpu), GTEST_PREFIX (an installed GoogleTest to use when the
# machine has none, e.g. build-deps/gtest carried from the development machine; see docs/cuda.md), QUICK=1 (the
# benchmarks' --quick).
set -uo pipefail
phase=${1:-all}
OUT=${OUT:-$PWD/gpu-session-out}
BUILD=${BUILD:-build-gpu}
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

build() {
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  local prefix=()
  if [[ -n "${GTEST_PREFIX:-}" ]]; then prefix=(-DCMAKE_PREFIX_PATH="$(realpath "$GTEST_PREFIX")"); fi
  if ! cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVRET_CUDA=ON -DKVRET_BUILD_BINDINGS=OFF \
    -DKVRET_BUILD_TOOLS=OFF -DKVRET_BUILD_BENCH=ON -DKVRET_BUILD_TESTS=ON "${prefix[@]}" >"$OUT/configure.txt" 2>&1; then
    note "configure: FAILED"; tail -30 "$OUT/configure.txt"; return 1
  fi
  if ! ninja -C "$BUILD" test_gpu >"$OUT/build.txt" 2>&1; then
    note "build: FAILED"; tail -40 "$OUT/build.txt"; return 1
  fi
  ninja -C "$BUILD" kvret-bench-gpu >>"$OUT/build.txt" 2>&1 || note "kvret-bench-gpu: not built (see build.txt)"
  note "build: ok"
}

# The 128k-token top-k and the PQ-sized k-means are the slow ones under the sanitizers; smaller cases of the same
# code paths stay in.
SANITIZER_FILTER='--gtest_filter=-*At128kTokens*:*ChunkedGemms*'

sanitize() {  # sanitize TOOL SECONDS [extra compute-sanitizer options]
  local tool=$1 seconds=$2
  shift 2
  timeout "$seconds" compute-sanitizer --tool "$tool" --error-exitcode 1 "$@" "$BUILD/bin/test_gpu" \
    "$SANITIZER_FILTER" >"$OUT/$tool.txt" 2>&1
  note "$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.txt" | tail -1)"
}

check() {
  (cd "$BUILD" && ctest -L gpu --output-on-failure --timeout 300) >"$OUT/ctest.txt" 2>&1
  note "ctest -L gpu: rc=$? $(grep -E 'tests passed|tests failed' "$OUT/ctest.txt" | tail -1)"
  note "skipped: $(grep -c '(Skipped)' "$OUT/ctest.txt") (0 expected on a GPU machine)"
  sanitize memcheck 240 --leak-check full
}

sanitizers() {
  sanitize racecheck 240 --racecheck-report hazard
  sanitize synccheck 120
  sanitize initcheck 120
}

bench() {
  local quick=()
  if [[ "${QUICK:-0}" == 1 ]]; then quick=(--quick); fi
  "$BUILD/bin/kvret-bench-gpu" "${quick[@]}" >"$OUT/bench_kvret.txt" 2>&1
  note "kvret-bench-gpu: rc=$?"
  python3 bench/gpu/torch_peer.py "${quick[@]}" >"$OUT/bench_torch.txt" 2>&1
  note "torch_peer.py: rc=$?"
  grep -hE '^(device|section=select|section=fetch)' "$OUT/bench_kvret.txt" "$OUT/bench_torch.txt" | tee -a "$summary"
}

case "$phase" in
  check) build && check ;;
  sanitize) build && sanitizers ;;
  bench) build && bench ;;
  all) build && check && sanitizers && bench ;;
  *) echo "usage: $0 check|sanitize|bench|all" >&2; exit 2 ;;
esac
echo "---- summary ($OUT/summary.txt)"
cat "$summary"
