#!/usr/bin/env bash
# Configures and builds kvret into build/ (Release, warnings as errors). Extra arguments go to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVRET_WARNINGS_AS_ERRORS=ON "$@"
cmake --build build -j "$jobs"
