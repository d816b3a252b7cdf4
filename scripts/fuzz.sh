#!/usr/bin/env bash
# Builds the libFuzzer targets (clang; the whole library instrumented for coverage) and runs them from their corpora
# for a bounded time: fuzz_c_api (programs over the C API; corpus tests/fuzz/corpus) and fuzz_session_bytes (the
# session store's disk files and the shared tier's Redis replies as bytes; corpus tests/fuzz/corpus_session). Inputs
# that reach new code go to a scratch copy of the corpus in the build directory, never to tests/fuzz; a finding stops
# its process and is saved in the build directory (crash-*, timeout-*, oom-*).
# Usage: scripts/fuzz.sh [--fast] [--jobs=N] [--target=c_api|session|all] [SECONDS] [BUILD_DIR]
#   SECONDS    each process's time (default 120)
#   --target   the target to run (default c_api); all: process i runs c_api when i is even, session when odd (at
#              least 2 processes), so both share the same time
#   --fast     UBSan only, no ASan, and edge coverage without comparison tracing (several times the executions a
#              second; default build dir build-fuzz-fast); without it ASan and UBSan (default build-fuzz)
#   --jobs=N   N processes at once, each on its own copy of the corpus (default 1); the executions and, with
#              KVRET_FUZZ_STATS=1, each call's count per program and share of KVRET_OK are summed over them at the
#              end, per target
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
jobs=1
target=c_api
args=()
for arg in "$@"; do
  case "$arg" in
    --fast) fast=1 ;;
    --jobs=*) jobs=${arg#--jobs=} ;;
    --target=*) target=${arg#--target=} ;;
    *) args+=("$arg") ;;
  esac
done
seconds=${args[0]:-120}
case "$target" in
  c_api | session) ;;
  all) [[ $jobs -ge 2 ]] || jobs=2 ;;
  *) echo "fuzz.sh: --target must be c_api, session or all, got $target" >&2; exit 2 ;;
esac
# the target of process i
target_of() {
  if [[ $target == all ]]; then
    if (($1 % 2 == 0)); then echo c_api; else echo session; fi
  else
    echo "$target"
  fi
}
if [[ $fast == 1 ]]; then
  dir=${args[1]:-build-fuzz-fast}
  sanitizers="undefined"
  # edge coverage only: tracing every comparison (for the mutator's hints) took over half the time, in loop bounds
  coverage="-fno-sanitize-coverage=trace-cmp"
else
  dir=${args[1]:-build-fuzz}
  sanitizers="address,undefined"
  coverage=""
fi
scripts/install-deps.sh --minimal --sanitizers
# line tables only: the reports still name file and line, and the build takes about an eighth less time than with -g
opt="-O2 -gline-tables-only -DNDEBUG"
flags="-fsanitize=$sanitizers,fuzzer-no-link $coverage -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="$opt" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$opt" -DKVRET_CUDA=OFF \
  -DKVRET_BUILD_BINDINGS=OFF -DKVRET_BUILD_BENCH=OFF -DKVRET_BUILD_TOOLS=OFF -DKVRET_BUILD_TESTS=OFF \
  -DKVRET_BUILD_FUZZ=ON -DKVRET_WARNINGS_AS_ERRORS=ON -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$sanitizers" >/dev/null
cmake --build "$dir" --target fuzz_c_api fuzz_session_bytes

run() {  # run INDEX: one process on its own corpus copy
  local t binary seeds work
  t=$(target_of "$1")
  local schedule=()
  if [[ $t == c_api ]]; then
    binary=fuzz_c_api
    seeds=tests/fuzz/corpus
    # its programs reach tens of thousands of coverage features each: the entropic schedule's bookkeeping of their
    # frequencies took half the time, and the plain schedule runs twice the programs a second; and programs of any
    # length from the start (up to 128 operations), not lengths grown slowly from the seeds'
    schedule=(-entropic=0 -len_control=0)
  else
    binary=fuzz_session_bytes
    seeds=tests/fuzz/corpus_session
  fi
  work="$dir/corpus-$t"
  if [[ $jobs -gt 1 ]]; then work="$dir/corpus-$t-$1"; fi
  mkdir -p "$work"
  cp -n "$seeds"/* "$work"/ 2>/dev/null || true
  # OMP_WAIT_POLICY=passive: OpenMP's idle threads sleep instead of spinning on the cores the processes share
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive \
    "$dir/bin/$binary" "$work" "${schedule[@]}" \
    -max_total_time="$seconds" -max_len=4096 -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$dir/"
}
if [[ $jobs == 1 ]]; then
  run 0
  exit
fi
pids=()
for ((i = 0; i < jobs; ++i)); do
  run "$i" >"$dir/fuzz-$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
logs=()
for ((i = 0; i < jobs; ++i)); do logs+=("$dir/fuzz-$i.log"); done
# the summary, per target: executions over its processes, and each call's count, count per program (input) and OK
# share (the first line of the stats, "programs" or "inputs", counts the programs)
for t in c_api session; do
  tlogs=()
  for ((i = 0; i < jobs; ++i)); do [[ $(target_of "$i") == "$t" ]] && tlogs+=("$dir/fuzz-$i.log"); done
  [[ ${#tlogs[@]} -gt 0 ]] || continue
  awk -v t="$t" '/stat::number_of_executed_units/ { runs += $2 }
       /^kvret-fuzz / { calls[$2] += $3; ok[$2] += $5; if (!($2 in order)) { order[$2] = ++n; name[n] = $2 } }
       END { printf "kvret-fuzz total %s: %d executions\n", t, runs
             per = n ? calls[name[1]] : 0
             for (i = 1; i <= n; ++i) { c = name[i]
               printf "kvret-fuzz total %-7s %-14s %10d calls, %7.3f per program, %5.1f%% OK\n", t, c, calls[c],
                      per ? calls[c] / per : 0, calls[c] ? 100 * ok[c] / calls[c] : 0 } }' \
    "${tlogs[@]}"
done
if [[ $status != 0 ]]; then
  echo "kvret-fuzz: a process stopped on a finding; see ${logs[*]} and $dir/crash-* / timeout-* / oom-*" >&2
  tail -n 80 "${logs[@]}" >&2  # the finding's report, where a CI log shows it
  exit 1
fi
