# Sourced by the tools/device/*.sh wrappers, from the repository root on the device machine:
# installs the carried wheels into /tmp/site, restores flashinfer's built kernels when carried,
# and exports PYTHONPATH / MINISGL_TOKENIZER_DIR. See tools/README.md for what to carry.
#   .whl/                        wheels from ../shared/device/fetch-wheels.sh (flashinfer 0.5.3, pyzmq, ...)
#   .carry/tok/                  SmolLM2's tokenizer.json, tokenizer_config.json, chat_template.jinja
#   .carry/fi_aot/fi_aot.tar.gz  (optional) built flashinfer kernels (gpu_check.sh's "warm" stage writes it)
# Older carries (.carry/gpu_whl, .carry/zmq_whl) are installed too when present.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export MINISGL_TOKENIZER_DIR=$PWD/.carry/tok
_wheels=$(ls .whl/*.whl .carry/gpu_whl/*.whl .carry/zmq_whl/*.whl 2>/dev/null)
[[ -n $_wheels ]] || { echo "no wheels: run bash ../shared/device/fetch-wheels.sh here and carry .whl" >&2; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $_wheels || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/integrations
# flashinfer loads a module's .so from its AOT folder without running ninja: ship only those.
AOT=/tmp/site/flashinfer/data/aot
if [[ -f .carry/fi_aot/fi_aot.tar.gz ]]; then
  mkdir -p $AOT && tar -xzf .carry/fi_aot/fi_aot.tar.gz -C $AOT && echo "flashinfer kernels restored: $(ls $AOT | wc -l)"
fi
