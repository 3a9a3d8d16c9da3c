"""Cost of mtp-cp-loss-scale on Megatron's own training step, against stock, in one process.

Two gloo ranks at CP=2 run the test bed's Megatron step (get_forward_backward_func -> DDP ->
finalize_model_grads, no optimizer update) on the tiny GPT with one MTP layer, and on a larger one,
alternating every repetition (in ABBA order) between the fix installed and uninstalled (stock), so
machine drift hits both sides alike. Prints, per loss mode, the median step time of each side and
their ratio (goal <= 1.01), and the all-reduces one step issues on each side (the fix adds one of
two scalars per MTP depth per microbatch). Then the same at CP=1, where the fix stands aside: the
noise floor of the measurement. The fix's cost is that all-reduce (gloo on CPU: ~0.3 ms plus the
wait for the other rank), so the ratio shrinks as the step grows.
Usage: PYTHONPATH=$PWD python scripts/bench_cp_loss_scale.py [repeats]  (the larger model: repeats / 5)
"""

import collections
import statistics
import sys

from mtp_overlay.bed.runtime.launcher import run_ranks_checked

FIX = "mtp-cp-loss-scale"
MODES = {"2-output": (False, "2-output"), "3-output, per-token": (True, "3-output")}
SIZES = {  # name -> (build_tiny_gpt overrides, make_batch overrides)
    "tiny (h64, 4x64 tokens)": (dict(), dict(batch_size=4, seq_length=64)),
    "larger (h256, vocab 4096, 8x256 tokens)": (
        dict(hidden_size=256, vocab_size=4096, max_sequence_length=256), dict(batch_size=8, seq_length=256, vocab_size=4096)),
}


def interleaved_steps(repeats, size):
    import time

    import torch

    import mtp_overlay
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch

    model_size, batch_size = SIZES[size]
    batch = make_batch(**batch_size)
    batch["loss_mask"][:, : batch["loss_mask"].shape[1] * 2 // 5] = 0  # a 40% prompt
    report = {}
    for name, (per_token, loss) in MODES.items():
        model = build_tiny_gpt(mtp_detach_heads=True, calculate_per_token_loss=per_token, **model_size)
        step = MegatronStep(model, optimizer=None)
        times = {"stock": [], "fixed": []}
        for index in range(2 * repeats + 4):
            side = "fixed" if index % 4 in (1, 2) else "stock"  # ABBA: neither side always runs second
            mtp_overlay.uninstall(only=[FIX])
            if side == "fixed":
                mtp_overlay.install(only=[FIX])
            torch.distributed.barrier()
            start = time.perf_counter()
            step.step([batch], loss=loss, update=False)
            if index >= 4:  # warm-up steps are not counted
                times[side].append(time.perf_counter() - start)
        report[name] = {side: statistics.median(values) for side, values in times.items()}
        report[name]["paired"] = statistics.median(f / s for s, f in zip(times["stock"], times["fixed"]))  # neighbours
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
    for size, count in zip(SIZES, (repeats, max(10, repeats // 5))):
        print(size)
        for cp in (2, 1):
            report = run_ranks_checked(interleaved_steps, cp, cp=cp, args=(count, size), fixes=[], timeout=3600)[0]
            show(report, count, cp)


def show(report, repeats, cp):
    for name, result in report.items():
        stock, fixed = result["stock"], result["fixed"]
        calls = result["all_reduce"]
        extra = collections.Counter(calls["fixed"]) - collections.Counter(calls["stock"])
        print(f"  CP{cp} Megatron step, {name:20s}: stock {stock * 1e3:.2f} ms, fixed {fixed * 1e3:.2f} ms, "
              f"ratio {fixed / stock:.3f} (medians of {repeats} interleaved; paired {result['paired']:.3f}); all-reduces per step: "
              f"stock {len(calls['stock'])}, fixed {len(calls['fixed'])}, extra: "
              + ", ".join(f"{count} of {numel} elements" for numel, count in sorted(extra.items())))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
