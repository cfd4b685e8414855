#!/usr/bin/env bash
# Install everything (CPU), check lint and format, then run the test suite.
# Three pytest workers, each taking whole test files (a module's shared daemons stay in one process): while one
# waits on a daemon or a subprocess, the others compute (on 2 cores three were faster than two or four; the 1,179
# tests take ~16 min there).
# `bash scripts/test.sh -n 0` runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
# One OpenMP thread per process unless told otherwise: with several workers and their daemons on a few cores, a
# forward's threads mostly wait for each other (a test's prompt-size daemons: 200 s with two, 125 s with one).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
bash scripts/install.sh
python -m ruff check .
python -m ruff format --check .
# Bytecode is written once and reused by the suite's several hundred Python processes (daemons, CLI runs, the
# interpreter runs; pytest's rewritten test modules too: collecting every file took a worker 28-30 s of CPU without,
# 23-24 s with), whatever the environment says. LangSmith's pytest plugin is not used here and took ~2 s of each
# pytest process's start.
unset PYTHONDONTWRITEBYTECODE
python -m pytest -q -p no:cacheprovider -p no:langsmith_plugin -n 3 --dist loadfile tests "$@"
