#!/usr/bin/env bash
# trahiv's main job on this machine: a local swarm (bootstrap peer + 2 trainers on 127.0.0.1) fine-tunes a small GPT-2.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/trahiv demo "$@"
