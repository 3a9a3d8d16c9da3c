#!/usr/bin/env bash
# The whole test suite: sets up .venv when missing or stale, then runs pytest (extra args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
