"""Benchmark device-normalized-broadcast against stock vLLM on an all-on-device refit stream.

Runs vLLM's real ``packed_nccl_broadcast_producer`` (and so ``pack_tensors``) over >= 1 GiB of
tensors already on the communicator's device, hooked and stock, interleaved in one process. On a CPU
machine the device is ``cpu``: the producer's CUDA streams become no-ops there (every host op is
synchronous) and the communicator's broadcast does nothing, so the time is the packing itself.
Prints the median of per-pair time ratios (goal <= 1.03; back-to-back pairs cancel a shared
machine's drifting load), the fix's own work per transfer, timed apart from the noisy packing, and
the bytes the fix copied (goal 0).

    .venv/bin/python scripts/bench_device_broadcast.py [--gib 1] [--tensor-mib 16] [--repeats 11]
"""

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

import mtp_overlay  # installs the fix, to be found on vLLM's producer below
from mtp_overlay.fixes.device_normalized_broadcast import normalizing_producer
from mtp_overlay.bed.runtime.streams import HostCommunicator, host_streams
from vllm.distributed.weight_transfer import packed_tensor

NAME = "device-normalized-broadcast"
MIB = 1 << 20


def host_streams_without_cuda():
    """The producer's CUDA streams, as no-ops on a machine without CUDA."""
    return contextlib.nullcontext() if torch.cuda.is_available() else host_streams()


def export_stream(gib, tensor_mib, device):
    """Named tensors of ``gib`` GiB on ``device``, alternating bf16 and fp32 like a model's state."""
    count = int(gib * 1024 / tensor_mib)
    tensors = []
    for index in range(count):
        dtype = torch.bfloat16 if index % 2 else torch.float32
        elements = tensor_mib * MIB // dtype.itemsize
        tensor = torch.full((elements // 1024, 1024), index, dtype=dtype, device=device)
        tensors.append((f"layers.{index}.weight", tensor))
    return tensors


def send(producer, stream, device):
    start = time.perf_counter()
    producer(iter(stream), HostCommunicator(device), 0, lambda item: item[1])  # vLLM's default 1 GiB buffer
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def fix_overhead(stream, device, calls=200):
    """Seconds per transfer the hook itself adds: a producer that only runs ``post_iter_func`` on
    each item, called through the hook and directly."""

    def drain(iterator, group, src, post_iter_func, buffer_size_bytes=0, num_buffers=0):
        for item in iterator:
            post_iter_func(item)

    def second(item):
        return item[1]

    def direct():
        drain(iter(stream), HostCommunicator(device), 0, second)

    def hooked():
        normalizing_producer(drain, None, (iter(stream), HostCommunicator(device), 0, second), {})

    def per_call(call):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - start) / calls

    return min(per_call(hooked) for _ in range(3)) - min(per_call(direct) for _ in range(3))


def bytes_copied_by_fix(producer, stream, device):
    """Bytes of tensors reaching the packed buffer at an address other than the source's, and bytes
    ``Tensor.to`` copied, over one hooked run."""
    sources = {t.untyped_storage().data_ptr() for _, t in stream}
    moved, to_copies = [0], [0]
    real_pack, real_to = packed_tensor.pack_tensors, torch.Tensor.to

    def counting_pack(iterator, post_iter_func, *args, **kwargs):
        def post(item):
            tensor = post_iter_func(item)
            if tensor.untyped_storage().data_ptr() not in sources:
                moved[0] += tensor.nbytes
            return tensor

        return real_pack(iterator, post, *args, **kwargs)

    def counting_to(tensor, *args, **kwargs):
        result = real_to(tensor, *args, **kwargs)
        if result.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            to_copies[0] += result.nbytes
        return result

    with (
        mock.patch.object(packed_tensor, "pack_tensors", counting_pack),
        mock.patch.object(torch.Tensor, "to", counting_to),
    ):
        send(producer, stream, device)
    return moved[0], to_copies[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the stream in GiB (default 1)")
    parser.add_argument("--tensor-mib", type=int, default=16, help="size of each tensor in MiB (default 16)")
    parser.add_argument("--repeats", type=int, default=11, help="interleaved stock/fixed pairs (default 11)")
    args = parser.parse_args()
    if args.gib <= 0 or args.tensor_mib <= 0 or args.repeats < 1:
        parser.error("--gib, --tensor-mib and --repeats must be positive")

    row = mtp_overlay.status(only=[NAME])[0]
    if row.state != "installed":
        raise SystemExit(f"{NAME} is {row.state}: {row.reason}")
    fixed = packed_tensor.packed_nccl_broadcast_producer
    stock = fixed.__wrapped__
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    stream = export_stream(args.gib, args.tensor_mib, device)
    total = sum(t.nbytes for _, t in stream)

    producers = {"stock": stock, "fixed": fixed}
    times = {"stock": [], "fixed": []}
    with host_streams_without_cuda():
        for name in ("stock", "fixed"):  # warm-up: first-touch page faults of the packed buffer
            send(producers[name], stream, device)
        for repeat in range(args.repeats):  # back-to-back pairs, alternating which goes first
            for name in ("stock", "fixed") if repeat % 2 == 0 else ("fixed", "stock"):
                times[name].append(send(producers[name], stream, device))
        moved, to_copies = bytes_copied_by_fix(fixed, stream, device)
    overhead = fix_overhead(stream, device)

    medians = {name: statistics.median(values) for name, values in times.items()}
    pair_ratios = [f / s for f, s in zip(times["fixed"], times["stock"])]
    print(f"stream: {len(stream)} tensors, {total / (1 << 30):.2f} GiB on {device}; vLLM producer, "
          f"{args.repeats} interleaved pairs")
    for name in ("stock", "fixed"):
        print(f"{name} producer: median {medians[name]:.3f} s, min {min(times[name]):.3f} s")
    print(f"time ratio fixed/stock: median of pairs {statistics.median(pair_ratios):.3f}, "
          f"of medians {medians['fixed'] / medians['stock']:.3f} (goal <= 1.03)")
    print(f"fix's own work per transfer: {overhead * 1e6:.1f} us = "
          f"{overhead / min(times['stock']):.6f} of the fastest stock transfer")
    print(f"extra bytes copied by the fix: {moved} reaching the buffer from a new address, "
          f"{to_copies} by Tensor.to (goal 0)")


if __name__ == "__main__":
    main()
