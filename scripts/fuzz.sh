#!/usr/bin/env bash
# Builds the libFuzzer target over the C API (clang, with ASan and UBSan; the whole library instrumented for
# coverage) and runs it from the corpus in tests/fuzz/corpus for a bounded time; new inputs that reach new code are
# added to a scratch copy of the corpus.
# Usage: scripts/fuzz.sh [SECONDS] [BUILD_DIR]   (default 120 s, build-fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-120}
dir=${2:-build-fuzz}
scripts/install-deps.sh --minimal --sanitizers
flags="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRET_CUDA=OFF \
  -DKVRET_BUILD_BINDINGS=OFF -DKVRET_BUILD_BENCH=OFF -DKVRET_BUILD_TOOLS=OFF -DKVRET_BUILD_TESTS=OFF \
  -DKVRET_BUILD_FUZZ=ON -DKVRET_WARNINGS_AS_ERRORS=ON -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$dir" --target fuzz_c_api
work="$dir/corpus"
mkdir -p "$work"
cp -n tests/fuzz/corpus/* "$work"/ 2>/dev/null || true
ASAN_OPTIONS=detect_leaks=1 OMP_NUM_THREADS=2 "$dir/bin/fuzz_c_api" "$work" -max_total_time="$seconds" \
  -max_len=4096 -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$dir/"
