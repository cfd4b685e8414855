#!/usr/bin/env bash
# GPU check on one CUDA GPU: set up (tools/device/env.sh), build flashinfer's kernels, run the GPU tests and
# `minisgl bench throughput`, print a table last; logs and JSON go to the output directory.
#   bash tools/device/gpu_check.sh [OUT_DIR]        # OUT_DIR: first argument, or $OUT_DIR, default ${OUT:-./out}
# Stages: STAGES="warm tests bench" (the default; also "extras"). warm builds every kernel (tools/device/gpu_warm.py)
# and writes OUT_DIR/fi_aot.tar.gz (pass it as FLASHINFER_AOT next time to skip the builds). TESTS_K selects tests
# (pytest -k), TESTS_TIMEOUT bounds them (default 480 s). BENCH_ARGS go to `minisgl bench throughput`. extras runs
# `minisgl bench tp all`'s single-GPU stages (EXTRAS, default "hfpatch,agents": the HF generate drop-in and the
# agents benchmark) within EXTRAS_DEADLINE seconds, EXTRAS_ARGS passed on (e.g. --agents-prefill 4096,16384);
# HFPATCH_ARGS (may hold spaces, ";" separates runs) becomes --hfpatch-args, e.g. HFPATCH_ARGS="--repeat 2;--prompt-set
# offline --output-len 256".
set -uo pipefail
OUT_DIR=${1:-${OUT_DIR:-${OUT:-./out}}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 1
cd "$(dirname "$0")/../.."
STAGES=${STAGES:-"warm tests bench"}
t0=$(date +%s)
source tools/device/env.sh || exit 1
export MINISGL_GPU_REPORT=$OUT_DIR/tests.json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)"
echo "setup $(( $(date +%s) - t0 ))s"

if [[ $STAGES == *warm* ]]; then
  timeout 300 python3 tools/device/gpu_warm.py --fa3
  # The built kernels (<16 MB): FLASHINFER_AOT=OUT_DIR/fi_aot.tar.gz lets the next machine skip the builds.
  (cd "$HOME"/.cache/flashinfer/*/*/cached_ops && find . -name "*.so" | tar -czf "$OUT_DIR/fi_aot.tar.gz" -T -)
  echo "warm done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_moe.py tests/test_fused_qkv.py tests/test_warmup.py tests/test_gemv.py tests/test_norm_gemv.py tests/test_moe_gemv.py tests/test_fused_moe.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$OUT_DIR/tests.log"
  echo "tests done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *extras* ]]; then
  timeout $(( ${EXTRAS_DEADLINE:-200} + 30 )) python3 -m minisgl bench tp all --stages "${EXTRAS:-hfpatch,agents}" \
    --out-dir "$OUT_DIR" --deadline "${EXTRAS_DEADLINE:-200}" ${EXTRAS_ARGS:-} ${HFPATCH_ARGS:+--hfpatch-args "$HFPATCH_ARGS"} 2>&1 | grep -v "it/s\]$" | tee "$OUT_DIR/extras.log"
  echo "extras done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-330} python3 -m minisgl bench throughput --out "$OUT_DIR/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "it/s\]$" | tee "$OUT_DIR/bench.log"
  echo "bench done $(( $(date +%s) - t0 ))s"
fi
