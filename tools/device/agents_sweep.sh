#!/usr/bin/env bash
# The shared-prefix agents benchmark on one CUDA GPU: `minisgl bench agents` (K=64 agents, T=6 turns, the dummy
# Qwen3-0.6B-shaped model, bf16), radix and naive each in its own process (a first engine's KV pool is not given
# back inside one process), over prefill chunk sizes and attention backends; a table last.
#   bash tools/device/agents_sweep.sh [OUT_DIR]     # OUT_DIR: first argument, or $OUT_DIR, default ${OUT:-./out}
# Knobs: PREFILL="2048 4096", BACKENDS="auto fa3,flashinfer". Each run's JSON and log land in OUT_DIR.
set -uo pipefail
OUT_DIR=${1:-${OUT_DIR:-${OUT:-./out}}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 1
cd "$(dirname "$0")/../.."
[[ ${GPU_ENV_READY:-} == 1 ]] || source tools/device/env.sh || exit 1
MD=$(python3 -c "from minisgl.bench.throughput import write_model_dir; from pathlib import Path; print(write_model_dir(Path('${MINISGL_TOKENIZER_DIR:-tok}')))")
for backend in ${BACKENDS:-auto fa3,flashinfer}; do
  for n in ${PREFILL:-2048 4096}; do
    for cache in radix naive; do
      name="agents-$cache-$n-${backend/,/+}"
      timeout 120 python3 -m minisgl bench agents --model "$MD" --load-format dummy --device cuda -k 64 -t 6 \
        --caches "$cache" --max-prefill-tokens "$n" --attention-backend "$backend" --json "$OUT_DIR/$name.json" \
        > "$OUT_DIR/$name.log" 2>&1 || echo "$name failed: $(tail -3 "$OUT_DIR/$name.log")"
    done
  done
done
python3 - "$OUT_DIR" <<'PY'
import json, pathlib, sys
rows = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("agents-*.json")):
    _, cache, n, backend = f.stem.split("-", 3)
    rows.setdefault((backend, int(n)), {})[cache] = json.loads(f.read_text())[cache]
print(f"{'backend':18s} {'prefill':>7s} {'radix p50/p99 ms':>17s} {'naive p50/p99 ms':>17s} {'ratio':>6s} {'radix/naive s':>14s} {'hit of max':>10s}")
for (backend, n), r in sorted(rows.items()):
    if {"radix", "naive"} <= r.keys():
        a, b = r["radix"], r["naive"]
        print(f"{backend:18s} {n:7d} {a['ttft_p50_ms']:8.1f}/{a['ttft_p99_ms']:<8.1f} {b['ttft_p50_ms']:8.1f}/{b['ttft_p99_ms']:<8.1f} "
              f"{b['ttft_p50_ms'] / a['ttft_p50_ms']:6.2f} {a['seconds']:6.2f}/{b['seconds']:<7.2f} {a['hit_ratio_of_max']:10.2%}")
PY
