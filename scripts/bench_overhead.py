"""Cost of the installed overlay on the tiny MTP training step, against stock, in one process.

One gloo rank (TP1) and two (TP2 + sequence parallel) run forward+backward of the test bed's tiny
GPT with one MTP layer, alternating every repetition between the overlay installed (every fix's
wrappers on megatron-core) and uninstalled (stock), so machine drift hits both sides alike.
Prints the median step time of each side and their ratio (goal <= 1.01).
"""

import statistics
import sys

from mtp_overlay.testing.launcher import run_ranks_checked


def interleaved_steps(repeats):
    import time

    from megatron.core import parallel_state

    import mtp_overlay
    from mtp_overlay.testing.tiny_gpt import build_tiny_gpt, make_batch, train_step

    model = build_tiny_gpt(sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1)
    batch = make_batch(batch_size=4, seq_length=64)
    times = {"stock": [], "overlay": []}
    for index in range(2 * repeats + 4):
        side = "overlay" if index % 2 else "stock"
        mtp_overlay.uninstall()
        if side == "overlay":
            mtp_overlay.install()
        start = time.perf_counter()
        train_step(model, batch)
        if index >= 4:  # warm-up steps are not counted
            times[side].append(time.perf_counter() - start)
    mtp_overlay.install()
    return {side: statistics.median(values) for side, values in times.items()}


def main(repeats=150):
    for label, world, tp in (("TP1", 1, 1), ("TP2+SP", 2, 2)):
        medians = run_ranks_checked(interleaved_steps, world, tp=tp, args=(repeats,), fixes=None)[0]
        print(f"{label:7s} tiny GPT+MTP fwd+bwd: stock {medians['stock'] * 1e3:.2f} ms, "
              f"overlay {medians['overlay'] * 1e3:.2f} ms, ratio {medians['overlay'] / medians['stock']:.3f} "
              f"(median of {repeats} interleaved)")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
