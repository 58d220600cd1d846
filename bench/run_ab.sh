#!/usr/bin/env bash
# Before/after in ONE device call: the same suites from an older tree and from this one,
# alternating, on the same machine, then `megapar bench --compare` tables.
#   here:  rm -rf .ab-old && mkdir .ab-old && git archive OLD_COMMIT | tar x -C .ab-old
#          echo /.ab-old/ >> .git/info/exclude      # then carry .ab-old in the device call
#   there: bash bench/run_ab.sh .ab-old OUT mhc merge quant ...
# Each suite runs old, new, old, new; the compare uses the second pair (warm caches and clocks),
# and OUT/SUITE-ab-first.md keeps the first pair's table as a check of run-to-run noise.
set -uo pipefail
old=$(cd "$1" && pwd); out=$2; shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
device=${AB_DEVICE:-cuda}; tag=${AB_TAG:-h200}   # result files are SUITE-$tag.json (cpu: AB_TAG=cpu-quick)
run() {  # tree dest suite
  mkdir -p "$2"
  (cd "$1" && PYTHONPATH=$1 timeout "${AB_TIMEOUT:-120}" python3 -m launch.cli bench "$3" --device "$device" \
     ${AB_ARGS:-} --out "$2" > "$2/$3.log" 2>&1) || echo "  $3 in $1: exit $?"
}
for suite in "$@"; do
  echo "=== $suite"
  for pass in 1 2; do
    run "$old" "$out/old$pass" "$suite"
    run "$here" "$out/new$pass" "$suite"
  done
  for pass in 1 2; do
    [ -f "$out/new$pass/$suite-$tag.json" ] && [ -f "$out/old$pass/$suite-$tag.json" ] || continue
    (cd "$here" && PYTHONPATH=$here python3 -m megapar.launch.bench.compare "$out/new$pass/$suite-$tag.json" \
       "$out/old$pass/$suite-$tag.json" --out "$out/cmp$pass" > /dev/null) || true
  done
  [ -f "$out/cmp1/$suite-compare.md" ] && mv "$out/cmp1/$suite-compare.md" "$out/$suite-ab-first.md"
  [ -f "$out/cmp2/$suite-compare.md" ] && mv "$out/cmp2/$suite-compare.md" "$out/$suite-ab.md" \
    && grep -m1 "Verdict" "$out/$suite-ab.md"
done
