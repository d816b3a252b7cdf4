#!/usr/bin/env bash
# Runs a GoogleTest binary as N shards at once (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX: every test runs in exactly
# one shard), each bounded in time; fails if any shard fails. The sanitizer jobs use it to spread their run over
# the machine's cores.
# Usage: scripts/gtest_shards.sh SECONDS BINARY [ARGS...]   (N: KVRET_SHARDS, default the number of cores)
#        scripts/gtest_shards.sh --quality-tests   prints a --gtest_filter pattern of the C++ suite's quality tests:
#        attention mass and recall measured over long synthetic workloads. Their code paths (select, fetch, attend)
#        are the ones the other tests run at small sizes, so the sanitizer jobs leave them to the ordinary build.
set -euo pipefail
if [[ ${1:-} == --quality-tests ]]; then
  echo '*AttentionMass*:*RecallVsBudget*:*WorkloadHitRate*:*RecallAgainstExact*'
  exit 0
fi
seconds=$1
shift
n=${KVRET_SHARDS:-$(nproc 2>/dev/null || echo 2)}
pids=()
for ((i = 0; i < n; i++)); do
  GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout "$seconds" "$@" &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "scripts/gtest_shards.sh: shard $i of $n failed: $*" >&2
    status=1
  fi
done
exit $status
