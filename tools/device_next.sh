#!/usr/bin/env bash
# What the session of 2026-12-06 measured on H100s only, for an H200 (the target's card), in one run: the
# routed-expert launches alone by where their experts lie, and row-register launches with their weights stored
# tile-major (a program's words of one K-loop step together: tools/moe_lab.py), then the routed GLU's and down
# projections' stacks and the head tile-major in the 4K step (tools/step_variants.py tile-major:T). Writes JSON
# under OUT (default ./device-out), named as bench/results names them. ~3 minutes on an H100.
#
#   tools/device_next.sh COMMIT
set -uo pipefail  # no -e: a failed step is reported and the next one still runs
commit=${1:?usage: tools/device_next.sh COMMIT}
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once || true; }

echo "== routed-expert and row-register launches alone (48 layers' worth, captured)"
python tools/moe_lab.py --commit "$commit" --out "$out/moe-lab-$commit.json" 2>&1 | quiet
echo "(exit ${PIPESTATUS[0]})"
echo "== tile-major weights in the 4K step"
timeout 300 python tools/step_variants.py --commit "$commit" --out "$out/step-variants-tile-$commit.json" \
    base tile-major:glu tile-major:down tile-major:head tile-major:glu+tile-major:down+tile-major:head base 2>&1 \
    | quiet
echo "(exit ${PIPESTATUS[0]})"
