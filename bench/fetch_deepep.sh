#!/usr/bin/env bash
# Packs DeepEP's last pre-V2 source (commit 567632d, the legacy `Buffer` API that the "deepep"
# EP backend wraps) for the GPU machine, which has no network. Run on a machine with network,
# from the project root:
#     bash bench/fetch_deepep.sh [MIRROR] [OUTDIR]
# MIRROR: a bare git clone of github.com/deepseek-ai/DeepEP (default below; on a fresh machine
#   the session tool `fetch github:deepseek-ai/DeepEP` makes it under /work/.mirror/).
# OUTDIR: where the files go (default .device-pkgs, the git-ignored folder carried to the GPU
#   machine). Writes OUTDIR/deepep-src.tar.gz (`git archive` of the commit, top folder
#   deepep-src/) and, when the package index answers, OUTDIR/deepep-ninja/ninja-*.whl (torch's
#   extension builder compiles files in parallel only with ninja; bench/run_deepep_mpg.sh uses
#   this wheel when the GPU machine has no ninja).
# Then on the GPU machine: bash bench/run_deepep_mpg.sh OUTDIR/deepep-src.tar.gz RESULTS_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
mirror=${1:-/work/.mirror/deepseek-ai+DeepEP/repo}
out=${2:-.device-pkgs}
commit=567632d  # "Update README for mori-EP branch ..." : the last commit before DeepEP V2
if ! git --git-dir="$mirror" cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "fetch_deepep: $mirror has no commit $commit (make the mirror with: fetch github:deepseek-ai/DeepEP)" >&2
  exit 2
fi
mkdir -p "$out"
git --git-dir="$mirror" archive --format=tar.gz --prefix=deepep-src/ -o "$out/deepep-src.tar.gz" "$commit"
echo "wrote $out/deepep-src.tar.gz ($(git --git-dir="$mirror" log -1 --format='%h %s' "$commit"))"
mkdir -p "$out/deepep-ninja"
if python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
     --python-version 3.12 -d "$out/deepep-ninja" ninja; then
  echo "wrote $(ls "$out"/deepep-ninja/ninja-*.whl)"
else
  echo "fetch_deepep: no ninja wheel (the build on the GPU machine then compiles one file at a time)" >&2
fi
