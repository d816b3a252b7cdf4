#!/usr/bin/env bash
# The C++ test suite (every C API call, the index and select code, fault injection) built with clang under
# AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer (every finding fatal), bounded in time.
# Usage: scripts/sanitize.sh [BUILD_DIR]   (default build-asan; installs clang and LLVM's OpenMP if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-asan}
scripts/install-deps.sh --minimal --sanitizers
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVRET_CUDA=OFF \
  -DKVRET_BUILD_BINDINGS=OFF -DKVRET_BUILD_BENCH=OFF -DKVRET_BUILD_TOOLS=OFF -DKVRET_WARNINGS_AS_ERRORS=ON \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$dir" --target test_cpu
# OMP_NUM_THREADS=2: the suite's parallel loops run on two threads whatever the machine
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 OMP_NUM_THREADS=2 \
  timeout 900 "$dir/bin/test_cpu" --gtest_brief=1
