#!/usr/bin/env bash
# One device run on nvidia-h200-x2 (issue 9, plus the GPU figures of issues 7 and 10): install the carried
# wheels (as scripts/gpu_check.sh), restore flashinfer's built kernels, run scripts/gpu_tp.py all, which
# prints a table last and leaves tp.json (+ runs.log, hfpatch.json, agents_*.json) in $OUT.
#
# Here, once: the ignored folders of scripts/gpu_check.sh (.carry/gpu_whl, .carry/tok, .carry/fi_aot) and
#   .carry/zmq_whl  pip download --no-deps --only-binary=:all: --python-version 3.12 (platform flags as in
#                   ../shared/device/fetch-wheels.sh) pyzmq==27.2.0: `minisgl serve --node-rank 1` needs it
# Device call (kind nvidia-h200-x2): carry [".carry/gpu_whl", ".carry/tok", ".carry/fi_aot", ".carry/zmq_whl"],
#   command: bash scripts/gpu_tp_check.sh
# TP_ARGS are passed to scripts/gpu_tp.py (e.g. --stages parity,nodes,tput --num-requests 128).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minisgl-gpu-tp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export MINISGL_TOKENIZER_DIR=$PWD/.carry/tok

t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .carry/gpu_whl/*.whl .carry/zmq_whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/integrations
AOT=/tmp/site/flashinfer/data/aot
if [[ -f .carry/fi_aot/fi_aot.tar.gz ]]; then
  mkdir -p $AOT && tar -xzf .carry/fi_aot/fi_aot.tar.gz -C $AOT && echo "flashinfer kernels restored: $(ls $AOT | wc -l)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c "import torch, flashinfer, zmq; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'flashinfer', flashinfer.__version__, 'gpus', torch.cuda.device_count())"
echo "setup $(( $(date +%s) - t0 ))s"

if [[ ${PROBE:-1} == 1 ]]; then
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM timeout 60 python3 scripts/gpu_nccl_probe.py > "$OUT/nccl_probe.log" 2>&1
  grep -E "NCCL_PROBE|via |P2P|SHM|WARN|Error|error" "$OUT/nccl_probe.log" | sed 's/^.*NCCL INFO //' | sort | uniq -c | sort -rn | head -25
  echo "probe done $(( $(date +%s) - t0 ))s"
fi
timeout ${TP_TIMEOUT:-560} python3 scripts/gpu_tp.py all --out-dir "$OUT" --latency \
  --deadline $(( ${TP_TIMEOUT:-560} - 20 )) ${TP_ARGS:-} 2>&1 | tee "$OUT/tp.log"
echo "done $(( $(date +%s) - t0 ))s"
