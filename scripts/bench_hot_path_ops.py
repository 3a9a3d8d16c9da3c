"""Aten ops (a kernel launch each on a GPU) of Megatron's step with every fix installed against stock, and the
packed step's wall time, in one process per layout.

Megatron's own training step (`mtp_overlay.bed.engines.hot_path.step_reads`: DDP, the schedule; RL forward,
the MTP mask scoped for the overlay and given as ``loss_mask`` to stock) on the tiny GPTModel with 2 MTP
layers: one forward+backward on a packed THD row of 4 sequences (the overlay: NeMo-RL's real-lengths
flavour; stock: the padded one, which it can train) and on full-length BSHD rows, at TP1 and CP2.
`mtp_overlay.bed.runtime.syncs.SyncCounter` counts every aten op; printed: each side's total, the
difference, the device asserts, the ops the overlay's own code added, by the fix (or ``mtp/``
file) that issued them, and the change by origin (megatron's: the stock roll the fix replaces) (goal: THD overlay <= stock with <= 4 ``_assert_async``; BSHD +<= 10). Then the
THD step's wall time at TP1, overlay and stock alternating every repetition, medians and their ratio.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_hot_path_ops.py [REPEATS]
"""

import argparse
import collections
import os

import mtp_overlay
from mtp_overlay.bed.engines.hot_path import step_reads, step_times
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.engines.parity import PARALLELISMS

MODEL, DEPTHS = "gpt", dict(mtp_num_layers=2)
ASSERT = "aten::_assert_async.msg"
PACKAGE = os.path.dirname(os.path.abspath(mtp_overlay.__file__)) + os.sep


def issuer(path):
    """The fix folder (``fixes/<fix>``) or the ``mtp/`` file of an overlay source file."""
    parts = os.path.relpath(path, PACKAGE).split(os.sep)
    return parts[1] if parts[0] == "fixes" else "/".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repeats", nargs="?", type=int, default=60)
    args = parser.parse_args()
    print(f"tiny GPTModel, {DEPTHS['mtp_num_layers']} MTP layers, Megatron's step, one forward+backward, rank 0")
    for layout in ("TP1", "CP2"):
        spec = PARALLELISMS[layout]
        out = run_ranks_checked(step_reads, spec["world_size"], tp=spec["tp"], cp=spec["cp"], fixes=None,
                                args=(MODEL, False, spec["pad_multiple"]), kwargs=DEPTHS, timeout=600)[0]
        for row, (overlay, stock) in (("THD", ("warm", "stock")), ("BSHD", ("bshd", "stock bshd"))):
            ops = {side: out[step][3] for side, step in (("overlay", overlay), ("stock", stock))}
            totals = {side: sum(found["ops"].values()) for side, found in ops.items()}
            asserts = ops["overlay"]["ops"].get(ASSERT, 0)
            print(f"{layout} {row:4s}: aten ops stock {totals['stock']}, overlay {totals['overlay']} "
                  f"({totals['overlay'] - totals['stock']:+d}), _assert_async {asserts}")
            by = collections.Counter()  # the overlay's files, less what they issue on stock's side too (the CP slicing)
            for side, sign in (("overlay", 1), ("stock", -1)):
                for (origin, path), calls in ops[side]["files"].items():
                    if origin == "overlay":
                        by[issuer(path)] += sign * calls
            print("           added by the overlay's code: " + (", ".join(f"{name} {calls:+d}" for name, calls in
                                                                          by.most_common() if calls) or "none"))
            delta = collections.Counter()
            for (origin, _), calls in ops["overlay"]["by origin"].items():
                delta[origin] += calls
            for (origin, _), calls in ops["stock"]["by origin"].items():
                delta[origin] -= calls
            print("           change by origin: " + ", ".join(f"{origin} {calls:+d}" for origin, calls in delta.items()))
    medians = run_ranks_checked(step_times, 1, fixes=None, args=(MODEL, PARALLELISMS["TP1"]["pad_multiple"], args.repeats),
                                kwargs=DEPTHS, timeout=3600)[0]
    print(f"TP1 THD step wall time: stock {medians['stock'] * 1e3:.2f} ms, overlay {medians['overlay'] * 1e3:.2f} ms, "
          f"ratio {medians['overlay'] / medians['stock']:.3f} (medians of {args.repeats} interleaved)")


if __name__ == "__main__":
    main()
