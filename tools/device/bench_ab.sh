#!/usr/bin/env bash
# Issue 15 on one H100: a GPU kernel's test, then issue 8's throughput workload (+ batch-1 latency) with the
# kernel on and off (its switch set to 0), each in its own process (docs/benchmarks.md, sessions 5 and 7).
# Device call: carry [".whl", ".carry/tok", ".carry/fi_aot"], command: bash tools/device/bench_ab.sh TEST SWITCH
#   bash tools/device/bench_ab.sh tests/test_fused_qkv.py MINISGL_FUSED_QKV       # the fused q/k norm + RoPE + KV store
# PROFILE=1 then runs `minisgl bench profile gpu --whole-run` (kernel on). Carried (tools/README.md):
#   .whl        wheels from ../shared/device/fetch-wheels.sh
#   .carry/tok  SmolLM2's tokenizer.json, tokenizer_config.json, chat_template.jinja
#   .carry/fi_aot/fi_aot.tar.gz  (optional) built flashinfer kernels from a warm run
#               (without them the first engine JIT-builds its kernels: minutes)
set -uo pipefail
cd "$(dirname "$0")/../.."
TEST=$1 SWITCH=$2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source tools/device/env.sh
timeout 180 python3 -m pytest -q -p no:cacheprovider "$TEST" > "$OUT/test.log" 2>&1; tail -2 "$OUT/test.log"
MD=$(python3 -c "import sys; from minisgl.bench.throughput import write_model_dir; from pathlib import Path; print(write_model_dir(Path('.carry/tok')))")
run() { name=$1; shift; echo "=== $name"; timeout 150 env "$@" 2>"$OUT/$name.err" | grep RESULT | sed "s/^/$name /"; }
run on python3 -m minisgl bench throughput run --model-dir "$MD" --latency
run off "$SWITCH=0" python3 -m minisgl bench throughput run --model-dir "$MD" --latency
if [[ ${PROFILE:-0} == 1 ]]; then
  timeout 150 python3 -m minisgl bench profile gpu --whole-run 2>&1 | grep -v "it/s\]$" > "$OUT/profile.log"
  sed -n '/steps in/,/steps 800/p' "$OUT/profile.log"
fi
