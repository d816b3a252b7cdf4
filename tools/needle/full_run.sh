#!/usr/bin/env bash
# The needle suite as reported in BENCHMARKS.md: every case (single and multi-key pass keys, depths 10%-90%, prompts
# of 2k, 4k and 8k tokens, two haystacks, plus four more 8k single-key cases), full attention as the reference, and
# for the cases it answers right: EXACT, PAGE and streaming at budgets 1/5-1/50, and PQ in five settings:
#   pq-m4x5   kvret's default PQ: m=4 sub-spaces of 6 bits, 5% exact outliers: k-means seeds 1-10 at 1/10, 1-5 at
#             1/50, 1-3 at 1/5 and 1/20
#   pq-m4x2   m=4, 2% exact outliers: seeds 1-10 at 1/10 and 1/50, 1-3 at 1/5 and 1/20
#   pq-m4     m=4, no exact outliers: seeds 1-10 at 1/10 and 1/50, 1-3 at 1/5 and 1/20
#   pq-plain  m=2 (PQCache's 2 x 6 bits), no exact outliers: seeds 1-10 at 1/10, 1-3 at 1/50
#   pq-m2x2   m=2, 2% exact outliers: seeds 1-3 at 1/10 and 1/50
# Two processes (one core each: 2k+4k, and 8k).
# Usage: tools/needle/full_run.sh OUT_DIR   (needs a build with the Python binding in build/; about 1.5 h on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: tools/needle/full_run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-build/bindings/python/site} OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
suite() { python3 tools/needle/needle_suite.py --cache "$out/cache" --only-answered --markdown /dev/null "$@"; }
ten=1,2,3,4,5,6,7,8,9,10
m4="pq-m4:index_kind=pq,pq_m=4,pq_exact_fraction=0"
m4x2="pq-m4x2:index_kind=pq,pq_m=4,pq_exact_fraction=0.02"
m4x5="pq-m4x5:index_kind=pq,pq_m=4,pq_exact_fraction=0.05"
plain="pq-plain:index_kind=pq,pq_m=2,pq_exact_fraction=0"
m2x2="pq-m2x2:index_kind=pq,pq_m=2,pq_exact_fraction=0.02"
run_part() {
  local jsonl=$1
  shift
  suite "$@" --jsonl "$jsonl" --indexes exact,page,streaming
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4" --budgets 0.1,0.02 --seeds $ten
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$plain" --budgets 0.1 --seeds $ten
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4x2" --variant "$m2x2" --budgets 0.1,0.02 --seeds 1,2,3
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$plain" --budgets 0.02 --seeds 1,2,3
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4" --budgets 0.2,0.05 --seeds 1,2,3
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4x2" --budgets 0.1,0.02 --seeds 4,5,6,7,8,9,10
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4x2" --budgets 0.2,0.05 --seeds 1,2,3
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4x5" --budgets 0.1 --seeds $ten
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4x5" --budgets 0.02 --seeds 1,2,3,4,5
  suite "$@" --jsonl "$jsonl" --indexes "" --variant "$m4x5" --budgets 0.2,0.05 --seeds 1,2,3
}
run_part "$out/short.jsonl" --lengths 2048,4096 2>"$out/short.log" &
{
  run_part "$out/long.jsonl" --lengths 8000
  run_part "$out/long.jsonl" --lengths 8000 --depths 0.2,0.4,0.6,0.8 --kinds single --haystacks licenses
} 2>"$out/long.log" &
wait
python3 tools/needle/needle_suite.py --report "$out/short.jsonl,$out/long.jsonl" --markdown "$out/needle.md" \
  --plot "$out/needle.png"
echo "tables: $out/needle.md, plot: $out/needle.png"
