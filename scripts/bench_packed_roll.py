"""Benchmark: mtp-packed-roll's vectorised roll vs megatron-core's per-sequence packed roll.

One pack of 512 sequences, ~256k tokens, rolled on gloo ranks at CP=1 and CP=4, stock and fixed
side by side in one run (interleaved repetitions, medians; a roll costs what its slowest rank costs).
For stock to be right, and so comparable, the pack passes its padded boundaries as cu_seqlens_q
too (NeMo-RL's default path); the outputs are checked identical. Stock does one Python iteration
and, under CP, one send/recv exchange per sequence; the fix one roll and one all-gather. Also shown:
the fix on the real (unpadded) boundaries. The fix works out where every slot goes at each roll, on
the device, from the boundaries given (no plan cache, no host read): what is timed is all it does.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_packed_roll.py [--repeats 7]
"""

import argparse
import statistics

SEQUENCES, TOKENS = 512, 256 * 1024


def pack(cp_size, seed=0):
    """(real lengths, padded lengths): 512 sequences, ~256k tokens, padded to a multiple of 2*cp."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(SEQUENCES, generator=generator) + 0.25
    real = (weights / weights.sum() * TOKENS).long().clamp(min=1)
    multiple = 2 * cp_size if cp_size > 1 else 1
    padded = (real + multiple - 1) // multiple * multiple
    return real.tolist(), padded.tolist()


def time_rolls(repeats):
    """Rank worker: per-roll seconds of stock and the fix (each a list over repeats), and whether
    their outputs agree."""
    import inspect
    import time

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    from mtp_overlay.fixes.mtp_packed_roll import roll_packed_seq_params
    from mtp_overlay.bed.oracles.packed_reference import cp_local, packed_params

    group = parallel_state.get_context_parallel_group()
    size, rank = group.size(), group.rank()
    cp_group = group if size > 1 else None
    real, padded = pack(size)
    row = torch.randint(1, 50000, (1, sum(padded)), generator=torch.Generator().manual_seed(1))
    local = cp_local(row, padded, size, rank)
    on_padded = packed_params(padded, padded)  # what stock needs to be right
    on_real = packed_params(real, padded)
    stock_roll = inspect.unwrap(mtp._roll_tensor_packed_seq)

    def timed(function):
        dist.barrier(group=group)
        start = time.perf_counter()
        result = function()
        dist.barrier(group=group)
        return time.perf_counter() - start, result

    timed(lambda: roll_packed_seq_params(local, on_padded, cp_group))  # warm-up: the first collective's set-up
    times = {"stock": [], "fixed": [], "fixed, real boundaries": []}
    same = True
    for _ in range(repeats):
        seconds, (stock, _) = timed(lambda: stock_roll(local, -1, -1, on_padded, cp_group))
        times["stock"].append(seconds)
        seconds, fixed = timed(lambda: roll_packed_seq_params(local, on_padded, cp_group))
        times["fixed"].append(seconds)
        same &= torch.equal(stock, fixed)
        seconds, _ = timed(lambda: roll_packed_seq_params(local, on_real, cp_group))
        times["fixed, real boundaries"].append(seconds)
    return {"times": times, "same": same, "tokens": sum(padded), "local": local.shape[-1]}


def main():
    from mtp_overlay.bed.runtime.launcher import run_ranks_checked

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for cp_size in (1, 4):
        ranks = run_ranks_checked(time_rolls, cp_size, cp=cp_size, args=(args.repeats,),
                                  fixes=["mtp-packed-roll"], timeout=1800)
        first = ranks[0]
        median = {key: max(statistics.median(r["times"][key]) for r in ranks) for key in first["times"]}
        print(f"CP={cp_size}: {SEQUENCES} sequences, {first['tokens']} tokens ({first['local']} per rank), "
              f"outputs identical: {all(r['same'] for r in ranks)}")
        print(f"  stock per-sequence roll : {median['stock'] * 1e3:9.2f} ms")
        print(f"  fixed vectorised roll   : {median['fixed'] * 1e3:9.2f} ms   ratio {median['stock'] / median['fixed']:.1f}x")
        print(f"  fixed, real boundaries  : {median['fixed, real boundaries'] * 1e3:9.2f} ms   "
              f"ratio {median['stock'] / median['fixed, real boundaries']:.1f}x")


if __name__ == "__main__":
    main()
