#!/usr/bin/env bash
# The main job on the CPU default: install, then answer a few prompts with the bundled SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python examples/offline_chat.py "$@"
