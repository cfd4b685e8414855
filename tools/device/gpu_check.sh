#!/usr/bin/env bash
# One device run (see tools/README.md): install the carried wheels, build (or restore) flashinfer's JIT
# cache, run the GPU tests and the benchmark, print a table, leave logs + JSON in $OUT.
# Device call: carry [".whl", ".carry/tok", ".carry/fi_aot"], command: bash tools/device/gpu_check.sh
# Stages: STAGES="warm tests bench" (default all); BENCH_ARGS are passed to `minisgl bench throughput`;
# TESTS_K selects tests (pytest -k); stage "extras" runs `minisgl bench tp all`'s single-GPU stages (EXTRAS,
# default "hfpatch,agents": the HF generate drop-in and the agents benchmark) within EXTRAS_DEADLINE seconds,
# EXTRAS_ARGS passed on (e.g. --agents-prefill 4096,16384 --hfpatch-args=--profile); HFPATCH_ARGS (may hold
# spaces, ";" separates runs) becomes --hfpatch-args, e.g. HFPATCH_ARGS="--repeat 2;--prompt-set offline --output-len 256".
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/minisgl-gpu}
mkdir -p "$OUT"
STAGES=${STAGES:-"warm tests bench"}
t0=$(date +%s)
source tools/device/env.sh
export MINISGL_GPU_REPORT=$OUT/tests.json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)"
echo "setup $(( $(date +%s) - t0 ))s"

if [[ $STAGES == *warm* ]]; then
  timeout 300 python3 tools/device/gpu_warm.py --fa3
  # Ship the built kernels back (<16 MB) so the next machine skips the builds: carry them as .carry/fi_aot.
  (cd "$HOME"/.cache/flashinfer/*/*/cached_ops && find . -name "*.so" | tar -czf "$OUT/fi_aot.tar.gz" -T -)
  echo "warm done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_fused_qkv.py tests/test_warmup.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$OUT/tests.log"
  echo "tests done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *extras* ]]; then
  timeout $(( ${EXTRAS_DEADLINE:-200} + 30 )) python3 -m minisgl bench tp all --stages "${EXTRAS:-hfpatch,agents}" \
    --out-dir "$OUT" --deadline "${EXTRAS_DEADLINE:-200}" ${EXTRAS_ARGS:-} ${HFPATCH_ARGS:+--hfpatch-args "$HFPATCH_ARGS"} 2>&1 | grep -v "it/s\]$" | tee "$OUT/extras.log"
  echo "extras done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-330} python3 -m minisgl bench throughput --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "it/s\]$" | tee "$OUT/bench.log"
  echo "bench done $(( $(date +%s) - t0 ))s"
fi
