"""Throughput of the refit fingerprint against `torch.sum` over the same tensors, in one process.

64 float32 tensors of 1M elements (256 MiB, past every cache) by default; each repetition runs
`mtp_overlay.mtp.fingerprint` over all of them and `torch.sum` of each, alternating which goes first,
so machine drift hits both alike. Prints the median of each, their throughputs side by side and the
ratio (goal >= 0.25; on an H200 >= 1 TB/s), the bytes the fingerprint reads per tensor (on CPU two
reductions over its bytes, the row and the column sums; on CUDA one read by `mtp.device`'s kernels;
then the hash of those sums), and what fingerprinting a refit of N GB costs at that throughput.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_fingerprint.py [--tensors 64] [--elements 1048576] [--repeats 15] [--device cpu]
"""

import argparse
import statistics
import time

import torch

from mtp_overlay.mtp import fingerprint
from mtp_overlay.mtp import device as devices
from mtp_overlay.mtp.refit import _matrix


def _synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(args.elements, generator=generator).to(args.device) for _ in range(args.tensors)]
    named = [(f"layers.{i}.weight", t) for i, t in enumerate(tensors)]
    total = sum(t.numel() * t.element_size() for t in tensors)

    def run_sum():
        return [t.sum() for t in tensors]

    def run_fingerprint():
        return fingerprint(named)

    times = {"fingerprint": [], "torch.sum": []}
    sides = {"fingerprint": run_fingerprint, "torch.sum": run_sum}
    for side in sides.values():  # warm-up
        side()
    for index in range(args.repeats):
        order = list(sides) if index % 2 else list(sides)[::-1]
        for name in order:
            _synchronize(args.device)
            start = time.perf_counter()
            sides[name]()
            _synchronize(args.device)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    speed = {name: total / seconds / 1e9 for name, seconds in medians.items()}
    per_tensor = tensors[0].numel() * tensors[0].element_size()
    rows, width = _matrix(per_tensor // 8)
    summary = 8 * (rows + width + per_tensor // 8 - rows * width + bool(per_tensor % 8))
    kernels = devices.uses_kernels(tensors[0].device)
    print(f"{args.tensors} x {args.elements} {tensors[0].dtype} on {args.device} ({total / 2**20:.0f} MiB), "
          f"median of {args.repeats}, interleaved; sums by {'Triton kernels' if kernels else 'torch ops'}")
    for name in sides:
        print(f"  {name:12s} {medians[name] * 1e3:9.2f} ms  {speed[name]:8.2f} GB/s")
    print(f"  ratio fingerprint / torch.sum throughput: {speed['fingerprint'] / speed['torch.sum']:.3f} (goal >= 0.25)")
    reads = f"one read of its {per_tensor} bytes" if kernels else f"two reductions over its {per_tensor} bytes"
    print(f"  bytes read per tensor: {(1 if kernels else 2) * per_tensor} ({reads}) + {summary} bytes of row and "
          "column sums hashed")
    for gigabytes in (1, 15, 240):
        print(f"  a refit of {gigabytes} GB: {gigabytes / speed['fingerprint'] * 1e3:.1f} ms to fingerprint")
    print(f"fingerprint {speed['fingerprint']:.1f} GB/s, torch.sum {speed['torch.sum']:.1f} GB/s, ratio "
          f"{speed['fingerprint'] / speed['torch.sum']:.3f} ({'Triton kernels' if kernels else 'torch ops'}, "
          f"{args.tensors} x {per_tensor / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
