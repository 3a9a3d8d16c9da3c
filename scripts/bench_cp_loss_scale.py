"""Cost of mtp-cp-loss-scale on Megatron's own training step, against stock, in one process.

Two gloo ranks at CP=2 run the test bed's Megatron step (get_forward_backward_func -> DDP ->
finalize_model_grads, no optimizer update) on the tiny GPT with one MTP layer, alternating every
repetition between the fix installed and uninstalled (stock), so machine drift hits both sides
alike. Prints, per loss mode, the median step time of each side and their ratio (goal <= 1.01),
and the all-reduces one step issues on each side (the fix adds one of two scalars per MTP depth
per microbatch). Usage: PYTHONPATH=$PWD python scripts/bench_cp_loss_scale.py [repeats]
"""

import collections
import statistics
import sys

from mtp_overlay.testing.launcher import run_ranks_checked

FIX = "mtp-cp-loss-scale"
MODES = {"2-output": (False, "2-output"), "3-output, per-token": (True, "3-output")}


def interleaved_steps(repeats):
    import time

    import torch

    import mtp_overlay
    from mtp_overlay.testing.megatron_step import MegatronStep
    from mtp_overlay.testing.tiny_gpt import build_tiny_gpt, make_batch

    batch = make_batch(batch_size=4, seq_length=64)
    batch["loss_mask"][:, :24] = 0
    report = {}
    for name, (per_token, loss) in MODES.items():
        step = MegatronStep(build_tiny_gpt(mtp_detach_heads=True, calculate_per_token_loss=per_token), optimizer=None)
        times = {"stock": [], "fixed": []}
        for index in range(2 * repeats + 4):
            side = "fixed" if index % 2 else "stock"
            mtp_overlay.uninstall(only=[FIX])
            if side == "fixed":
                mtp_overlay.install(only=[FIX])
            torch.distributed.barrier()
            start = time.perf_counter()
            step.step([batch], loss=loss, update=False)
            if index >= 4:  # warm-up steps are not counted
                times[side].append(time.perf_counter() - start)
        report[name] = {side: statistics.median(values) for side, values in times.items()}
        report[name]["all_reduce"] = {side: all_reduces(step, batch, loss, side == "fixed") for side in ("stock", "fixed")}
    mtp_overlay.uninstall(only=[FIX])
    return report


def all_reduces(step, batch, loss, fixed):
    """Element counts of the all-reduces one step issues (torch.distributed.all_reduce, counted)."""
    import torch

    import mtp_overlay

    mtp_overlay.uninstall(only=[FIX])
    if fixed:
        mtp_overlay.install(only=[FIX])
    calls, original = [], torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        step.step([batch], loss=loss, update=False)
    finally:
        torch.distributed.all_reduce = original
    return calls


def main(repeats=100):
    report = run_ranks_checked(interleaved_steps, 2, cp=2, args=(repeats,), fixes=[])[0]
    for name, result in report.items():
        stock, fixed = result["stock"], result["fixed"]
        calls = result["all_reduce"]
        extra = collections.Counter(calls["fixed"]) - collections.Counter(calls["stock"])
        print(f"CP2 Megatron step, {name:20s}: stock {stock * 1e3:.2f} ms, fixed {fixed * 1e3:.2f} ms, "
              f"ratio {fixed / stock:.3f} (median of {repeats} interleaved); all-reduces per step: "
              f"stock {len(calls['stock'])}, fixed {len(calls['fixed'])}, extra: "
              + ", ".join(f"{count} of {numel} elements" for numel, count in sorted(extra.items())))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
