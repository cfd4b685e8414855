# GPU environment for the tools/device scripts; source it from the repository root: `source tools/device/env.sh`.
# - Python packages: if flashinfer is importable, nothing is installed. Otherwise the wheels in WHEELS_DIR
#   (default: .whl/ in the repository root; flashinfer-python 0.5.3 and its dependencies, pyzmq, xgrammar, ...)
#   are installed offline into SITE_DIR (default /tmp/site), which goes first on PYTHONPATH.
# - FLASHINFER_AOT (optional, default ./fi_aot.tar.gz when present): flashinfer kernels built on an earlier run
#   (gpu_check.sh's warm stage writes OUT_DIR/fi_aot.tar.gz); without them the first engine builds its kernels.
# - TOKENIZER_DIR (default ./tok when present): tokenizer.json, tokenizer_config.json and chat_template.jinja for
#   the dummy-weight benchmark models, exported as MINISGL_TOKENIZER_DIR (without TOKENIZER_DIR an exported
#   MINISGL_TOKENIZER_DIR is kept).
# PYTHONPATH gets src/ and integrations/ of this checkout, so no `pip install -e` is needed.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
_pypath=$_root/src:$_root/integrations
if ! python3 -c "import flashinfer" 2>/dev/null; then
  _wheels_dir=${WHEELS_DIR:-$_root/.whl}
  _wheels=$(ls "$_wheels_dir"/*.whl 2>/dev/null)
  if [[ -z $_wheels ]]; then
    echo "flashinfer is not installed and $_wheels_dir has no wheels: pip install -e \".[gpu]\", or set WHEELS_DIR" >&2
    return 1 2>/dev/null || exit 1
  fi
  SITE_DIR=${SITE_DIR:-/tmp/site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_DIR" $_wheels \
    || { return 1 2>/dev/null || exit 1; }
  _pypath=$SITE_DIR:$_pypath
fi
export PYTHONPATH=$_pypath${PYTHONPATH:+:$PYTHONPATH}
# flashinfer loads a module's .so from its AOT folder without running ninja.
_aot=${FLASHINFER_AOT:-fi_aot.tar.gz}
if [[ -f $_aot ]]; then
  _fi=$(python3 -c "import importlib.util as u; print(u.find_spec('flashinfer').submodule_search_locations[0])")
  mkdir -p "$_fi/data/aot" && tar -xzf "$_aot" -C "$_fi/data/aot" && echo "flashinfer kernels restored: $(ls "$_fi/data/aot" | wc -l)"
fi
if [[ -n ${TOKENIZER_DIR:-} ]]; then
  [[ -d $TOKENIZER_DIR ]] || echo "TOKENIZER_DIR=$TOKENIZER_DIR is not a directory" >&2
  export MINISGL_TOKENIZER_DIR=$(cd "$TOKENIZER_DIR" 2>/dev/null && pwd)
elif [[ -z ${MINISGL_TOKENIZER_DIR:-} && -d tok ]]; then
  export MINISGL_TOKENIZER_DIR=$PWD/tok
fi
[[ -n ${MINISGL_TOKENIZER_DIR:-} ]] || echo "no tokenizer files (TOKENIZER_DIR): dummy models get none" >&2
export GPU_ENV_READY=1
unset _root _pypath _wheels_dir _wheels _aot _fi
