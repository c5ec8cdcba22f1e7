#!/usr/bin/env bash
# trahiv's test command: set up from nothing, lint, type-check, then run the tests (real peers on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check trahiv tests benchmarks
.venv/bin/ruff format --check trahiv tests benchmarks
.venv/bin/codespell trahiv tests benchmarks README.md docs/history.md
# mypy runs beside pytest and gates the command as well: from a clean checkout (no cache) it takes ~80 s of one core,
# which before pytest added those 80 s to the command
mypy_log=$(mktemp)
.venv/bin/mypy > "$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
# two workers, one test file each at a time (tests/conftest.py orders the slowest files first): pytest took 19 min
# this way against 25-30 min serially on 2 cores (serially, peers mostly wait on rounds and timers)
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 tests "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
echo "mypy:"
cat "$mypy_log"
if [ "$mypy_status" -ne 0 ]; then
  exit "$mypy_status"
fi
exit "$status"
