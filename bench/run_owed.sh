#!/usr/bin/env bash
# The GPU runs of docs/gpu.md §7-8 as named steps, in one device call, inside one deadline:
#     bash bench/run_owed.sh tests decode5 quantprobe            # on the GPU machine, project root
# (decodeN: the gemm probe's section decodeN; layout: bench/debug/decode_layout.py; dmerge:
# bench/debug/decode_merge.py; ncu / ncustall: Nsight Compute sections / stall reasons over
# bench/debug/decode_ncu.py; expand: bench/debug/expand_packing.py; prefill2: the gemm probe's
# FP8-GEMM-alone sweep at V3 L2; dectiming: bench/debug/decode_timing.py (dtmla: its MLA 16-head and GQA fp8 runs); dgluon: bench/debug/decode_gluon.py; dnarrow:
# bench/debug/decode_narrow.py; dtiles: bench/debug/decode_tiles.py; cvtrate: bench/debug/cvt_rate.py; dgqa:
# bench/debug/decode_gluon_gqa.py; dstream: bench/debug/decode_stream.py; dsplits:
# bench/debug/decode_splits.py; dmixed: bench/debug/mixed_probe.py (bf16 and fp8); dwaves: bench/debug/decode_waves.py; dfixed: bench/debug/decode_fixed.py; dl2pace: bench/debug/decode_l2pace.py; wgmma: bench/debug/wgmma_rate.py; druns: bench/debug/decode_runs.py; dfused: bench/debug/dcp_fused.py; deager: bench/debug/eager_host.py; ncugqa: Nsight Compute over bench/debug/decode_ncu.py gluon-gqa;
# ceilings: this GPU's copy / bf16 / fp8 ceilings (launch/bench/common.measure_ceilings);
# ncusrc: per-instruction stall samples (SASS, csv) of the kernel NCU_KERNEL names, decode_ncu.py NCU_ARGS;
# flashmla: FlashMLA's dense decode built from the carried .device-pkgs/flashmla-src.tar.gz and tested, then timed
# beside ours by the bench-cp steps after it)
# Each step runs under `timeout` (its own limit, cut to what is left of DEADLINE, default 570 s
# from the start), logs to STEP.log and writes its results beside it; a step that would get
# under 20 s is skipped and said so. Everything is packed into $OUT/owed.tgz at exit (the device
# tool returns at most 8 files). Carry .device-pkgs (needed by deepep; and .ab-old for `ab`); DG= (empty)
# skips the DeepGEMM build, TESTS_N=8 runs the tests step on 8 pytest-xdist workers (its wheels in
# .device-pkgs/whl: `pip download --no-deps -d .device-pkgs/whl pytest-xdist execnet`).
# bench/run_gpu.sh is the short form for tests and benchmark suites.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$SECONDS; deadline=${DEADLINE:-570}
FINAL=${OUT:-/tmp/out}; res=/tmp/megapar-owed; rm -rf "$res"; mkdir -p "$res" "$FINAL"
trap 'tar czf "$FINAL/owed.tgz" -C "$res" .' EXIT
# shellcheck disable=SC1091
if [ -f .device-pkgs/install.sh ]; then   # the carried packages (nvshmem4py, DeepGEMM), when carried
  source .device-pkgs/install.sh ${DG-deep_gemm} > "$res/install.log" 2>&1 || echo "install: failed (see install.log)"
  tail -3 "$res/install.log"
fi
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'

step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  local left=$((deadline - (SECONDS - start)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "=== $name: skipped (${left}s left)"; return; fi
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$res/$name.log" 2>&1
  echo "    rc=$? in $((SECONDS - t0))s"; tail -n "${TAIL:-12}" "$res/$name.log"
}
tests=(tests/test_quant_triton.py tests/test_gemm_gpu.py tests/test_w4a16_tma.py tests/test_w4a16_splitk.py tests/test_w4a16_bf16asm.py
       tests/test_stream_probe.py tests/test_ffn.py tests/test_moe_device.py tests/test_mla.py
       tests/test_cp_decode_kernel.py tests/test_cp_decode_runs.py tests/test_cp_merge.py tests/test_decode_probe.py
       tests/test_demo.py)
for s in "$@"; do
  case $s in
    tests)      step tests "${TESTS_LIMIT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout ${TESTS_TIMEOUT:-240} -rf ${TESTS_N:+-n $TESTS_N} \
                  --junitxml="$res/gpu-tests.xml" ${TESTS:-${tests[*]}} ;;
    decode[0-9]) step "$s" "${DECODE_LIMIT:-150}" python3 -m megapar.launch.bench.gemm --probe --sections "$s" --out "$res/$s" ;;
    expand)     step expand "${EXPAND_LIMIT:-120}" python3 bench/debug/expand_packing.py "$res/expand.json" ;;
    dgluon)     step dgluon "${DGLUON_LIMIT:-150}" python3 bench/debug/decode_gluon.py "$res/decode-gluon.json" ;;
    dnarrow)    step dnarrow "${DNARROW_LIMIT:-200}" python3 bench/debug/decode_narrow.py "$res/decode-narrow.json" ;;
    dtiles)     step dtiles "${DTILES_LIMIT:-240}" python3 bench/debug/decode_tiles.py "$res/decode-tiles.json" ;;
    dstream)    step dstream "${DSTREAM_LIMIT:-150}" python3 bench/debug/decode_stream.py "$res/decode-stream.json" ;;
    dsplits)    step dsplits "${DSPLITS_LIMIT:-150}" python3 bench/debug/decode_splits.py "$res/decode-splits.json" ;;
    dfused)     step dfused "${DFUSED_LIMIT:-150}" python3 bench/debug/dcp_fused.py "$res/dcp-fused.json" ;;
    deager)     step deager "${DEAGER_LIMIT:-150}" python3 bench/debug/eager_host.py "$res/eager-host.json" ;;
    druns)      step druns "${DRUNS_LIMIT:-200}" python3 bench/debug/decode_runs.py "$res/decode-runs.json" ;;
    wgmma)      step wgmma "${WGMMA_LIMIT:-120}" python3 bench/debug/wgmma_rate.py "$res/wgmma-rate.json" ;;
    dl2pace)    step dl2pace "${DL2PACE_LIMIT:-200}" python3 bench/debug/decode_l2pace.py "$res/decode-l2pace.json" ;;
    dfixed)     step dfixed "${DFIXED_LIMIT:-120}" python3 bench/debug/decode_fixed.py "$res/decode-fixed.json" ;;
    dmixed)     step dmixed "${DMIXED_LIMIT:-150}" bash -c "MIXED_PROBE_MERGE=1 python3 bench/debug/mixed_probe.py $res/mixed-probe.json; \
                  MIXED_PROBE_DTYPE=fp8 python3 bench/debug/mixed_probe.py $res/mixed-probe-fp8.json" ;;
    dwaves)     step dwaves "${DWAVES_LIMIT:-240}" python3 bench/debug/decode_waves.py "$res/decode-waves.json" ;;
    cvtrate)    step cvtrate "${CVTRATE_LIMIT:-90}" python3 bench/debug/cvt_rate.py "$res/cvt-rate.json" ;;
    dgqa)       step dgqa "${DGQA_LIMIT:-150}" python3 bench/debug/decode_gluon_gqa.py "$res/decode-gluon-gqa.json" ;;
    dectiming)  step dectiming "${DECTIMING_LIMIT:-150}" python3 bench/debug/decode_timing.py "$res/decode-timing.json" ;;
    dtmla)      step dtmla "${DTMLA_LIMIT:-240}" bash -c "DECODE_TIMING_MLA=16 DECODE_TIMING_FP8=1 python3 bench/debug/decode_timing.py $res/decode-timing-mla16-fp8.json; \
                  DECODE_TIMING_MLA=16 python3 bench/debug/decode_timing.py $res/decode-timing-mla16-bf16.json; \
                  DECODE_TIMING_FP8=1 python3 bench/debug/decode_timing.py $res/decode-timing-gqa-fp8.json" ;;
    dtgqa)      step dtgqa "${DTGQA_LIMIT:-120}" bash -c "DECODE_TIMING_FP8=1 python3 bench/debug/decode_timing.py $res/decode-timing-gqa-fp8.json; \
                  DECODE_TIMING_FP8=1 DECODE_TIMING_CONFIG='{\"gluon_gqa_fp8\": 0}' python3 bench/debug/decode_timing.py $res/decode-timing-gqa-fp8-triton.json" ;;
    dmerge)     step dmerge "${DMERGE_LIMIT:-150}" python3 bench/debug/decode_merge.py "$res/decode-merge.json" ;;
    layout)     step layout "${LAYOUT_LIMIT:-150}" python3 bench/debug/decode_layout.py "$res/decode-layout.json" ;;
    ncu)        step ncu "${NCU_LIMIT:-200}" bash -c 'N=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); \
                  if [ -z "$N" ]; then echo "ncu: not on this machine"; exit 3; fi; echo "using $N"; \
                  "$N" --clock-control none --profile-from-start off --kernel-name regex:_paged_decode --section SpeedOfLight \
                  --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
                  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SourceCounters \
                  python3 bench/debug/decode_ncu.py' ;;
    ncustall)   step ncustall "${NCU_LIMIT:-200}" bash -c 'N=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); \
                  M=; for r in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected \
                    selected dispatch_stall lg_throttle membar no_instruction drain branch_resolving imc_miss tex_throttle; do \
                    M="$M${M:+,}smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done; \
                  "$N" --clock-control none --profile-from-start off --kernel-name regex:_paged_decode --metrics "$M" \
                  python3 bench/debug/decode_ncu.py' ;;
    ncugqa)     step ncugqa "${NCU_LIMIT:-200}" bash -c 'N=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); \
                  if [ -z "$N" ]; then echo "ncu: not on this machine"; exit 3; fi; echo "using $N"; \
                  "$N" --clock-control none --profile-from-start off --kernel-name regex:_gqa_decode_ws --section SpeedOfLight \
                  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
                  --section ComputeWorkloadAnalysis --section SourceCounters \
                  --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
                  python3 bench/debug/decode_ncu.py gluon-gqa' ;;
    ncusrc)     step ncusrc "${NCU_LIMIT:-200}" bash -c 'N=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); \
                  if [ -z "$N" ]; then echo "ncu: not on this machine"; exit 3; fi; \
                  "$N" --clock-control none --profile-from-start off --kernel-name regex:${NCU_KERNEL:-_gqa_decode_ws_fp8} \
                  --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
                  python3 bench/debug/decode_ncu.py ${NCU_ARGS-gluon-gqa}' ;;
    flashmla)   # FlashMLA's dense decode, the anchor of bench cp's MLA bf16 rows (launch/bench/flashmla.py):
                # unpacked from the carried tarball (bench/fetch_flashmla.sh), built, its GPU test run; the
                # steps after it (bench-cp) then time it (MEGAPAR_FLASHMLA_SRC stays set for them)
                if [ ! -f .device-pkgs/flashmla-src.tar.gz ]; then
                  echo "=== flashmla: skipped (no .device-pkgs/flashmla-src.tar.gz: bench/fetch_flashmla.sh makes it)"
                  continue
                fi
                mkdir -p /tmp/megapar-flashmla && tar xzf .device-pkgs/flashmla-src.tar.gz -C /tmp/megapar-flashmla \
                  && export MEGAPAR_FLASHMLA_SRC=/tmp/megapar-flashmla/flashmla-src
                if ! command -v ninja > /dev/null; then    # (torch's builder runs the ninja binary)
                  whl=$(ls .device-pkgs/deepep-ninja/ninja-*.whl 2> /dev/null | head -n 1)
                  if [ -n "$whl" ]; then
                    python3 -m zipfile -e "$whl" /tmp/megapar-flashmla/ninja-whl
                    bin=$(find /tmp/megapar-flashmla/ninja-whl -path '*scripts/ninja' -type f | head -n 1)
                    [ -n "$bin" ] && chmod +x "$bin" && export PATH="$(dirname "$bin"):$PATH"
                  fi
                fi
                step flashmla "${FLASHMLA_LIMIT:-300}" bash -c 'python3 -c "import os, time; t = time.time(); \
                  from megapar.launch.bench import flashmla; flashmla.build(os.environ[\"MEGAPAR_FLASHMLA_SRC\"], verbose=True); \
                  print(\"built in %.0f s\" % (time.time() - t))" && python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
                  tests/test_bench_flashmla.py' ;;
    mlaprep)    step mlaprep "${MLAPREP_LIMIT:-120}" python3 bench/debug/mla_prep_sweep.py "$res/mla-prep-sweep.json" ;;
    prefill2)   step prefill2 "${PREFILL_LIMIT:-180}" python3 -m megapar.launch.bench.gemm --probe --sections prefill2 --out "$res/prefill2" ;;
    quantprobe) step quantprobe "${QPROBE_LIMIT:-170}" python3 -m megapar.launch.bench.quant --probe --out "$res/quantprobe" ;;
    cpprobe)    step cpprobe "${CPPROBE_LIMIT:-150}" python3 -m megapar.launch.bench.cp --probe --out "$res/cpprobe" ;;
    deepep)     step deepep "${DEEPEP_LIMIT:-480}" env DEEPEP_BENCH="$res/deepep-bench" \
                  bash bench/run_deepep_mpg.sh .device-pkgs/deepep-src.tar.gz "$res/deepep" ;;
    ab)         step ab "${AB_LIMIT:-300}" bash bench/run_ab.sh .ab-old "$res/ab" ${AB_SUITES:-merge quant} ;;
    ceilings)   step ceilings "${CEILINGS_LIMIT:-60}" python3 -c "import json, sys, torch; from dataclasses import asdict; \
                  from launch.bench.common import measure_ceilings; c = asdict(measure_ceilings(torch.device('cuda'))); \
                  print(c); json.dump(c, open(sys.argv[1], 'w'), indent=1)" "$res/ceilings.json" ;;
    bench-*)    step "$s" "${BENCH_LIMIT:-240}" python3 -m launch.cli bench "${s#bench-}" --device cuda --out "$res/results" ;;
    *)          echo "=== $s: unknown step" ;;
  esac
done
echo "total $((SECONDS - start))s"
