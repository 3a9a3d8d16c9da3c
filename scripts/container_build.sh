#!/usr/bin/env bash
# Container-build example: install the pinned stack, put the fixes' source patches on disk,
# verify them, and fail the build on any error. For images whose processes never `import mtp_overlay`.
#
#   Dockerfile:  COPY . /src/mtp-overlay
#                RUN apt-get update && apt-get install -y git && bash /src/mtp-overlay/scripts/container_build.sh
#
# PYTHON: the interpreter whose site-packages gets the stack and the patches (default: python3).
# Exit status: non-zero when an install fails, a needed patch does not fit the installed release
# (`patch apply` exits 1 and names the file, the expected and the found sha256), or a patch is not on
# disk afterwards (`patch check --fail-on-needed`).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
command -v git >/dev/null || { echo "container_build.sh: mtp-overlay patch needs git (apt-get install -y git)" >&2; exit 1; }

# torch first, alone: its index build is what the rest of the stack pins against
"$python" -m pip install -q -c scripts/constraints.txt torch
"$python" -m pip install -q -c scripts/constraints.txt megatron-core vllm transformers ray wrapt packaging
"$python" -m pip install -q --no-deps .

# the patches and their manifest ship inside the installed package
patch=("$python" -m mtp_overlay.cli patch --python "$python")
"${patch[@]}" apply
"${patch[@]}" check --fail-on-needed
