#!/usr/bin/env bash
# Install everything (CPU), check lint and format, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python -m ruff check .
python -m ruff format --check .
python -m pytest -q -p no:cacheprovider tests "$@"
