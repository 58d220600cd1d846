#!/usr/bin/env bash
# The deepep EP backend's GPU tests with the real DeepEP: its last pre-V2 source (commit 567632d,
# packed by bench/fetch_deepep.sh) built here, and 2 ranks on one GPU under MPS (the intranode
# kernels share buffers between the two processes through CUDA IPC and spin on each other's
# flags, so both must be resident at once). Run from the project root on the GPU machine:
#     bash bench/run_deepep_mpg.sh path/to/deepep-src.tar.gz OUTDIR [pytest args]
# Builds (TORCH_CUDA_ARCH_LIST=9.0, `setup.py build_ext --inplace`) with NVSHMEM from the
# `nvidia.nvshmem` module when it has include/ and lib/libnvshmem_device.a, and at the same time
# an intranode-only copy (-DDISABLE_NVSHMEM); it uses the NVSHMEM build when it built and imports,
# else the intranode one, and says which. Then tests/test_ep_deepep.py's gpu tests: normal mode
# (intranode) always, low-latency mode only with the NVSHMEM build.
# OUTDIR gets deepep-build-{nvshmem,intranode}.log, deepep-tests.log and deepep-built.tar.gz
# (the built package; give it as DEEPEP_PREBUILT=... next time to skip the build). A ninja wheel
# in deepep-ninja/ beside the tarball is used when the machine has no ninja.
# Bounded: BUILD_TIMEOUT (default 360 s, both builds run in parallel), NORMAL_TIMEOUT (130 s) and
# LL_TIMEOUT (50 s) for the two pytest runs. With DEEPEP_BENCH=DIR it then runs `megapar bench ep`'s
# deepep rows (BENCH_TIMEOUT, 150 s) into DIR. Exit status: the first failing pytest run's (0 when
# all pass; 2 for a failed build). The MPS daemon this script started is quit on every exit.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ $# -lt 2 ]; then
  echo "usage: bash bench/run_deepep_mpg.sh DEEPEP_SRC_TARBALL OUTDIR [pytest args]" >&2
  exit 2
fi
if [ ! -f "$1" ]; then echo "run_deepep_mpg: no tarball $1 (make it with bench/fetch_deepep.sh)" >&2; exit 2; fi
tarball=$(realpath "$1"); mkdir -p "$2"; out=$(realpath "$2"); shift 2
BUILD_TIMEOUT=${BUILD_TIMEOUT:-360} NORMAL_TIMEOUT=${NORMAL_TIMEOUT:-130} LL_TIMEOUT=${LL_TIMEOUT:-50}
work=${DEEPEP_WORK:-/tmp/megapar-deepep}
rm -rf "$work" && mkdir -p "$work" || exit 2
export TORCH_CUDA_ARCH_LIST=9.0
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

use=""  # the source folder whose build is used
if [ -n "${DEEPEP_PREBUILT:-}" ]; then
  mkdir -p "$work/prebuilt" && tar xzf "$DEEPEP_PREBUILT" -C "$work/prebuilt" || exit 2
  use=$work/prebuilt
  mode=$(cat "$use/DEEPEP_BUILD_MODE" 2>/dev/null || echo intranode)
  echo "deepep: prebuilt $DEEPEP_PREBUILT ($mode)"
else
  if ! command -v ninja >/dev/null; then
    whl=$(find "$(dirname "$tarball")/deepep-ninja" -name 'ninja-*.whl' 2>/dev/null | head -n 1)
    if [ -n "$whl" ]; then
      python3 -m zipfile -e "$whl" "$work/ninja-whl"
      bin=$(find "$work/ninja-whl" -path '*scripts/ninja' -type f | head -n 1)
      if [ -n "$bin" ]; then chmod +x "$bin" && PATH="$(dirname "$bin"):$PATH" && export PATH; fi
    fi
  fi
  echo "ninja: $(ninja --version 2>/dev/null || echo 'absent (files compile one at a time)')"
  nvshmem_dir=$(python3 - <<'PY'
import importlib.util, os
try:
    d = list(importlib.util.find_spec("nvidia.nvshmem").submodule_search_locations)[0]
except Exception:
    d = ""
ok = d and os.path.isdir(os.path.join(d, "include")) and os.path.isfile(os.path.join(d, "lib", "libnvshmem_device.a"))
print(d if ok else "")
PY
)
  # setup.py takes NVSHMEM from the nvidia.nvshmem module when it is importable (NVSHMEM_DIR unset:
  # it then links the versioned libnvshmem_host.so.N the wheel ships); the intranode-only build
  # hides the module (sys.modules entry None), which makes setup.py add -DDISABLE_NVSHMEM.
  modes="intranode"
  if [ -n "$nvshmem_dir" ]; then
    modes="nvshmem intranode"
    echo "NVSHMEM: $nvshmem_dir (include/, lib/libnvshmem_device.a): building with it and, in parallel, intranode-only"
  else
    echo "NVSHMEM: no nvidia.nvshmem module with include/ and lib/libnvshmem_device.a: intranode-only build"
  fi
  pids=()
  for m in $modes; do
    mkdir -p "$work/$m" && tar xzf "$tarball" -C "$work/$m" || exit 2
    # Two fixes to DeepEP's setup.py at 567632d, both seen on the H200 image (CUDA 13, the
    # nvidia-nvshmem wheel): (1) intranode-only, it still compiles with -rdc=true but adds the
    # device-link step only with NVSHMEM, so the module fails to import (undefined
    # __cudaRegisterLinkedBinary_*; DeepEP issue 429): give that build the device link too.
    # (2) with NVSHMEM, deep_ep.cpp is compiled by g++, which does not see CUDA 13's CCCL headers
    # (include/cccl: nvshmem_tensor.h includes <cuda/std/tuple>) and, with NVSHMEM >= 3.5.19,
    # defines nvshmemi_ibgda_device_state_d a second time unless the header sees
    # __NVSHMEM_NUMBA_SUPPORT__ (DeepEP PRs 557/581).
    if [ "$m" = intranode ]; then
      sed -i "s/^    nvcc_dlink = \[\]/    nvcc_dlink = ['-dlink']/" "$work/$m/deepep-src/setup.py"
    else
      sed -i "s/^    cxx_flags = \['-O3',/    cxx_flags = ['-D__NVSHMEM_NUMBA_SUPPORT__', '-O3',/" "$work/$m/deepep-src/setup.py"
    fi
    grep -n "nvcc_dlink = \|cxx_flags = " "$work/$m/deepep-src/setup.py" | head -2 >>"$out/deepep-build-$m.log"
    hide=""
    [ "$m" = intranode ] && hide="sys.modules['nvidia.nvshmem'] = None"
    cuda_home=${CUDA_HOME:-/usr/local/cuda}
    (cd "$work/$m/deepep-src" && unset NVSHMEM_DIR && export CPATH=$cuda_home/include/cccl${CPATH:+:$CPATH} && MAX_JOBS=8 timeout -k 10 "$BUILD_TIMEOUT" python3 -c "
import runpy, sys
$hide
sys.argv = ['setup.py', 'build_ext', '--inplace']
runpy.run_path('setup.py', run_name='__main__')" >"$out/deepep-build-$m.log" 2>&1) &
    pids+=($!)
  done
  t0=$SECONDS
  i=0
  for m in $modes; do
    wait "${pids[$i]}"; brc=$?; i=$((i + 1))
    echo "build $m: rc=$brc ($((SECONDS - t0)) s; log $out/deepep-build-$m.log)"
    [ $brc = 124 ] && echo "build $m: timed out after ${BUILD_TIMEOUT} s" >&2
    [ $brc != 0 ] && tail -n 15 "$out/deepep-build-$m.log" >&2
  done
  for m in $modes; do
    src=$work/$m/deepep-src
    if ls "$src"/deep_ep_cpp*.so >/dev/null 2>&1 && (cd / && PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH} python3 -c "import deep_ep") \
        >>"$out/deepep-build-$m.log" 2>&1; then
      use=$src; mode=$m; break
    fi
    echo "build $m: no importable deep_ep (see its log)" >&2
  done
  if [ -z "$use" ]; then echo "deepep: no usable build" >&2; exit 2; fi
  echo "$mode" >"$use/DEEPEP_BUILD_MODE"
  (cd "$use" && tar czf "$out/deepep-built.tar.gz" deep_ep deep_ep_cpp*.so DEEPEP_BUILD_MODE)
fi
echo "deepep: using the $mode build ($use)"
export PYTHONPATH=$use${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import deep_ep, deep_ep_cpp; print('deep_ep', deep_ep.__file__, deep_ep_cpp.__file__)"

export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/megapar-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/megapar-mpslog}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
started=0
# shellcheck disable=SC2329  # called by the traps
quit_mps() { if [ "$started" = 1 ]; then echo quit | nvidia-cuda-mps-control; started=0; fi; }
trap quit_mps EXIT
trap 'quit_mps; exit 130' INT TERM
if nvidia-cuda-mps-control -d; then
  started=1
else
  echo "MPS control daemon did not start (already running?); continuing" >&2
fi
export MEGAPAR_DEEPEP_MPG=1
if [ "$mode" = nvshmem ]; then export MEGAPAR_DEEPEP_LL=1; else unset MEGAPAR_DEEPEP_LL; fi
: >"$out/deepep-tests.log"
timeout -k 10 "$NORMAL_TIMEOUT" python3 -m pytest -q -p no:randomly -m gpu -rA tests/test_ep_deepep.py \
  -k normal_mode "$@" 2>&1 | tee -a "$out/deepep-tests.log"
rc=${PIPESTATUS[0]}
echo "deepep normal mode (intranode): pytest rc=$rc"
if [ "$mode" = nvshmem ]; then
  timeout -k 10 "$LL_TIMEOUT" python3 -m pytest -q -p no:randomly -m gpu -rA tests/test_ep_deepep.py \
    -k low_latency "$@" 2>&1 | tee -a "$out/deepep-tests.log"
  ll_rc=${PIPESTATUS[0]}
  echo "deepep low-latency mode: pytest rc=$ll_rc"
  [ "$rc" = 0 ] && rc=$ll_rc
else
  echo "deepep low-latency mode: not run (intranode-only build)"
fi
if [ -n "${DEEPEP_BENCH:-}" ]; then   # `megapar bench ep`'s deepep rows, while MPS is up
  mkdir -p "$DEEPEP_BENCH"
  MEGAPAR_BENCH_EP_SECTIONS=deepep timeout -k 10 "${BENCH_TIMEOUT:-150}" python3 -m launch.cli bench ep \
    --device cuda --out "$DEEPEP_BENCH" 2>&1 | tee "$DEEPEP_BENCH/bench-ep-deepep.log" | tail -n 8
  echo "deepep bench: rc=${PIPESTATUS[0]}"
fi
exit "$rc"
