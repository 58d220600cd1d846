#!/usr/bin/env bash
# Packs FlashMLA's dense sm90 decode sources (the anchor of `megapar bench cp`'s MLA bf16 rows,
# launch/bench/flashmla.py) and the CUTLASS headers they include, for the GPU machine, which has no
# network. Run on a machine with network, from the project root:
#     bash bench/fetch_flashmla.sh [FLASHMLA_MIRROR] [CUTLASS_MIRROR] [OUTDIR]
# The mirrors are bare git clones of github.com/deepseek-ai/FlashMLA and github.com/NVIDIA/cutlass
# (defaults below; on a fresh machine the session tool `fetch github:deepseek-ai/FlashMLA` and
# `fetch github:NVIDIA/cutlass` make them under /work/.mirror/). OUTDIR (default .device-pkgs, the
# git-ignored folder carried to the GPU machine) gets flashmla-src.tar.gz: top folder
# flashmla-src/, FlashMLA's csrc files of the dense decode (api headers, kerutils, sm90 dense
# decode, the smxx scheduler and combine kernels) and LICENSE at FLASHMLA_COMMIT, and CUTLASS's
# include/ and tools/util/include/ at csrc/cutlass (the submodule's commit). About 3 MB.
# Then on the GPU machine: tar xzf flashmla-src.tar.gz -C DIR; MEGAPAR_FLASHMLA_SRC=DIR/flashmla-src
# (bench/run_owed.sh does both when the tarball is carried; its `flashmla` step builds and tests it).
set -euo pipefail
cd "$(dirname "$0")/.."
fm=${1:-/work/.mirror/deepseek-ai+FlashMLA/repo}
cl=${2:-/work/.mirror/NVIDIA+cutlass/repo}
out=${3:-.device-pkgs}
read -r fm_commit cl_commit < <(python3 -c "from launch.bench import flashmla as f; print(f.FLASHMLA_COMMIT, f.CUTLASS_COMMIT)")
for pair in "$fm:$fm_commit" "$cl:$cl_commit"; do
  if ! git --git-dir="${pair%:*}" cat-file -e "${pair##*:}^{commit}" 2>/dev/null; then
    echo "fetch_flashmla: ${pair%:*} has no commit ${pair##*:} (make the mirror with the fetch tool)" >&2
    exit 2
  fi
done
sub=$(git --git-dir="$fm" ls-tree "$fm_commit" csrc/cutlass | awk '{print $3}')
case $sub in "$cl_commit"*) ;; *) echo "fetch_flashmla: FlashMLA $fm_commit pins cutlass $sub, not $cl_commit" >&2; exit 2 ;; esac
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/flashmla-src/csrc/cutlass"
git --git-dir="$fm" archive "$fm_commit" LICENSE csrc/api csrc/params.h csrc/defines.h csrc/utils.h csrc/kerutils \
  csrc/sm90/helpers.h csrc/sm90/decode/dense csrc/smxx | tar x -C "$work/flashmla-src"
git --git-dir="$cl" archive "$cl_commit" LICENSE.txt include tools/util/include | tar x -C "$work/flashmla-src/csrc/cutlass"
git --git-dir="$fm" log -1 --format='FlashMLA %H %s' "$fm_commit" > "$work/flashmla-src/SOURCE"
git --git-dir="$cl" log -1 --format='cutlass %H %s' "$cl_commit" >> "$work/flashmla-src/SOURCE"
mkdir -p "$out"
tar czf "$out/flashmla-src.tar.gz" -C "$work" flashmla-src
echo "wrote $out/flashmla-src.tar.gz ($(du -h "$out/flashmla-src.tar.gz" | cut -f1)):"; cat "$work/flashmla-src/SOURCE"
