#!/usr/bin/env bash
# The main job on the CPU default: install, then answer a few prompts with the bundled SmolLM2.
# The answers come from the model's daemon, started by the first run and reused by the next ones (it stops after
# 5 idle minutes), so a re-run answers at once; the GGUF's conversion is cached under ~/.cache/minisgl/models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python examples/chat.py "$@"
