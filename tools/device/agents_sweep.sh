#!/usr/bin/env bash
# Issue 15's agents point on one GPU: `minisgl bench agents` (K=64 agents, T=6 turns, Qwen3-0.6B-shaped dummy
# model, bf16), radix and naive each in its own process (a first engine's KV pool is not given back inside one
# process), over prefill chunk sizes and attention backends. Device call: carry [".whl", ".carry/tok",
# ".carry/fi_aot"], command: bash tools/device/agents_sweep.sh. Knobs: PREFILL="2048 4096", BACKENDS="auto fa3,flashinfer".
# Each run's JSON and log land in $OUT; a table is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[[ -n ${PYTHONPATH:-} && $PYTHONPATH == /tmp/site* ]] || source tools/device/env.sh
MD=$(python3 -c "from minisgl.bench.throughput import write_model_dir; from pathlib import Path; print(write_model_dir(Path('.carry/tok')))")
for backend in ${BACKENDS:-auto fa3,flashinfer}; do
  for n in ${PREFILL:-2048 4096}; do
    for cache in radix naive; do
      name="agents-$cache-$n-${backend/,/+}"
      timeout 120 python3 -m minisgl bench agents --model "$MD" --load-format dummy --device cuda -k 64 -t 6 \
        --caches "$cache" --max-prefill-tokens "$n" --attention-backend "$backend" --json "$OUT/$name.json" \
        > "$OUT/$name.log" 2>&1 || echo "$name failed: $(tail -3 "$OUT/$name.log")"
    done
  done
done
python3 - "$OUT" <<'PY'
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
