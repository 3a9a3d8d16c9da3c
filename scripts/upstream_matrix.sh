#!/usr/bin/env bash
# Install each supported upstream release side by side (pip --no-deps --target, sharing one torch),
# run every fix's probe and stock-path reproduction on it, and write docs/SUPPORT.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHONWARNINGS=ignore exec .venv/bin/python scripts/support_matrix.py "$@"
