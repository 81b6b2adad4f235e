#!/usr/bin/env bash
# What the session of 2026-12-05 (eighth) built and could not measure, in one run on a CUDA machine (the device
# box): the per-program probe of the row-register launches in the step (tools/step_probe.py), the HC read in one
# launch against two (tools/step_variants.py hc:one-launch, also with 8-feature up programs), and the bench, whose
# host phases show the shorter PLE staging and the dropped event record. Writes JSON under OUT (default
# ./device-out), named as bench/results names them.
#
#   tools/device_next.sh COMMIT [CONTEXTS]
set -uo pipefail  # no -e: a failed step is reported and the next one still runs
commit=${1:?usage: tools/device_next.sh COMMIT [CONTEXTS]}
contexts=${2:-4096,131072}
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once || true; }

echo "== the HC read in one launch against two (4K step)"
python tools/step_variants.py --commit "$commit" --out "$out/step-variants-$commit.json" \
    base hc:one-launch hc:one-launch+hc-up:8 hc-up:8 base 2>&1 | quiet
echo "(exit ${PIPESTATUS[0]})"
echo "== per-program probe of the row-register launches (routed GLU, routed down, the others)"
python tools/step_probe.py --commit "$commit" --classes ids,settled-ids,plain --out "$out/step-probe-$commit.json" \
    2>&1 | quiet | tail -16
echo "(exit ${PIPESTATUS[0]})"
echo "== host staging at the real geometry (this machine's CPU)"
python tools/bench_staging.py --real-geometry --commit "$commit" --out "$out/ple-staging-$commit.json" 2>&1 | tail -1
echo "== decode bench (synthetic real geometry)"
python -m strata.cli.main bench --contexts "$contexts" --prefill-tokens 512 --no-stages --profile --timeline \
    --commit "$commit" --out "$out/synthetic-decode-$commit.json" 2>&1 | quiet \
    | grep -E "ms/token|prefill:|layer \(|Error"
echo "(exit ${PIPESTATUS[0]})"
