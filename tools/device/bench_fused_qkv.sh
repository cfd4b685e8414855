#!/usr/bin/env bash
# Issue 15 on one H100: the fused q/k-norm + RoPE + KV-store kernel, on and off (docs/benchmarks.md,
# "Session 5"). Run on the device from the repo root, carrying:
#   .whl        wheels from ../shared/device/fetch-wheels.sh
#   .carry/tok  SmolLM2's tokenizer.json, tokenizer_config.json, chat_template.jinja
#   .carry/fi_aot/fi_aot.tar.gz  (optional) built flashinfer kernels from a warm run
#               (without them the first engine JIT-builds its kernels: minutes)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
AOT=/tmp/site/flashinfer/data/aot
if [[ -f .carry/fi_aot/fi_aot.tar.gz ]]; then mkdir -p $AOT && tar -xzf .carry/fi_aot/fi_aot.tar.gz -C $AOT; fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/integrations MINISGL_TOKENIZER_DIR=$PWD/.carry/tok
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k fused_qkv 2>&1 | tail -2
MD=$(python3 -c "import sys; sys.path.insert(0,'scripts'); from gpu_bench import write_model_dir; from pathlib import Path; print(write_model_dir(Path('.carry/tok')))")
run() { name=$1; shift; echo "=== $name"; timeout 150 env "$@" 2>"$OUT/$name.err" | grep RESULT | sed "s/^/$name /"; }
run fused python3 scripts/gpu_bench.py run --model-dir "$MD" --latency
run unfused MINISGL_FUSED_QKV=0 python3 scripts/gpu_bench.py run --model-dir "$MD" --latency
