#!/usr/bin/env bash
# FP8 weights on one CUDA GPU of compute capability 9.0+: set up (tools/device/env.sh), the FP8 GEMM microbenchmark
# (tools/device/fp8_gemm_bench.py), the FP8 GPU tests, then `minisgl bench throughput --with-fp8` (the offline
# workload and batch-1 latency, bf16 and FP8 weights) on each shape of SHAPES; logs and JSON go to the output dir.
#   bash tools/device/gpu_fp8_check.sh [OUT_DIR]     # OUT_DIR: first argument, or $OUT_DIR, default ${OUT:-./out}
# SHAPES (default "qwen3-8b"); FP8_ONLY_SHAPES: shapes run with FP8 weights alone (e.g. qwen3-30b-a3b, with
# FP8_ONLY_ARGS="--num-pages 19000" to bound the KV pool and read the peak memory); STAGES (default
# "gemm tests bench"); FP8_TUNE=1 runs the benchmarks with MINISGL_FP8_WEIGHT_ONLY_ROWS from the microbenchmark.
set -uo pipefail
OUT_DIR=${1:-${OUT_DIR:-${OUT:-./out}}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 1
cd "$(dirname "$0")/../.."
STAGES=${STAGES:-"gemm tests bench"}
t0=$(date +%s)
source tools/device/env.sh || exit 1
export MINISGL_GPU_REPORT=$OUT_DIR/fp8_tests.json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "setup $(( $(date +%s) - t0 ))s"
if [[ $STAGES == *gemm* ]]; then
  timeout 180 python3 tools/device/fp8_gemm_bench.py --out "$OUT_DIR/fp8_gemm.json" | tee "$OUT_DIR/fp8_gemm.log"
  rows=$(awk '/^WEIGHT_ONLY_ROWS/ {print $2}' "$OUT_DIR/fp8_gemm.log")
  [[ ${FP8_TUNE:-0} == 1 && -n $rows ]] && export MINISGL_FP8_WEIGHT_ONLY_ROWS=$rows
  echo "gemm done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py tests/test_gpu_fp8.py \
    -k "not interpreter" 2>&1 | tail -15
  echo "tests done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *bench* ]]; then
  for shape in ${SHAPES:-qwen3-8b}; do
    timeout 400 python3 -m minisgl bench throughput --shape "$shape" --quick --skip-hf --with-fp8 \
      --out "$OUT_DIR/fp8_$shape.json" 2>&1 | grep -v "^\[" | tail -14
  done
  for shape in ${FP8_ONLY_SHAPES:-}; do
    timeout 300 python3 -m minisgl bench throughput --shape "$shape" --quick --skip-hf --fp8-only ${FP8_ONLY_ARGS:-} \
      --out "$OUT_DIR/fp8_only_$shape.json" 2>&1 | grep -v "^\[" | tail -10
  done
  echo "bench done $(( $(date +%s) - t0 ))s"
fi
