"""Print the host reads (device syncs on a GPU) of Megatron's step on the packed THD path, by who made them.

Per layout (TP1, CP2, TP2+SP) and step (`mtp_overlay.bed.engines.hot_path`): first step, every later
step, full-length rows, ``MTP_OVERLAY_CHECKS=full``, stock; rank 0's reads of the forward+backward
by origin, and where the overlay's were made.

    PYTHONPATH=$PWD .venv/bin/python scripts/hot_path_syncs.py [LAYOUT ...]
"""

import argparse
import collections

from mtp_overlay.bed.engines import hot_path
from mtp_overlay.bed.runtime.syncs import ORIGINS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="*", choices=tuple(hot_path.LAYOUTS),
                        help="the layouts to run (default: all)")
    args = parser.parse_args()
    for layout in args.layouts or hot_path.LAYOUTS:
        ranks = hot_path.run(layout)
        for step in hot_path.STEPS:
            summary = ranks[0][step][0]
            counts = collections.Counter()
            for (origin, _, _), count in summary.items():
                counts[origin] += count
            sites = sorted(f"{count}x {kind} at {place.split('mtp_overlay/', 1)[-1]}"
                           for (origin, kind, place), count in summary.items() if origin == "overlay")
            listed = ", ".join(f"{origin} {counts[origin]}" for origin in ORIGINS)
            print(f"{layout:7s} {step:6s} rank 0: {listed}" + (f" (overlay: {'; '.join(sites)})" if sites else ""))


if __name__ == "__main__":
    main()
