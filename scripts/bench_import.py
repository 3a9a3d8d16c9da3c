"""Cost of `import mtp_overlay` in a fresh interpreter, against a bare interpreter (issue #2).

Prints the median extra wall time over N fresh interpreters, the overlay's own cumulative import time
from `-X importtime`, and the heavy modules it pulled in (goal: <= 15 ms, none).
"""

import statistics
import subprocess
import sys
import time

from mtp_overlay.testing import HEAVY_IMPORTS as HEAVY


def run(code, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(repeats=30):
    bare, overlay = [], []
    for _ in range(repeats):  # interleaved, so drift in machine load hits both sides alike
        bare.append(run("pass", 1))
        overlay.append(run("import mtp_overlay", 1))
    trace = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import mtp_overlay"], capture_output=True, text=True, check=True
    ).stderr
    own = max(int(line.split("|")[1]) for line in trace.splitlines() if line.rstrip().endswith(" mtp_overlay"))
    pulled = subprocess.run(
        [sys.executable, "-c", "import sys; before = set(sys.modules); import mtp_overlay; "
         f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r}))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    extra = statistics.median(overlay) - statistics.median(bare)
    print(f"import mtp_overlay: cumulative import time {own / 1000:.1f} ms (-X importtime), "
          f"wall {extra * 1000:+.1f} ms over a bare interpreter "
          f"(ratio {statistics.median(overlay) / statistics.median(bare):.3f}, median of {repeats})")
    print(f"heavy modules pulled in: {pulled}")


if __name__ == "__main__":
    main()
