#!/usr/bin/env bash
# One script for a session that has a GPU machine: configure and build, run the gpu tests, the sanitizers and
# the benchmarks, and leave every log under $OUT (the device tool's output folder; ./gpu-session-out otherwise).
#
#   bash bench/gpu/gpu_session.sh check     # build + ctest -L gpu + compute-sanitizer memcheck
#   bash bench/gpu/gpu_session.sh sanitize  # build (a no-op when warm) + racecheck, synccheck, initcheck
#   bash bench/gpu/gpu_session.sh bench     # build (a no-op when warm) + kvret-bench-gpu + torch_peer.py
#   bash bench/gpu/gpu_session.sh backend   # build + the whole C++ suite and the C program on the CUDA backend
#   bash bench/gpu/gpu_session.sh backend-memcheck  # backend + memcheck of the backend's tests
#   bash bench/gpu/gpu_session.sh backend-bench     # build + kvret-bench-backend (CPU vs CUDA backend per step)
#   bash bench/gpu/gpu_session.sh proof     # build + backend + memcheck (backend and kernels) + the other sanitizers
#   bash bench/gpu/gpu_session.sh first     # build + ctest -L gpu + backend + bench --quick (one cold call)
#   bash bench/gpu/gpu_session.sh all       # everything (more than one 10-minute device call on a cold machine)
#   bash bench/gpu/gpu_session.sh device-check  # the device check: under 8 minutes on one H100 from a fresh
#                                               # machine (docs/cuda_backend.md, "The device check")
#
# Environment: BUILD (build folder, default build-gpu), GTEST_PREFIX (an installed GoogleTest to use when the
# machine has none, e.g. build-deps/gtest carried from the development machine; see docs/cuda.md), GTEST_SOURCE
# (GoogleTest's source, e.g. a copy of Debian's /usr/src/googletest: built and installed first when GTEST_PREFIX is
# unset), QUICK=1 (the benchmarks' --quick).
set -uo pipefail
phase=${1:-all}
OUT=${OUT:-$PWD/gpu-session-out}
BUILD=${BUILD:-build-gpu}
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

build() {
  { nvidia-smi; nvidia-smi -q | grep -iE 'product name|addressing|driver version|cuda version'; nvcc --version;
    compute-sanitizer --version; nproc; } >"$OUT/nvidia-smi.txt" 2>&1
  note "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)" \
    "$(nvidia-smi -q 2>/dev/null | grep -i 'addressing mode' | tr -s ' ')"
  if [[ -z "${GTEST_PREFIX:-}" && -n "${GTEST_SOURCE:-}" ]]; then
    GTEST_PREFIX=/tmp/kvret-gtest
    if ! { cmake -S "$GTEST_SOURCE" -B /tmp/kvret-gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release &&
      cmake --build /tmp/kvret-gtest-build && cmake --install /tmp/kvret-gtest-build --prefix "$GTEST_PREFIX"; } \
      >"$OUT/gtest.txt" 2>&1; then
      note "googletest: FAILED"; tail -30 "$OUT/gtest.txt"; return 1
    fi
  fi
  local prefix=()
  if [[ -n "${GTEST_PREFIX:-}" ]]; then prefix=(-DCMAKE_PREFIX_PATH="$(realpath "$GTEST_PREFIX")"); fi
  # BUILD_ARGS: more configure options (the device check builds for this machine's GPU alone: native)
  # shellcheck disable=SC2086
  if ! cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVRET_CUDA=ON -DKVRET_BUILD_BINDINGS=OFF \
    -DKVRET_BUILD_TOOLS=OFF -DKVRET_BUILD_BENCH=ON -DKVRET_BUILD_TESTS=ON "${prefix[@]}" ${BUILD_ARGS:-} \
    >"$OUT/configure.txt" 2>&1; then
    note "configure: FAILED"; tail -30 "$OUT/configure.txt"; return 1
  fi
  if ! ninja -C "$BUILD" test_gpu >"$OUT/build.txt" 2>&1; then
    note "build: FAILED"; tail -40 "$OUT/build.txt"; return 1
  fi
  if [[ "${BUILD_MINIMAL:-0}" == 1 ]]; then  # the device check's targets only
    ninja -C "$BUILD" test_cpu kvret-bench-backend >>"$OUT/build.txt" 2>&1 ||
      { note "build of test_cpu, kvret-bench-backend: FAILED"; tail -40 "$OUT/build.txt"; return 1; }
    note "build: ok"
    return 0
  fi
  ninja -C "$BUILD" kvret-bench-gpu >>"$OUT/build.txt" 2>&1 || note "kvret-bench-gpu: not built (see build.txt)"
  ninja -C "$BUILD" kvret-bench-backend >>"$OUT/build.txt" 2>&1 || note "kvret-bench-backend: not built (see build.txt)"
  ninja -C "$BUILD" test_cpu test_c_api_managed >>"$OUT/build.txt" 2>&1 ||
    note "test_cpu/test_c_api_managed: not built (see build.txt)"
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

gpu_tests() {
  (cd "$BUILD" && timeout "${GPU_TESTS_SECONDS:-300}" ctest -L gpu --output-on-failure --timeout 120) \
    >"$OUT/ctest.txt" 2>&1
  note "ctest -L gpu: rc=$? $(grep -E 'tests passed|tests failed' "$OUT/ctest.txt" | tail -1)"
  note "skipped: $(grep -c '(Skipped)' "$OUT/ctest.txt") (0 expected on a GPU machine)"
}

check() {
  gpu_tests
  sanitize memcheck "${MEMCHECK_SECONDS:-240}" --leak-check full
}

sanitizers() {
  sanitize racecheck "${RACECHECK_SECONDS:-240}" --racecheck-report hazard
  sanitize synccheck "${SYNCCHECK_SECONDS:-120}"
  sanitize initcheck "${INITCHECK_SECONDS:-120}"
}

# memcheck_suite NAME SECONDS FILTER WHAT: compute-sanitizer memcheck over the C++ suite's tests FILTER on the CUDA
# backend, on the GPU, logged to $OUT/NAME.txt
memcheck_suite() {
  local name=$1 seconds=$2 filter=$3 what=$4
  (export KVRET_TEST_DEVICE=cuda CUDA_LAUNCH_BLOCKING=1
    timeout "$seconds" compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$BUILD/bin/test_cpu" --gtest_brief=1 "--gtest_filter=$filter" >"$OUT/$name.txt" 2>&1)
  note "memcheck of $what: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/$name.txt" | tail -1)" \
    "$(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.txt" | tr '\n' ' ')"
}

# memcheck over the CUDA backend's own tests and the suite's fetch and attend tests, on the GPU
backend_memcheck() {
  memcheck_suite backend_memcheck "${BACKEND_MEMCHECK_SECONDS:-120}" '*Cuda*:*Fetch*:*Attend*:*Working*' \
    "the CUDA backend's tests"
}

# The whole C++ suite and the C program against device_type = KVRET_DEVICE_CUDA on the GPU (as scripts/
# cuda_backend_omp.sh does on Thrust's OpenMP system). In a build with the CUDA runtime their tensors are managed
# memory (tests/cpu/test_util.hpp, test_c_api_managed); CUDA_LAUNCH_BLOCKING makes every stream-ordered call
# complete before a test reads its outputs.
backend() {
  local t=${BACKEND_SECONDS:-240}
  (export KVRET_TEST_DEVICE=cuda CUDA_LAUNCH_BLOCKING=1
    timeout "$t" "$BUILD/bin/test_cpu" --gtest_brief=1 >"$OUT/backend_cpu_suite.txt" 2>&1
    echo "rc=$?" >>"$OUT/backend_cpu_suite.txt"
    timeout 60 "$BUILD/bin/test_c_api_managed" >"$OUT/backend_c_api.txt" 2>&1
    echo "rc=$?" >>"$OUT/backend_c_api.txt")
  note "C++ suite on the CUDA backend: $(tail -1 "$OUT/backend_cpu_suite.txt") $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/backend_cpu_suite.txt" | tr '\n' ' ')"
  note "C program on the CUDA backend: $(tail -2 "$OUT/backend_c_api.txt" | tr '\n' ' ')"
}

# one decode step through the C ABI, CPU backend against CUDA backend
backend_bench() {
  local quick=()
  if [[ "${QUICK:-0}" == 1 ]]; then quick=(--quick); fi
  timeout "${BENCH_SECONDS:-400}" "$BUILD/bin/kvret-bench-backend" "${quick[@]}" >"$OUT/bench_backend.txt" 2>&1
  note "kvret-bench-backend: rc=$?"
  grep -hE '^section=backend' "$OUT/bench_backend.txt" | tee -a "$summary"
}

bench() {
  local quick=()
  if [[ "${QUICK:-0}" == 1 ]]; then quick=(--quick); fi
  timeout "${BENCH_SECONDS:-400}" "$BUILD/bin/kvret-bench-gpu" "${quick[@]}" >"$OUT/bench_kvret.txt" 2>&1
  note "kvret-bench-gpu: rc=$?"
  timeout "${BENCH_SECONDS:-400}" python3 bench/gpu/torch_peer.py "${quick[@]}" >"$OUT/bench_torch.txt" 2>&1
  note "torch_peer.py: rc=$?"
  grep -hE '^(device|section=select|section=fetch)' "$OUT/bench_kvret.txt" "$OUT/bench_torch.txt" | tee -a "$summary"
}

# The device check: the GPU tests, compute-sanitizer memcheck over the decode-step tests on the CUDA backend, and
# the step benchmark (kvret-bench-backend --step: 32k and 128k tokens x batch 1, 8, 32, PQ and EXACT, f16, hit
# rates and the physical floor) beside its PyTorch peers (dense SDPA over the whole KV, torch.topk's select), in
# one run. Each part is bounded in time so that the whole stays under 8 minutes.
device_check() {
  local t0=$SECONDS
  GPU_TESTS_SECONDS=${GPU_TESTS_SECONDS:-90} gpu_tests
  memcheck_suite step_memcheck "${STEP_MEMCHECK_SECONDS:-90}" '*SteadyState*:*AttendOnDevice*' \
    "the decode-step tests"
  note "capture/replay: none yet (the step is not capturable: docs/cuda_backend.md)"
  timeout "${STEP_BENCH_SECONDS:-150}" "$BUILD/bin/kvret-bench-backend" --step --steps=10 >"$OUT/step_kvret.txt" 2>&1
  note "kvret-bench-backend --step: rc=$?"
  timeout "${STEP_PEER_SECONDS:-90}" python3 bench/gpu/torch_peer.py --sections step --reps 10 >"$OUT/step_torch.txt" 2>&1
  note "torch_peer.py --sections step: rc=$?"
  grep -hE '^(device|section=step)' "$OUT/step_kvret.txt" "$OUT/step_torch.txt" | tee -a "$summary"
  note "device check: $((SECONDS - t0)) s after the build"
}

case "$phase" in
  check) build && check ;;
  sanitize) build && sanitizers ;;
  bench) build && bench ;;
  backend) build && backend ;;
  backend-memcheck) build && backend && backend_memcheck ;;
  backend-bench) build && backend_bench ;;
  proof) build && backend && backend_memcheck && sanitize memcheck "${MEMCHECK_SECONDS:-240}" --leak-check full &&
    sanitizers ;;
  first) build && gpu_tests && backend && QUICK=1 bench ;;
  all) build && check && sanitizers && backend && bench && backend_bench ;;
  device-check)  # its own build folder, for this machine's GPU alone
    BUILD=${BUILD_CHECK:-build-check}
    BUILD_ARGS=${CHECK_BUILD_ARGS:--DCMAKE_CUDA_ARCHITECTURES=native}
    BUILD_MINIMAL=1
    if [[ "${SKIP_BUILD:-0}" == 1 ]]; then device_check; else build && device_check; fi ;;
  *) echo "usage: $0 check|sanitize|bench|backend|backend-memcheck|backend-bench|proof|first|all|device-check" >&2
    exit 2 ;;
esac
echo "---- summary ($OUT/summary.txt)"
cat "$summary"
