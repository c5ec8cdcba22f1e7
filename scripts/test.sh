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
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
