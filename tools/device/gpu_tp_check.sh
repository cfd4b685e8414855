#!/usr/bin/env bash
# One device run on nvidia-h200-x2 (issue 9, plus the GPU figures of issues 7 and 10): install the carried
# wheels (tools/device/env.sh), restore flashinfer's built kernels, probe NCCL (tools/device/gpu_nccl_probe.py),
# run `minisgl bench tp all`, which prints a table last and leaves tp.json (+ runs.log, hfpatch.json,
# agents_*.json) in $OUT. Needs pyzmq among the wheels (`minisgl serve --node-rank 1`; fetch-wheels.sh has it).
# Device call (kind nvidia-h200-x2): carry [".whl", ".carry/tok", ".carry/fi_aot"],
#   command: bash tools/device/gpu_tp_check.sh
# TP_ARGS are passed to `minisgl bench tp all` (e.g. --stages parity,nodes,tput --num-requests 128).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/minisgl-gpu-tp}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
t0=$(date +%s)
source tools/device/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import torch, flashinfer, zmq; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count())"
echo "setup $(( $(date +%s) - t0 ))s"

if [[ ${PROBE:-1} == 1 ]]; then
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM timeout 60 python3 tools/device/gpu_nccl_probe.py > "$OUT/nccl_probe.log" 2>&1
  grep -E "NCCL_PROBE|via |P2P|SHM|WARN|Error|error" "$OUT/nccl_probe.log" | sed 's/^.*NCCL INFO //' | sort | uniq -c | sort -rn | head -25
  echo "probe done $(( $(date +%s) - t0 ))s"
fi
timeout ${TP_TIMEOUT:-560} python3 -m minisgl bench tp all --out-dir "$OUT" --latency \
  --deadline $(( ${TP_TIMEOUT:-560} - 20 )) ${TP_ARGS:-} 2>&1 | tee "$OUT/tp.log"
echo "done $(( $(date +%s) - t0 ))s"
