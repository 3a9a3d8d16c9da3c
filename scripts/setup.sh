#!/usr/bin/env bash
# Create or refresh .venv (Python 3.12) with the pinned upstream stack and mtp-overlay in editable mode.
# Idempotent: does nothing when the venv's stamp matches scripts/constraints.txt and pyproject.toml.
# Says what it does on stderr, one line per step with its time; each installer's own output goes to
# .venv/.setup.log, shown when a step fails.
# The installer is uv (pinned in scripts/constraints.txt, put into the venv by pip) with
# --compile-bytecode, so the venv holds what pip's would, bytecode included. Measured on this 2-core
# machine, fresh venv and empty caches: 99 s against pip's 197 s when calm (as CI runs), 131 s
# against 199 s under a load of ~5, 471 s against 515 s under 25-40 (both then wait for the same
# CPU: ~150 s each); a fresh venv from uv's warm cache 9 s against pip's 445 s. pip installs the
# stack when uv cannot be had, or with MTP_OVERLAY_INSTALLER=pip. Either way the pins are
# scripts/constraints.txt alone (uv reads neither pip.conf nor pip's constraint files; its index is
# PyPI unless UV_INDEX_URL or a uv.toml says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
pins=scripts/constraints.txt
stamp_want=$(cat "$pins" pyproject.toml | sha256sum | cut -d' ' -f1)
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
pin() {  # the pinned version of distribution $1
  grep -i "^$1==" "$pins" | cut -d= -f3
}
python=$(find_python)
installer=${MTP_OVERLAY_INSTALLER:-uv}
case $installer in
  uv | pip) ;;
  *) echo "setup.sh: MTP_OVERLAY_INSTALLER must be uv or pip, got '$installer'" >&2; exit 2 ;;
esac
log=$venv/.setup.log
steps=6 step=0 began=$SECONDS
# attempt WHAT COMMAND...: "setup.sh: [i/n] WHAT ... 12 s" on stderr, the command's output in the log;
# its status is the command's
attempt() {
  local what=$1 started=$SECONDS
  shift
  step=$((step + 1))
  printf 'setup.sh: [%d/%d] %s ...' "$step" "$steps" "$what" >&2
  if ! "$@" >>"$log" 2>&1; then
    printf ' failed after %d s\n' $((SECONDS - started)) >&2
    return 1
  fi
  printf ' %d s\n' $((SECONDS - started)) >&2
}
# step WHAT COMMAND...: an attempt that must succeed; when it fails, the log's end is shown
step() {
  attempt "$@" || { echo "setup.sh: the log ($log) ends:" >&2; tail -n 40 "$log" >&2; exit 1; }
}
install() {  # install ARGS...: into the venv, against the pins
  case $installer in
    uv) "$venv/bin/uv" pip install --python "$venv/bin/python" --compile-bytecode -c "$pins" "$@" ;;
    *) "$venv/bin/python" -m pip install -c "$pins" "$@" ;;
  esac
}
echo "setup.sh: building $venv with $python, installing with $installer (10 GB the first time)" >&2
mkdir -p "$venv"
: >"$log"
step "virtual environment (Python $("$python" -c 'import platform; print(platform.python_version())'))" \
  bash -c "[ -x '$venv/bin/python' ] || '$python' -m venv '$venv'"
if ! attempt "pip's latest and uv $(pin uv), the installers" "$venv/bin/python" -m pip install -c "$pins" --upgrade pip uv; then
  echo "setup.sh: uv cannot be installed (see $log): pip installs the stack instead, about twice as slow" >&2
  installer=pip
fi
# torch first, alone: its index build is what the rest of the stack pins against
step "torch $(pin torch) (CUDA build, runs on CPU; ~5 GB with its CUDA libraries)" install torch
step "megatron-core $(pin megatron-core), vLLM $(pin vllm), transformers $(pin transformers), Ray $(pin ray), pytest, mypy" \
  install megatron-core vllm transformers ray wrapt packaging pytest hypothesis mypy
# megatron-bridge 0.6.x pairs with megatron-core 0.19, but its metadata pins transformers<=5.12.1 and
# flashinfer-python 0.6.8 (vLLM's pins win): --no-deps, plus what `import megatron.bridge` needs
# (omegaconf 2.3 and its antlr4 runtime, the versions Bridge's hydra-core<1.4 pin resolves to)
step "megatron-bridge $(pin megatron-bridge) (without its dependencies: vLLM's pins win)" \
  install --no-deps megatron-bridge omegaconf antlr4-python3-runtime
# compat mode: a plain path entry, no import-time finder (cheaper interpreter start-up); its build
# prints setuptools deprecation banners, kept in the log
step "mtp-overlay (editable)" install --no-deps --config-settings editable_mode=compat -e .
echo "$stamp_want" > "$venv/.mtp-overlay-stamp"
echo "setup.sh: $venv ready in $((SECONDS - began)) s" >&2
