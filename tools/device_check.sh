#!/usr/bin/env bash
# The GPU checks and the decode benchmark of a working tree, in one run on a CUDA machine (the device box: its
# copy of the tree may carry an older .git, so the commit is given, not read). Writes JSON under OUT (default
# ./device-out), named as bench/results names them, and prints a short summary.
#
#   tools/device_check.sh COMMIT [FIXTURES] [CONTEXTS]
#
# COMMIT    the id recorded in the reports
# FIXTURES  a copy of ../shared/fixtures/qwen4exp-tiny (hf/, prompt.json, *.gguf); the model check skips the
#           fixture models without it (the device box does not see ../shared: copy it into an ignored folder of
#           the tree and carry that folder)
# CONTEXTS  decode contexts of the bench (default 4096,131072)
set -uo pipefail  # no -e: a failed check is reported and the next one still runs
commit=${1:?usage: tools/device_check.sh COMMIT [FIXTURES] [CONTEXTS]}
fixtures=${2:+$(realpath -m "$2")}
contexts=${3:-4096,131072}
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once -e "Writing model shards" || true; }

echo "== PDL and graph equality (captured split, one graph, eager)"
python tools/gpu_check_pdl.py --out "$out/gpu-check-pdl-$commit.json" 2>&1 | quiet | tail -4
echo "(exit ${PIPESTATUS[0]})"
echo "== model check (GPU against the CPU reference)"
python tools/gpu_check_model.py ${fixtures:+--fixtures "$fixtures"} --out "$out/model-check-$commit.json" 2>&1 \
    | quiet | tail -12
echo "(exit ${PIPESTATUS[0]})"
echo "== decode bench (synthetic real geometry)"
python -m strata.cli.main bench --contexts "$contexts" --prefill-tokens 512 --no-stages --profile --timeline \
    --commit "$commit" --out "$out/synthetic-decode-$commit.json" 2>&1 | quiet \
    | grep -E "ms/token|prefill|layer \(|Error"
echo "(exit ${PIPESTATUS[0]})"
