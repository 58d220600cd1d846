#!/usr/bin/env bash
# The nvshmem EP backend's GPU tests: 2 and 4 NVSHMEM processes on one GPU ("multiple processes
# per GPU"), under MPS so that kernels spinning on another process's flag run concurrently with
# it. Run from the project root on the GPU machine, with nvshmem4py installed (or a package
# folder whose install.sh installs it, given as $1):
#     bash bench/run_nvshmem_mpg.sh [path/to/install.sh] [--bench OUTDIR] [pytest args]
# With --bench OUTDIR it also runs the one-GPU nvshmem rows of `megapar bench ep` (results in
# OUTDIR; they measure overhead and kernel cost, never NVLink bandwidth).
# Exit status: pytest's. Correctness only: every rank shares one HBM, so no bandwidth figure
# measured this way means anything for NVLink.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ge 1 ] && [ -f "$1" ]; then
  # shellcheck disable=SC1090
  source "$1"
  shift
fi
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/megapar-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/megapar-mpslog}
export MEGAPAR_NVSHMEM_MPG=1
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
started=0
if nvidia-cuda-mps-control -d; then
  started=1
else
  echo "MPS control daemon did not start (already running?); continuing" >&2
fi
python3 -c "import nvshmem.core, triton, torch; print('nvshmem4py ok; torch', torch.__version__, 'cuda', torch.version.cuda)"
bench_out=""
if [ "${1:-}" = --bench ]; then
  bench_out=$2; shift 2
fi
python3 -m pytest -q -p no:randomly -m gpu -rA tests/test_ep_nvshmem.py "$@"
rc=$?
if [ -n "$bench_out" ]; then
  MEGAPAR_BENCH_EP_SECTIONS=nvshmem python3 -m megapar.launch.cli bench ep --device cuda --out "$bench_out" || rc=$?
fi
if [ "$started" = 1 ]; then
  echo quit | nvidia-cuda-mps-control
fi
exit $rc
