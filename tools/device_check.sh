#!/usr/bin/env bash
# The GPU checks and the decode benchmark of a working tree, in one run on a CUDA machine (the device box: its
# copy of the tree may carry an older .git, so the commit is given, not read). Writes JSON under OUT (default
# ./device-out), named as bench/results names them, and prints a short summary.
#
#   tools/device_check.sh COMMIT [FIXTURES] [CONTEXTS] [VARIANTS]
#
# COMMIT    the id recorded in the reports
# FIXTURES  a copy of ../shared/fixtures/qwen4exp-tiny (hf/, prompt.json, *.gguf); the model check skips the
#           fixture models without it (the device box does not see ../shared: copy it into an ignored folder of
#           the tree and carry that folder)
# CONTEXTS  decode contexts of the bench (default 4096,131072)
# VARIANTS  decode-step variants to time after the bench, space-separated (`tools/step_variants.py --help`);
#           none by default (the prefill's expert GEMM against the GEMV is always timed)
set -uo pipefail  # no -e: a failed check is reported and the next one still runs
commit=${1:?usage: tools/device_check.sh COMMIT [FIXTURES] [CONTEXTS] [VARIANTS]}
fixtures=${2:+$(realpath -m "$2")}
contexts=${3:-4096,131072}
variants=${4:-}
out=$(realpath -m "${OUT:-device-out}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
quiet() { grep -v -e Warning -e warn_once -e "Writing model shards" || true; }

echo "== PDL and graph equality (captured split, one graph, eager)"
python tools/gpu_check_pdl.py --out "$out/gpu-check-pdl-$commit.json" 2>&1 | quiet | tail -4
echo "(exit ${PIPESTATUS[0]})"
echo "== row-register GEMVs against float64, bf16 x widened both ways"
python tools/gpu_check_gemv.py --types Q4_K_R,Q8_0_R,Q5_1_R,Q6_K_R,Q4_K_RT,Q6_K_RT \
    --out "$out/gemv-check-rr-$commit.json" 2>&1 \
    | quiet | tail -6
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
echo "== prefill (2,048 tokens): expert GEMM (base) against one GEMV pass per slot (experts-gemm:0), shapes, chunks"
python tools/step_variants.py --commit "$commit" --tokens 16 --prefill-tokens 2048 \
    --out "$out/prefill-variants-$commit.json" base experts-gemm:0 experts-gemm-shape:32,8 \
    experts-gemm-shape:64,8 experts-gemm-shape:16,4 prefill-chunk:1024 prefill-chunk:2048 base 2>&1 | quiet
echo "(exit ${PIPESTATUS[0]})"
if [ -n "$variants" ]; then
    echo "== decode-step variants (4K)"
    # shellcheck disable=SC2086  # the list is split into one argument per variant
    python tools/step_variants.py --commit "$commit" --out "$out/step-variants-$commit.json" $variants 2>&1 | quiet
    echo "(exit ${PIPESTATUS[0]})"
fi
