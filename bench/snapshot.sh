#!/usr/bin/env bash
# The committed tree (HEAD) as ./.snap/ (ignored by git), for a device call that must not carry
# uncommitted work from the same checkout (helpers editing beside it, say):
#     bash bench/snapshot.sh        # here, then name ".snap" in the device call's carry and
#     cd .snap && bash bench/run_owed.sh STEPS   # there
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .snap
mkdir .snap
git archive HEAD | tar -x -C .snap
echo "snapshot of $(git rev-parse --short HEAD) in .snap/ ($(du -sh .snap | cut -f1))"
