"""Cost of the installed overlay on the tiny MTP training step, against stock, in one process: time and host reads.

One gloo rank (TP1) and two (TP2 + sequence parallel) run forward+backward of the test bed's tiny
GPT with one MTP layer, alternating every repetition between the overlay installed (every fix's
wrappers on megatron-core) and uninstalled (stock), so machine drift hits both sides alike. After
each switch one step runs untimed: a process installs the overlay once, so what a switch costs
(CPython re-specialising the code whose classes and globals it patched) is not the overlay's.
Prints the median step time of each side and their ratio (goal <= 1.01), and the host reads (device
syncs on a GPU) of one step of each side by who made them (`mtp_overlay.testing.syncs`; the step's
own logging, ``mtp_overlay.mtp.mtp_metrics``, reads the logged numbers on both sides): the
installed overlay must add none in the default mode; ``--checks full`` shows what
``MTP_OVERLAY_CHECKS=full`` adds.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_overhead.py [repeats] [--checks full]
"""

import argparse
import statistics

from mtp_overlay.testing.launcher import run_ranks_checked


def interleaved_steps(repeats, checks=None):
    import time

    from megatron.core import parallel_state

    import mtp_overlay
    from mtp_overlay.testing.syncs import SyncCounter, checks_mode
    from mtp_overlay.testing.tiny_gpt import build_tiny_gpt, make_batch, train_step

    model = build_tiny_gpt(sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1)
    batch = make_batch(batch_size=4, seq_length=64)
    times = {"stock": [], "overlay": []}
    reads = {}
    with checks_mode(checks):
        for index in range(2 * repeats + 4):
            side = "overlay" if index % 2 else "stock"
            mtp_overlay.uninstall()
            if side == "overlay":
                mtp_overlay.install()
            train_step(model, batch)  # untimed: a switch's own cost (the interpreter re-specialising the patched code)
            start = time.perf_counter()
            train_step(model, batch)
            if index >= 4:  # warm-up steps are not counted
                times[side].append(time.perf_counter() - start)
        for side in ("stock", "overlay"):  # one more step each, its host reads counted
            mtp_overlay.uninstall()
            if side == "overlay":
                mtp_overlay.install()
            with SyncCounter() as counted:
                train_step(model, batch)
            sites = sorted({f"{event.file.rsplit('/', 2)[-2]}/{event.file.rsplit('/', 1)[-1]}:{event.function}"
                            for event in counted.of("overlay")})
            reads[side] = (counted.by_origin(), sites)
    mtp_overlay.install()
    return {side: statistics.median(values) for side, values in times.items()}, reads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repeats", nargs="?", type=int, default=150)
    parser.add_argument("--checks", choices=("default", "full"), default=None,
                        help="MTP_OVERLAY_CHECKS for the ranks (default: the caller's)")
    args = parser.parse_args()
    for label, world, tp in (("TP1", 1, 1), ("TP2+SP", 2, 2)):
        medians, reads = run_ranks_checked(interleaved_steps, world, tp=tp, args=(args.repeats, args.checks),
                                           fixes=None)[0]
        print(f"{label:7s} tiny GPT+MTP fwd+bwd: stock {medians['stock'] * 1e3:.2f} ms, "
              f"overlay {medians['overlay'] * 1e3:.2f} ms, ratio {medians['overlay'] / medians['stock']:.3f} "
              f"(median of {args.repeats} interleaved)")
        for side in ("stock", "overlay"):
            counts, sites = reads[side]
            listed = ", ".join(f"{origin} {count}" for origin, count in counts.items())
            print(f"        host reads of one {side} step (device syncs on a GPU), rank 0: {listed}"
                  + (f" (overlay: {', '.join(sites)})" if sites else ""))
        added = reads["overlay"][0]["overlay"] - reads["stock"][0]["overlay"]
        print(f"        added by the installed overlay: {added} host read(s) per step")


if __name__ == "__main__":
    main()
