#!/usr/bin/env bash
# One prepared GPU run: what only a GPU shows, in one table at the end.
#
#   scripts/gpu_check.sh --fetch-wheels   here (package index reachable): the wheels into .whl/
#   scripts/gpu_check.sh                  on the GPU machine (its own torch, no network; .whl/ carried)
#   scripts/gpu_check.sh --cpu            the rows that run on CPU, small sizes, in .venv (the suite runs it)
#
# Rows: the GPU-marked tests; `mtp-overlay demo` and `mtp-overlay verify --hf-config
# tests/verification/configs/nemotron_h_like` on this host (their ranks run on CPU with CUDA hidden,
# the host's CUDA in use by the caller); the hot path (mtp_overlay/bed/engines/gpu_check.py): a 655M and a
# 22M-parameter GPTModel in bf16 through Float16Module (on CPU: a tiny one in fp32), BSHD, THD padded
# and THD real-lengths, stock and with every fix: MTP loss per depth, syncs per step (aten-level counter,
# and CUDA's own detector), aten ops, step time (interleaved, median), the refit fingerprint's speed; and
# scripts/bench_fingerprint.py (64 tensors of 4 MiB).
# megatron-core, Megatron-Bridge, wrapt, pytest and hypothesis travel as wheels (a few MB); vLLM and
# Transformer Engine do not (too large), so vLLM's GPU tests are not collected there and THD attention
# is the test bed's stand-in. Budget: 6 minutes on one H200, wheel install included. The table goes to
# stdout and, where $OUT is set (the device tool), to $OUT/gpu_check.txt. Exit 1 when a row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=.whl
# the carried distributions, at the pins of scripts/constraints.txt
carried=(megatron-core megatron-bridge wrapt omegaconf antlr4-python3-runtime pyyaml einops pytest pluggy iniconfig pygments
         hypothesis sortedcontainers attrs)
pin() { grep -i "^$1==" scripts/constraints.txt | head -1; }

mode=gpu
case "${1:-}" in
  "") ;;
  --cpu) mode=cpu ;;
  --fetch-wheels)
    mkdir -p "$wheels"
    fetch() {
      if [ "$name" = antlr4-python3-runtime ]; then  # an sdist only: built here into a pure-Python wheel
        "${PYTHON:-python3}" -m pip wheel --quiet --no-deps -w "$wheels" "$1" 2>/dev/null
      else
        "${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
          --platform manylinux_2_28_x86_64 -d "$wheels" "$1" 2>/dev/null
      fi
    }
    for name in "${carried[@]}"; do
      # the pin, else the newest this index serves (the test tools' pins can be newer than pip's index)
      fetch "$(pin "$name")" || fetch "$name" || { echo "gpu_check.sh: could not fetch $name" >&2; exit 2; }
    done
    du -sh "$wheels" >&2
    exit 0 ;;
  *) echo "usage: scripts/gpu_check.sh [--cpu | --fetch-wheels]" >&2; exit 2 ;;
esac

log=$(mktemp -p "${OUT:-${TMPDIR:-/tmp}}" mtp-overlay-gpu-check-XXXXXX.log)  # under $OUT: back even on a timeout
rows=()
failed=0
# row NAME COMMAND...: runs it (its output appended to the log), records "NAME ok|FAILED N s LAST-LINE"
row() {
  local name=$1 began=$SECONDS status out
  shift
  echo "gpu_check.sh: $name ..." >&2
  out=$(mktemp)
  "$@" >"$out" 2>&1
  status=$?
  { echo "===== $name ($*): exit $status"; cat "$out"; } >>"$log"
  [ $status -eq 0 ] || failed=1
  rows+=("$(printf '%-24s %-6s %4d s  %s' "$name" "$([ $status -eq 0 ] && echo ok || echo FAILED)" \
            $((SECONDS - began)) "$(grep -v '^[[:space:]]*$' "$out" | tail -1 | cut -c1-150)")")
  rm -f "$out"
}

if [ "$mode" = cpu ]; then
  bash scripts/setup.sh || exit 1
  python=.venv/bin/python
  engine=(--device cpu)
else
  python=${PYTHON:-python3}
  ls "$wheels"/*.whl >/dev/null 2>&1 || { echo "gpu_check.sh: no wheels in $wheels (run --fetch-wheels here first, carry $wheels)" >&2; exit 2; }
  site=${TMPDIR:-/tmp}/mtp-overlay-gpu-site  # beside the machine's torch (its python's own venv): no venv of ours
  began=$SECONDS
  echo "gpu_check.sh: the carried wheels into $site, for $python ..." >&2
  "$python" -m pip install --quiet --no-index --no-deps --upgrade --target "$site" "$wheels"/*.whl >>"$log" 2>&1 ||
    { tail -20 "$log" >&2; exit 1; }
  rows+=("$(printf '%-24s %-6s %4d s  %s' wheels ok $((SECONDS - began)) "$(ls "$wheels" | wc -l) carried into $site")")
  export PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH}
  engine=(--device cuda)
fi
export PYTHONWARNINGS=ignore

"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))' >>"$log" 2>&1
machine=$(grep '^torch ' "$log" | tail -1)
if [ "$mode" = gpu ]; then  # on CPU they all skip: the row would only cost the collection
  gpu_tests=$(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
  if ! "$python" -c 'import vllm' 2>/dev/null; then  # vLLM is not carried: its tests cannot run there
    rows+=("$(printf '%-24s %-6s %4s    %s' "vLLM's GPU tests" "-" "" "not run (no vLLM here): $(grep -lE '^ *(from|import) vllm' $gpu_tests | xargs -n1 basename | tr '\n' ' ')")")
    gpu_tests=$(grep -LE '^ *(from|import) vllm' $gpu_tests)
  fi
  row "GPU-marked tests" "$python" -m pytest -m gpu -q -rA -p no:cacheprovider $gpu_tests
fi
row "demo" "$python" -m mtp_overlay.cli demo
row "verify nemotron_h_like" "$python" -m mtp_overlay.cli verify --hf-config tests/verification/configs/nemotron_h_like
if [ "$mode" = cpu ]; then fingerprint_size=(--repeats 5); else fingerprint_size=(); fi
row "fingerprint bench" "$python" scripts/bench_fingerprint.py "${engine[@]}" "${fingerprint_size[@]}"
engine_out=$(mktemp -t mtp-overlay-gpu-check-engine-XXXXXX.txt)
row "hot path" bash -c "'$python' -m mtp_overlay.bed.engines.gpu_check ${engine[*]} > '$engine_out' && tail -1 '$engine_out'"

table=$(
  echo "== scripts/gpu_check.sh ($mode mode) on $(hostname), $(date -u +%Y-%m-%dT%H:%MZ): $machine"
  printf '%s\n' "${rows[@]}"
  cat "$engine_out"
  echo "(every row's whole output: $log)"
)
echo "$table"
[ -n "${OUT:-}" ] && echo "$table" >"$OUT/gpu_check.txt"
exit $failed
