#!/usr/bin/env bash
# Sets up, builds and runs every test: C, C++ (GoogleTest), Python, Java, Rust, and the pkg-config/CMake consumer
# builds. GPU tests (label gpu) skip where no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh "$@"
cd build
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
