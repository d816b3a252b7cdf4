#!/usr/bin/env bash
# Sets up, builds and runs every test: C, C++ (GoogleTest), Python, Java, Rust, the pkg-config/CMake consumer
# builds, and the packages (label packaging: the Python wheel and sdist, built here and the wheel installed in a
# fresh virtual environment; the licence in each package). GPU tests (label gpu) skip where no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# every part named, so that what an earlier configure of build/ switched off (scripts/demo.sh) is built again
scripts/build.sh -DKVRET_BUILD_TESTS=ON -DKVRET_BUILD_TOOLS=ON -DKVRET_BUILD_BENCH=ON -DKVRET_BUILD_BINDINGS=ON "$@"
cd build
# every language's tests must be there, whatever an earlier configure left (a run with none of them is a failure)
for label in c cpu python java rust consumer packaging; do
  n=$(ctest -N -L "^${label}\$" | sed -n 's/^Total Tests: //p')
  if [ "${n:-0}" -eq 0 ]; then
    echo "scripts/test.sh: no tests labelled '${label}' were configured" >&2
    exit 1
  fi
done
ctest --output-on-failure --no-tests=error -j "$(nproc 2>/dev/null || echo 2)"
cd ..
# the CUDA backend's every call, without a GPU: on Thrust's OpenMP host system
scripts/cuda_backend_omp.sh
