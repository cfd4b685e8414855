#!/usr/bin/env bash
# Tensor-parallel check on one host with 2 CUDA GPUs: set up (tools/device/env.sh), probe NCCL
# (tools/device/gpu_nccl_probe.py; PROBE=0 skips it), then `minisgl bench tp all --latency`: TP=2 vs TP=1 parity,
# two "nodes" on one host, throughput, a rank killed under `minisgl serve --tp 2`, the HF drop-in and agents.
# It prints a table last and leaves tp.json (+ runs.log, hfpatch.json, agents_*.json) in the output directory.
#   bash tools/device/gpu_tp_check.sh [OUT_DIR]     # OUT_DIR: first argument, or $OUT_DIR, default ${OUT:-./out}
# TP_ARGS go to `minisgl bench tp all` (e.g. --stages parity,nodes,tput --profile --repeat 3 --tp2-env "VAR=v;VAR=w");
# TP_TIMEOUT bounds it (seconds, default 560). Needs pyzmq (`minisgl serve --node-rank 1`).
set -uo pipefail
OUT_DIR=${1:-${OUT_DIR:-${OUT:-./out}}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 1
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
t0=$(date +%s)
source tools/device/env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import torch, flashinfer, zmq; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count())"
echo "setup $(( $(date +%s) - t0 ))s"

if [[ ${PROBE:-1} == 1 ]]; then
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM timeout 60 python3 tools/device/gpu_nccl_probe.py > "$OUT_DIR/nccl_probe.log" 2>&1
  grep -E "NCCL_PROBE|via |P2P|SHM|WARN|Error|error" "$OUT_DIR/nccl_probe.log" | sed 's/^.*NCCL INFO //' | sort | uniq -c | sort -rn | head -25
  echo "probe done $(( $(date +%s) - t0 ))s"
fi
timeout ${TP_TIMEOUT:-560} python3 -m minisgl bench tp all --out-dir "$OUT_DIR" --latency \
  --deadline $(( ${TP_TIMEOUT:-560} - 20 )) ${TP_ARGS:-} 2>&1 | tee "$OUT_DIR/tp.log"
echo "done $(( $(date +%s) - t0 ))s"
