#!/usr/bin/env bash
# What the session of 2026-12-06 built and has not yet measured on a CUDA machine (the device box), in one run:
# the per-program probe of the row-register launches with its per-SM figures, float and q8 activations
# (tools/step_probe.py: is the routed GLU bound by what its SMs issue?), the probe with the routed GLU and down
# projections held to a number of programs per SM (`gemv_rr.SM_CAP`), and those caps as step variants. Writes
# JSON under OUT (default ./device-out), named as bench/results names them. ~3 minutes on an H100.
#
#   tools/device_next.sh COMMIT
set -uo pipefail  # no -e: a failed step is reported and the next one still runs
commit=${1:?usage: tools/device_next.sh COMMIT}
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once || true; }

for act in float q8; do
    echo "== per-program probe of the row-register launches, $act activations"
    python tools/step_probe.py --commit "$commit" --activations "$act" --classes ids,settled-ids,plain \
        --out "$out/step-probe-$act-$commit.json" 2>&1 | quiet | tail -21
    echo "(exit ${PIPESTATUS[0]})"
done
echo "== the probe with the routed GLU held to 13 programs per SM, the routed down to 25"
python tools/step_probe.py --commit "$commit" --classes ids,settled-ids --sm-cap ids:13 --sm-cap settled-ids:25 \
    --out "$out/step-probe-cap-$commit.json" 2>&1 | quiet | tail -7
echo "(exit ${PIPESTATUS[0]})"
echo "== programs-per-SM caps in the 4K step"
timeout 300 python tools/step_variants.py --commit "$commit" --out "$out/step-variants-smcap-$commit.json" \
    base sm-cap:ids:13 sm-cap:ids:14 sm-cap:settled-ids:25 sm-cap:ids:13+sm-cap:settled-ids:25 base 2>&1 | quiet
echo "(exit ${PIPESTATUS[0]})"
