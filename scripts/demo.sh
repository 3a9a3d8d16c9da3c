#!/usr/bin/env bash
# The main job on its embedded default: sets up .venv when missing or stale, then runs the demo
# (tiny stock-megatron-core GPT + MTP on 2 gloo ranks, each fix off and on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHONWARNINGS=ignore exec .venv/bin/mtp-overlay demo "$@"
