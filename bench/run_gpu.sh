#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests or benchmark suites, through bench/run_owed.sh
# (one deadline, logs and results packed into $OUT/owed.tgz).
#   bash bench/run_gpu.sh tests                 # pytest -m gpu over tests/ (TEST_TIMEOUT, 400 s)
#   bash bench/run_gpu.sh tests tests/test_moe.py -k graph    # pytest arguments are passed on
#   bash bench/run_gpu.sh bench gemm moe ...    # megapar bench SUITE --device cuda, each (BENCH_TIMEOUT, 240 s)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
what=${1:-}; shift || true
case "$what" in
  tests) TESTS="${*:-tests}" TESTS_LIMIT=${TEST_TIMEOUT:-400} exec bash bench/run_owed.sh tests ;;
  bench) steps=(); for s in "$@"; do steps+=("bench-$s"); done
         BENCH_LIMIT=${BENCH_TIMEOUT:-240} exec bash bench/run_owed.sh "${steps[@]}" ;;
  *) echo "usage: bash bench/run_gpu.sh tests [PYTEST ARGS] | bench SUITE..." >&2; exit 2 ;;
esac
