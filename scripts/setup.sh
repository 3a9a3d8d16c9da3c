#!/usr/bin/env bash
# Create or refresh .venv (Python 3.12) with the pinned upstream stack and mtp-overlay in editable mode.
# Idempotent: does nothing when the venv's stamp matches scripts/constraints.txt and pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp_want=$(cat scripts/constraints.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.mtp-overlay-stamp" 2>/dev/null)" = "$stamp_want" ]; then
  exit 0
fi
find_python() {
  for candidate in "${PYTHON:-}" "$(pyenv prefix 3.12 2>/dev/null | head -1)/bin/python3.12" python3.12; do
    [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$candidate"; return; }
  done
  for prefix in "$HOME"/.pyenv/versions/3.12*; do
    [ -x "$prefix/bin/python3.12" ] && { echo "$prefix/bin/python3.12"; return; }
  done
  echo "setup.sh: no Python 3.12 found (set PYTHON=/path/to/python3.12)" >&2; exit 2
}
python=$(find_python)
echo "setup.sh: building $venv with $python (a few minutes the first time)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, alone: its index build is what the rest of the stack pins against
"$venv/bin/python" -m pip install -q -c scripts/constraints.txt torch
"$venv/bin/python" -m pip install -q -c scripts/constraints.txt \
  megatron-core vllm transformers ray wrapt packaging pytest hypothesis
# megatron-bridge 0.6.x pairs with megatron-core 0.19, but its metadata pins transformers<=5.12.1 and
# flashinfer-python 0.6.8 (vLLM's pins win): --no-deps, plus what `import megatron.bridge` needs
# (omegaconf 2.3 and its antlr4 runtime, the versions Bridge's hydra-core<1.4 pin resolves to)
"$venv/bin/python" -m pip install -q --no-deps -c scripts/constraints.txt \
  megatron-bridge omegaconf antlr4-python3-runtime
# compat mode: a plain path entry, no import-time finder (cheaper interpreter start-up); its build
# prints setuptools deprecation banners, kept in a log unless the install fails
"$venv/bin/python" -m pip install -q --no-deps --config-settings editable_mode=compat -e . >"$venv/.editable.log" 2>&1 \
  || { cat "$venv/.editable.log" >&2; exit 1; }
echo "$stamp_want" > "$venv/.mtp-overlay-stamp"
