#!/usr/bin/env bash
# For an H200, in order of need (files written so far come back if time runs out): the decode bench at 4K and
# 128K (the synthetic PLE table held in memory: --ple-table auto), the host's row gather by page mapping
# (tools/host_pages_lab.py), then tile-major against row-major in the 4K step.
# Writes JSON under OUT (default ./device-out), named as bench/results names them.
#
#   tools/device_ple.sh COMMIT
set -uo pipefail
commit=${1:?usage: tools/device_ple.sh COMMIT}
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once || true; }
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== decode bench, PLE table resident (4K, 128K)"
python -m strata.cli.main bench --contexts 4096,131072 --no-stages --prefill-tokens 0 --profile --timeline \
    --commit "$commit" --out "$out/synthetic-decode-$commit.json" 2>&1 | quiet | grep -E "ctx|layer \(|Error"
python tools/host_pages_lab.py --tokens 1000 --out "$out/host-pages-$commit.json" 2>&1 | quiet
echo "== tile-major against row-major in the 4K step"
timeout 200 python tools/step_variants.py --commit "$commit" --out "$out/step-variants-tiled-$commit.json" \
    base row-major:glu+row-major:head base row-major:glu+row-major:head 2>&1 | quiet
