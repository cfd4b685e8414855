#!/usr/bin/env bash
# Install everything (CPU), then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m pytest -q -p no:cacheprovider tests "$@"
