#!/usr/bin/env bash
# The C++ test suite (every C API call, the index and select code, fault injection) and the C test (a C99 program
# over the shared library) built with clang under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer
# (every finding fatal), bounded in time. The shared library is linked without --no-undefined in a sanitizer build
# (its instrumentation's symbols come from the executable's runtime), and the C program is linked by the C++ driver,
# which adds the runtime's C++ part that the library's UBSan checks (vptr) need.
# Usage: scripts/sanitize.sh [BUILD_DIR]   (default build-asan; installs clang and LLVM's OpenMP if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-asan}
scripts/install-deps.sh --minimal --sanitizers
# line tables only: the reports still name file and line, and the build takes about an eighth less time than with -g
opt="-O2 -gline-tables-only -DNDEBUG"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="$opt" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt" -DKVRET_CUDA=OFF \
  -DKVRET_BUILD_BINDINGS=OFF -DKVRET_BUILD_BENCH=OFF -DKVRET_BUILD_TOOLS=OFF -DKVRET_WARNINGS_AS_ERRORS=ON \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$dir" --target test_cpu test_c_api
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
timeout 300 "$dir/bin/test_c_api"
# OMP_NUM_THREADS=2: the suite's parallel loops run on two threads whatever the machine. The quality tests
# (scripts/gtest_shards.sh) run in the ordinary build only.
OMP_NUM_THREADS=2 scripts/gtest_shards.sh 900 "$dir/bin/test_cpu" --gtest_brief=1 \
  --gtest_filter="-$(scripts/gtest_shards.sh --quality-tests)"
