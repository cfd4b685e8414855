#!/usr/bin/env bash
# One device run (see ../shared/device/README.md): install the carried wheels, build (or restore)
# flashinfer's JIT cache, run the GPU tests and the benchmark, print a table, leave logs + JSON in $OUT.
#
# Here, once (.carry/ is git-ignored; the three folders are ~37 MB together):
#   .carry/gpu_whl  pip download --no-deps --only-binary=:all: --python-version 3.12 (platform flags as in
#                   ../shared/device/fetch-wheels.sh) of flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2
#                   nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
#   .carry/tok      tokenizer.json, tokenizer_config.json, chat_template.jinja of ~/.cache/minisgl/models/SmolLM2-*/
#   .carry/fi_aot   fi_aot.tar.gz from $OUT of a run with the "warm" stage (built flashinfer kernels, 9 MB);
#                   without it the first use of each kernel JIT-builds it (~70 s in parallel in "warm")
# Device call: carry [".carry/gpu_whl", ".carry/tok", ".carry/fi_aot"], command: bash scripts/gpu_check.sh
# Stages: STAGES="warm tests bench" (default all); BENCH_ARGS are passed to scripts/gpu_bench.py; TESTS_K
# selects tests (pytest -k); stage "extras" runs scripts/gpu_tp.py's single-GPU stages (EXTRAS, default
# "hfpatch,agents": the HF generate drop-in and the agents benchmark) within EXTRAS_DEADLINE seconds,
# EXTRAS_ARGS passed on (e.g. --agents-prefill 4096,16384 --hfpatch-args=--profile); HFPATCH_ARGS (may hold
# spaces, ";" separates runs) becomes --hfpatch-args, e.g. HFPATCH_ARGS="--repeat 2;--prompt-set offline --output-len 256".
# .carry/zmq_whl (pyzmq, for `minisgl serve`) is installed too when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minisgl-gpu}
mkdir -p "$OUT"
STAGES=${STAGES:-"warm tests bench"}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export MINISGL_TOKENIZER_DIR=$PWD/.carry/tok MINISGL_GPU_REPORT=$OUT/tests.json

t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .carry/gpu_whl/*.whl $(ls .carry/zmq_whl/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/integrations
# flashinfer loads a module's .so from its AOT folder without running ninja: ship only those.
AOT=/tmp/site/flashinfer/data/aot
if [[ -f .carry/fi_aot/fi_aot.tar.gz ]]; then
  mkdir -p $AOT && tar -xzf .carry/fi_aot/fi_aot.tar.gz -C $AOT && echo "flashinfer kernels restored: $(ls $AOT | wc -l)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)"
echo "setup $(( $(date +%s) - t0 ))s"

if [[ $STAGES == *warm* ]]; then
  timeout 300 python3 scripts/gpu_warm.py --fa3
  # Ship the built kernels back (<16 MB) so the next machine skips the builds: carry them as .carry/fi_aot.
  (cd "$HOME"/.cache/flashinfer/*/*/cached_ops && find . -name "*.so" | tar -czf "$OUT/fi_aot.tar.gz" -T -)
  echo "warm done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *tests* ]]; then
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$OUT/tests.log"
  echo "tests done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *extras* ]]; then
  timeout $(( ${EXTRAS_DEADLINE:-200} + 30 )) python3 scripts/gpu_tp.py all --stages "${EXTRAS:-hfpatch,agents}" \
    --out-dir "$OUT" --deadline "${EXTRAS_DEADLINE:-200}" ${EXTRAS_ARGS:-} ${HFPATCH_ARGS:+--hfpatch-args "$HFPATCH_ARGS"} 2>&1 | grep -v "it/s\]$" | tee "$OUT/extras.log"
  echo "extras done $(( $(date +%s) - t0 ))s"
fi
if [[ $STAGES == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-330} python3 scripts/gpu_bench.py --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "it/s\]$" | tee "$OUT/bench.log"
  echo "bench done $(( $(date +%s) - t0 ))s"
fi
