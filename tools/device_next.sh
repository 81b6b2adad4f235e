#!/usr/bin/env bash
# The full GPU run for an H200 (the target's card), in one run and in order of need (what a run cut short wrote
# still comes back): the GPU checks (the bit-for-bit PDL check; with FIXTURES, a copy of
# ../shared/fixtures/qwen4exp-tiny carried into the tree, the model check against the CPU reference, with the tables
# on the GPU, page-locked, and run ahead, whole or the split step's front), reads and GEMVs at the step's sizes fed
# by bulk (TMA) copies against register loads and the step's own GEMVs (tools/tma_lab.py), the decode
# bench at 4K and 128K (the 128K state does not fit an H100 beside the model; the PLE table held in memory,
# --ple-table auto; then with the tables in the GPU's memory, --ple-table device, where the step hashes and gathers
# the rows itself and runs ahead of the host, timed against one id at a time in the same process), the host's PLE
# row gather by page mapping (tools/host_pages_lab.py), then the routed GLU's stacks and the head as stored
# (tile-major) against their row-major twins in the 4K step (tools/step_variants.py row-major:T), and the
# routed-expert launches alone (tools/moe_lab.py). Writes JSON under OUT (default ./device-out), named as
# bench/results names them. ~10 minutes.
#
#   tools/device_next.sh COMMIT [FIXTURES]
set -uo pipefail  # no -e: a failed step is reported and the next one still runs
commit=${1:?usage: tools/device_next.sh COMMIT [FIXTURES]}
fixtures=${2:+$(realpath -m "$2")}
# the device box's copy has no .git: the reports name the commit given here, so it must be a full hash
[[ $commit =~ ^[0-9a-f]{40}$ ]] || { echo "COMMIT must be a full 40-digit commit hash, not '$commit'" >&2; exit 2; }
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once || true; }

echo "== PDL and graph equality (captured split, one graph, eager)"
python tools/gpu_check_pdl.py --out "$out/gpu-check-pdl-$commit.json" 2>&1 | quiet | tail -4
if [ -n "$fixtures" ]; then
    echo "== model check (GPU against the CPU reference)"
    python tools/gpu_check_model.py --fixtures "$fixtures" --out "$out/model-check-$commit.json" 2>&1 | quiet | tail -12
fi
echo "== reads and GEMVs at the step's sizes: bulk (TMA) copies against register loads"
timeout 240 python tools/tma_lab.py --commit "$commit" --out "$out/tma-lab-$commit.json" 2>&1 | quiet | tail -70
echo "(exit ${PIPESTATUS[0]})"
echo "== decode bench (synthetic real geometry, 4K and 128K)"
python -m strata.cli.main bench --contexts 4096,131072 --no-stages --profile --timeline --commit "$commit" \
    --out "$out/synthetic-decode-$commit.json" 2>&1 | quiet | grep -E "ms/token|layer \(|Error|error|skipped"
echo "(exit ${PIPESTATUS[0]})"
echo "== decode bench with the PLE tables in the GPU's memory (--ple-table device: the step gathers its rows)"
python -m strata.cli.main bench --contexts 4096,131072 --no-stages --ple-table device --commit "$commit" \
    --out "$out/synthetic-decode-ple-device-$commit.json" 2>&1 | quiet | grep -E "ms/token|Error|error|skipped"
echo "(exit ${PIPESTATUS[0]})"
python tools/host_pages_lab.py --tokens 1000 --out "$out/host-pages-$commit.json" 2>&1 | quiet
echo "== tile-major against row-major in the 4K step"
timeout 200 python tools/step_variants.py --commit "$commit" --out "$out/step-variants-tiled-$commit.json" \
    base row-major:glu+row-major:head base row-major:glu+row-major:head 2>&1 | quiet
echo "(exit ${PIPESTATUS[0]})"
echo "== routed-expert and row-register launches alone (48 layers' worth, captured)"
python tools/moe_lab.py --commit "$commit" --out "$out/moe-lab-$commit.json" 2>&1 | quiet
echo "(exit ${PIPESTATUS[0]})"
