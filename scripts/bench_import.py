"""Cost of `import mtp_overlay` in a fresh interpreter, side by side with a bare interpreter start-up.

The startup hook runs this import in every Ray worker, vLLM process and torchrun rank. Prints the
overlay's own cumulative import time from `-X importtime` (best of N, bytecode written first), the
wall time of `python -c "import mtp_overlay"` against `python -c pass` (interleaved, medians) and
their ratio, and the heavy modules the import pulled in. Goal: <= 3 ms cumulative, no heavy module.
Usage: python scripts/bench_import.py [REPEATS]
"""

import os
import statistics
import subprocess
import sys
import time

from mtp_overlay.contract import HEAVY_IMPORTS as HEAVY

ENV = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}  # bytecode is written


def wall(code):
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV)
    return time.perf_counter() - start


def cumulative_ms():
    trace = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import mtp_overlay"], capture_output=True, text=True, check=True,
        env=ENV,
    ).stderr
    return max(int(line.split("|")[1]) for line in trace.splitlines() if line.rstrip().endswith(" mtp_overlay")) / 1000


def main(repeats=30):
    subprocess.run([sys.executable, "-c", "import mtp_overlay"], check=True, env=ENV)  # bytecode written
    bare, overlay = [], []
    for _ in range(repeats):  # interleaved, so drift in machine load hits both sides alike
        bare.append(wall("pass"))
        overlay.append(wall("import mtp_overlay"))
    own = [cumulative_ms() for _ in range(max(5, repeats // 3))]
    pulled = subprocess.run(
        [sys.executable, "-c", "import sys; before = set(sys.modules); import mtp_overlay; "
         f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r}))"],
        capture_output=True, text=True, check=True, env=ENV,
    ).stdout.strip()
    bare_ms, overlay_ms = statistics.median(bare) * 1000, statistics.median(overlay) * 1000
    print(f"import mtp_overlay: cumulative import time {min(own):.2f} ms best of {len(own)} "
          f"(median {statistics.median(own):.2f} ms; -X importtime)")
    print(f"start-up wall time: bare `python -c pass` {bare_ms:.1f} ms, with `import mtp_overlay` {overlay_ms:.1f} ms: "
          f"ratio {overlay_ms / bare_ms:.3f} (+{overlay_ms - bare_ms:.1f} ms, medians of {repeats} interleaved)")
    print(f"heavy modules pulled in: {pulled}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
