#!/usr/bin/env bash
# Sets up, builds and runs the demo: a simulated Llama-3-8B-like long-context decode that prints retrieval quality
# and speed side by side for EXACT, PQ and the streaming baseline. Extra arguments go to kvret-demo.
set -euo pipefail
cd "$(dirname "$0")/.."
# setup and build output go to stderr: stdout is the demo's alone (scripts/demo.sh --json > out.json)
scripts/install-deps.sh --minimal >&2
scripts/build.sh -DKVRET_BUILD_BINDINGS=OFF -DKVRET_BUILD_TESTS=OFF -DKVRET_BUILD_BENCH=OFF -DKVRET_BUILD_TOOLS=ON >&2
build/bin/kvret-demo "$@"
