#!/usr/bin/env bash
# trahiv's test command: set up from nothing, lint, type-check, then run the tests (real peers on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check trahiv tests benchmarks
.venv/bin/ruff format --check trahiv tests benchmarks
.venv/bin/mypy
.venv/bin/codespell trahiv tests benchmarks README.md
# two workers, one test file each at a time (tests/conftest.py orders the slowest files first): pytest took 19 min
# this way against 25-30 min serially on 2 cores (serially, peers mostly wait on rounds and timers)
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests "$@"
