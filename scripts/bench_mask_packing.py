"""Benchmark: vectorised THD packing + CP sharding of the MTP loss mask vs a per-sequence loop.

Both run in this process on the same batch (B=512 sequences, ~256k tokens, cp=4) and do what one
CP rank does: pack the mask with per-sequence padding to a multiple of 2*cp, then cut the rank's
shard (rank r keeps chunks r and 2*cp-1-r of each padded sequence). Times are per rank, averaged
over the ranks; packed rows and every rank's shard must be identical. Prints the ratio.

    .venv/bin/python scripts/bench_mask_packing.py [--batch 512] [--seq-len 1024] [--cp 4]
"""

import argparse
import time

import torch

from mtp_overlay import mtp


def loop_pack_and_shard(mask, lengths, cp_size, cp_rank):
    """The per-sequence way: pad each sequence, keep this rank's two chunks, concatenate."""
    multiple = 2 * cp_size
    packed, shard = [], []
    for row, length in zip(mask, lengths.tolist()):
        padded_length = -(-length // multiple) * multiple
        sequence = row.new_zeros(padded_length)
        sequence[:length] = row[:length]
        packed.append(sequence)
        chunk = padded_length // multiple
        shard.append(sequence[cp_rank * chunk : (cp_rank + 1) * chunk])
        shard.append(sequence[(multiple - 1 - cp_rank) * chunk : (multiple - cp_rank) * chunk])
    return torch.cat(packed)[None, :], torch.cat(shard)[None, :]


def vectorised_pack_and_shard(mask, lengths, cp_size, cp_rank):
    """mtp_overlay.mtp: one gather for the packed row, one for this rank's shard."""
    batch = mtp.pack_sequences(mask, lengths, pad_multiple=mtp.padding_multiple(cp_size))
    return batch.input_ids, mtp.cp_shard(batch.input_ids, cp_size, cp_rank, batch.cu_seqlens_padded)


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both variants)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, args.seq_len + 1, (args.batch,), generator=generator)
    prompt = (torch.rand(args.batch, generator=generator) * lengths * 0.5).long()
    columns = torch.arange(args.seq_len)[None, :]
    mask = ((columns >= prompt[:, None]) & (columns < lengths[:, None])).float()
    mask[torch.rand(args.batch, generator=generator) < 0.1] = 0.0  # zero-weight samples

    loop_time = fast_time = 0.0
    for rank in range(args.cp):  # what each CP rank does for itself
        seconds, (loop_packed, loop_shard) = best_of(lambda: loop_pack_and_shard(mask, lengths, args.cp, rank), args.repeats)
        loop_time += seconds / args.cp
        seconds, (packed, shard) = best_of(lambda: vectorised_pack_and_shard(mask, lengths, args.cp, rank), args.repeats)
        fast_time += seconds / args.cp
        assert torch.equal(packed, loop_packed), "packed rows differ"
        assert torch.equal(shard, loop_shard), f"CP shards of rank {rank} differ"

    print(f"batch={args.batch} tokens={int(lengths.sum())} packed={packed.shape[1]} cp={args.cp} "
          f"threads={torch.get_num_threads()} (best of {args.repeats})")
    print(f"per-sequence loop : {loop_time * 1e3:9.2f} ms per rank")
    print(f"vectorised        : {fast_time * 1e3:9.2f} ms per rank")
    print(f"speedup           : {loop_time / fast_time:9.1f}x (outputs identical)")


if __name__ == "__main__":
    main()
