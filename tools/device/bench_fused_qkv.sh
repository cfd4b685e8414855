#!/usr/bin/env bash
# Issue 15 on one H100: the fused q/k-norm + RoPE + KV-store kernel, on and off (docs/benchmarks.md,
# "Session 5"). Device call: carry [".whl", ".carry/tok", ".carry/fi_aot"],
# command: bash tools/device/bench_fused_qkv.sh. Carried (tools/README.md):
#   .whl        wheels from ../shared/device/fetch-wheels.sh
#   .carry/tok  SmolLM2's tokenizer.json, tokenizer_config.json, chat_template.jinja
#   .carry/fi_aot/fi_aot.tar.gz  (optional) built flashinfer kernels from a warm run
#               (without them the first engine JIT-builds its kernels: minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tools/device/env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused_qkv.py 2>&1 | tail -2
MD=$(python3 -c "import sys; from minisgl.bench.throughput import write_model_dir; from pathlib import Path; print(write_model_dir(Path('.carry/tok')))")
run() { name=$1; shift; echo "=== $name"; timeout 150 env "$@" 2>"$OUT/$name.err" | grep RESULT | sed "s/^/$name /"; }
run fused python3 -m minisgl bench throughput run --model-dir "$MD" --latency
run unfused MINISGL_FUSED_QKV=0 python3 -m minisgl bench throughput run --model-dir "$MD" --latency
