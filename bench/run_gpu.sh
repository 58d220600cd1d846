#!/usr/bin/env bash
# One call on the GPU machine: GPU tests and/or benchmark suites, logs and results under $OUT.
#   bash bench/run_gpu.sh tests                 # pytest -m gpu
#   bash bench/run_gpu.sh bench gemm moe ...    # megapar bench SUITE --device cuda, each
# Everything lands in $OUT/gpu-out.tgz (results/ holds the bench JSON + md).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/out}; OUT=/tmp/megapar-out; mkdir -p "$OUT/results" "$FINAL"
# $OUT of the device tool returns at most 8 files: everything is packed into one tarball at exit.
trap 'tar czf "$FINAL/gpu-out.tgz" -C "$OUT" .' EXIT
what=$1; shift
case "$what" in
  tests)
    python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'
    timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 -rf \
      --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
    ;;
  bench)
    for suite in "$@"; do
      echo "=== $suite"
      timeout ${BENCH_TIMEOUT:-240} python3 -m launch.cli bench "$suite" --device ${BENCH_DEVICE:-cuda} --out "$OUT/results" \
        > "$OUT/bench-$suite.log" 2>&1
      echo "rc=$?"; tail -${BENCH_TAIL:-15} "$OUT/bench-$suite.log"
    done
    ;;
esac
