#!/usr/bin/env bash
# The Q8-activation mode on a CUDA machine (the device box), in one run: the kernels against float64 and their
# timings alone (tools/gemv_q8x_lab.py), the model check in the mode (GPU against the CPU reference in the same
# mode), the mode in the 4K decode step against the float step back to back (tools/step_variants.py), and the
# bench in the mode. Writes JSON under OUT (default ./device-out), named as bench/results names them.
#
#   tools/device_q8x.sh COMMIT [FIXTURES] [CONTEXTS]
set -uo pipefail  # no -e: a failed check is reported and the next one still runs
commit=${1:?usage: tools/device_q8x.sh COMMIT [FIXTURES] [CONTEXTS]}
fixtures=${2:+$(realpath -m "$2")}
contexts=${3:-4096,131072}
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once -e "Writing model shards" || true; }

echo "== Q8-activation GEMVs: checks, then each launch alone against the float GEMV"
python tools/gemv_q8x_lab.py --out "$out/gemv-q8x-lab-$commit.json" 2>&1 | quiet | tail -30
echo "(exit ${PIPESTATUS[0]})"
echo "== model check in the q8 mode (GPU against the CPU reference)"
python tools/gpu_check_model.py --activations q8 ${fixtures:+--fixtures "$fixtures"} \
    --out "$out/model-check-q8-$commit.json" 2>&1 | quiet | tail -12
echo "(exit ${PIPESTATUS[0]})"
echo "== the 4K step: float against q8 (the out projections' preload of 1, 3, 6 steps, the routed GLU's of 2 and 5), back to back"
python tools/step_variants.py --commit "$commit" --out "$out/step-variants-q8-$commit.json" \
    base activations:q8 activations:q8+preload:q8:Q8_0_R/6:1 activations:q8+preload:q8:Q8_0_R/6:6 base \
    activations:q8 activations:q8+preload:q8:Q8_0_R/6:3 activations:q8+preload:q8:Q4_K_R:2 \
    activations:q8+preload:q8:Q4_K_R:5 activations:q8+preload:q8:Q4_K_R:5+shape:Q4_K_R:10:0:1000000:4,2,1,1 \
    activations:q8+q8-units:off 2>&1 | quiet
echo "(exit ${PIPESTATUS[0]})"
echo "== decode bench in the q8 mode (synthetic real geometry)"
python -m strata.cli.main bench --activations q8 --contexts "$contexts" --prefill-tokens 512 --no-stages \
    --profile --timeline --commit "$commit" --out "$out/synthetic-decode-q8-$commit.json" 2>&1 | quiet \
    | grep -E "ms/token|prefill|layer \(|Error"
echo "(exit ${PIPESTATUS[0]})"
