#!/usr/bin/env bash
# The CUDA backend without a GPU: the backend's source (src/backend/cuda_backend.cu) built with the host compiler on
# Thrust's OpenMP device system (KVRET_THRUST_OMP=ON, CCCL's headers from the CUDA toolkit), and the whole C++ suite
# and the C program run against it, every context made with device_type = KVRET_DEVICE_CUDA and every tensor
# labelled KVRET_DEVICE_CUDA (ctest label cuda_backend; on this system "device" memory is host memory).
# Usage: scripts/cuda_backend_omp.sh [BUILD_DIR]   (default build-thrust-omp)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-thrust-omp}
scripts/install-deps.sh --minimal
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVRET_THRUST_OMP=ON -DKVRET_WARNINGS_AS_ERRORS=ON \
  -DKVRET_BUILD_TESTS=ON -DKVRET_BUILD_BINDINGS=OFF -DKVRET_BUILD_BENCH=OFF -DKVRET_BUILD_TOOLS=OFF >/dev/null
cmake --build "$dir" --target test_cpu test_c_api -j "$(nproc 2>/dev/null || echo 2)"
cd "$dir"
ctest --output-on-failure --no-tests=error -L '^cuda_backend$'
