"""The hot path on a device, stock and with the overlay: the engine of ``scripts/gpu_check.sh``.

One rank (``launcher.run_ranks``: on CUDA a spawned rank with NCCL, on CPU a gloo rank with the CPU
stand-ins) builds a stock-megatron-core GPTModel (local spec, RoPE, 2 MTP depths; in bf16 wrapped in
``Float16Module`` as users train) and runs an RL forward+backward (``labels=None``, the MTP mask
scoped with ``mtp.loss_mask_scope(mask, aligned="input")``) of 4 prompt-masked sequences in three
layouts: BSHD (each sequence in its own row), THD padded (``cu_seqlens_q`` the padded boundaries,
NeMo-RL's default) and THD real-lengths (``cu_seqlens_q`` the real ones). Per layout and side (stock:
no fix installed; overlay: every fix) it measures:

* the MTP loss per depth (Megatron's tracker): the overlay's is the same in every layout;
* the host reads (device syncs) of one step, by file: `syncs.SyncCounter` at the aten level, and on
  CUDA also CUDA's own detector (``torch.cuda.set_sync_debug_mode``), and the aten ops of the step;
* the step time, stock and overlay interleaved (CUDA events on a GPU), median of ``iterations``, and
  the ratio: the median over the pairs of an overlay step's time over the stock step's just before it;
* the refit fingerprint's throughput over every parameter beside ``torch.sum``'s over the same tensors.

megatron-core's local ``DotProductAttention`` refuses packed input; on CUDA (no Transformer Engine
there) `thd_attention` stands in for TE's varlen kernel: per slot its sequence from the padded
boundaries, a same-sequence causal mask, ``scaled_dot_product_attention``, no host read. On CPU the
test bed's own exact attention (``cpu_shims``) runs. `thd_attention` is checked against it on CPU.

``python -m mtp_overlay.bed.engines.gpu_check --device cuda|cpu [--sizes ...]`` prints the table.
"""

import argparse
import collections
import dataclasses
import statistics
import sys
import time

from ..runtime.device import rank_device

SIZES = {  # name -> GPTModel shape; the 655M one is the first GPU run's (SPEC: 8 layers, hidden 2048)
    "655M": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, vocab_size=32768, seq_length=4096),
    "22M": dict(num_layers=2, hidden_size=512, num_attention_heads=8, vocab_size=8192, seq_length=1024),
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=64),
}
# timed steps per side by default: a 22M step (~30 ms on an H200) is short and its median of 12 moved
# by 6% between two runs; 80 of them take ~15 s there, 12 of the 655M model's ~70 s
ITERATIONS = {"655M": 12, "22M": 80, "tiny": 3}
LAYOUTS = ("BSHD", "THD padded", "THD real-lengths")
SIDES = ("stock", "overlay")
MTP_DEPTHS = 2
PAD_MULTIPLE = 16


@dataclasses.dataclass
class Row:
    """One layout and side of one model size."""

    size: str
    layout: str
    side: str
    mtp_losses: tuple = ()
    syncs: int = 0  # host reads of one step (aten-level counter)
    cuda_syncs: int | None = None  # CUDA's detector (on CUDA only)
    sync_sites: dict = dataclasses.field(default_factory=dict)  # "file:line" -> reads (aten-level counter)
    cuda_sites: dict = dataclasses.field(default_factory=dict)  # "file:line" -> syncs CUDA's detector reported
    ops: int = 0  # aten ops of one step
    step_ms: float = 0.0  # median
    ratio: float | None = None  # overlay: the median of its steps' times over the stock step's just before


def thd_attention(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                  packed_seq_params=None):
    """Causal self-attention over a packed THD row for ``DotProductAttention`` (no CP): what TE's varlen
    kernel computes, with no host read. query/key/value [t, heads, dim] -> [t, heads * dim]."""
    import torch
    import torch.nn.functional as F

    bounds = packed_seq_params.cu_seqlens_q_padded
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    bounds = bounds.to(device=query.device, dtype=torch.int64)
    slots = torch.arange(query.size(0), device=query.device)
    sequence = torch.searchsorted(bounds, slots, right=True)
    allowed = (sequence[None, :] == sequence[:, None]) & (slots[None, :] <= slots[:, None])
    repeat = query.size(1) // key.size(1)  # grouped-query attention
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
    context = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                             attn_mask=allowed, scale=scale)
    return context.transpose(0, 1).reshape(query.size(0), -1)


def _attention_for_packed_rows():
    """On CUDA: DotProductAttention runs packed rows with `thd_attention` (BSHD unchanged)."""
    import contextlib

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from ..runtime.shim import Shim, swapped

    upstream = DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return upstream(self, query, key, value, attention_mask, attn_mask_type, attention_bias)
        return thd_attention(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    if rank_device().type != "cuda":
        return contextlib.nullcontext()
    return swapped([Shim(DotProductAttention, "forward", forward)])


def batches(seq_length, vocab_size):
    """The three layouts' microbatches (``megatron_step`` keys) of the same 4 sequences."""
    from ..models.packed import make_packed_row

    lengths = (seq_length - 3, (3 * seq_length) // 4 - 1, seq_length // 2 - 5, seq_length // 4 + 1)
    prompts = tuple(length // 4 for length in lengths)
    row = {flavour: make_packed_row(lengths, pad_multiple=PAD_MULTIPLE, flavour=flavour, prompts=prompts,
                                    vocab_size=vocab_size) for flavour in ("padded", "unpadded")}
    return {
        "BSHD": row["padded"].reference_microbatch(labels=False),
        "THD padded": row["padded"].microbatch(labels=False),
        "THD real-lengths": row["unpadded"].microbatch(labels=False),
    }


def measure(size, iterations):
    """Rank worker: the `Row` of every layout and side for model ``size`` (a key of `SIZES`), and the
    fingerprint's throughput ``(bytes, fingerprint seconds, torch.sum seconds)``."""
    import torch

    import mtp_overlay
    from megatron.core.transformer.module import Float16Module

    from ..models.tiny_gpt import build_tiny_gpt

    shape = dict(SIZES[size])
    seq_length, vocab_size = shape.pop("seq_length"), shape.pop("vocab_size")
    cuda = rank_device().type == "cuda"
    mtp_overlay.uninstall()  # stock builds the model; the sides switch the fixes in and out
    dtype = dict(bf16=True, params_dtype=torch.bfloat16) if cuda else {}
    model = build_tiny_gpt(**shape, vocab_size=vocab_size, max_sequence_length=seq_length, mtp_num_layers=MTP_DEPTHS,
                           use_cpu_initialization=not cuda, **dtype)
    if cuda:
        model = Float16Module(model.config, model)
    device = next(model.parameters()).device
    rows = {}
    with _attention_for_packed_rows():
        for layout, batch in batches(seq_length, vocab_size).items():
            batch = {key: value.to(device) if isinstance(value, torch.Tensor) else _params_to(value, device)
                     for key, value in batch.items()}
            for side in SIDES:
                rows[layout, side] = _counted_step(model, batch, size, layout, side)
            times = _interleaved_times(model, batch, iterations)
            for side in SIDES:
                rows[layout, side].step_ms = statistics.median(times[side])
            rows[layout, "overlay"].ratio = statistics.median(o / s for s, o in zip(times["stock"], times["overlay"]))
    mtp_overlay.install()
    return [rows[layout, side] for layout in LAYOUTS for side in SIDES], _fingerprint_speed(model)


def _params_to(params, device):
    import torch

    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = getattr(params, field, None)
        if isinstance(value, torch.Tensor):
            setattr(params, field, value.to(device))
    return params


def _side(side):
    import mtp_overlay

    mtp_overlay.uninstall()
    if side == "overlay":
        mtp_overlay.install()


def _step(model, batch):
    """One RL forward+backward (Megatron's MTP tracker holds its MTP losses after it)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from ... import mtp

    MTPLossLoggingHelper.tracker.clear()
    model.zero_grad(set_to_none=True)
    with mtp.loss_mask_scope(batch["mtp_loss_mask"], aligned="input"):
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                       labels=None, packed_seq_params=batch.get("packed_seq_params"))
    # the trainer's own loss over the logits (a stand-in for an RL objective): the mask's mean log-partition
    mask = batch["loss_mask"].to(logits.dtype)
    ((logits.float().logsumexp(-1) * mask).sum() / mask.sum().clamp(min=1)).backward()


def _counted_step(model, batch, size, layout, side):
    import torch

    from ...mtp import mtp_metrics
    from ..runtime.syncs import SyncCounter

    _side(side)
    _step(model, batch)  # warm: one-time checks and allocations out of the count
    counter = SyncCounter(device=rank_device().type)
    with counter:
        _step(model, batch)
    logged = mtp_metrics(1)  # the tracker's reduction, as Megatron logs it (after the count: it reads)
    losses = tuple(logged.get(f"mtp_{depth}_loss", float("nan")) for depth in range(1, MTP_DEPTHS + 1))
    sites = collections.Counter()
    for (_, _, place), n in counter.summary().items():
        sites[place] += n
    cuda = counter.device == "cuda"
    return Row(size, layout, side, mtp_losses=losses, syncs=counter.count(),
               cuda_syncs=sum(counter.cuda_syncs.values()) if cuda else None, sync_sites=dict(sites),
               cuda_sites=dict(counter.cuda_syncs), ops=sum(counter.ops.values()))


def _interleaved_times(model, batch, iterations):
    """Milliseconds per step of each side, the sides alternating (CUDA events on a GPU)."""
    import torch

    times = {side: [] for side in SIDES}
    for _ in range(iterations):
        for side in SIDES:
            _side(side)
            if rank_device().type == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _step(model, batch)
                end.record()
                torch.cuda.synchronize()
                times[side].append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                _step(model, batch)
                times[side].append((time.perf_counter() - began) * 1e3)
    return times


def _fingerprint_speed(model, repeats=5):
    """(bytes read, fingerprint seconds, torch.sum seconds, how the sums ran) over every parameter,
    medians, interleaved."""
    import torch

    from ...mtp import fingerprint
    from ...mtp.device import uses_kernels

    named = [(name, param.detach()) for name, param in model.named_parameters()]
    size = sum(param.numel() * param.element_size() for _, param in named)

    def timed(work):
        if rank_device().type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        work()
        if rank_device().type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    fingerprint(named)  # warm-up: the CUDA kernels compile on first use
    spans = {"fingerprint": [], "sum": []}
    for _ in range(repeats):
        spans["fingerprint"].append(timed(lambda: fingerprint(named)))
        spans["sum"].append(timed(lambda: [param.sum() for _, param in named]))
    how = "Triton kernels" if uses_kernels(rank_device()) else "torch ops"
    return size, statistics.median(spans["fingerprint"]), statistics.median(spans["sum"]), how


def measure_sizes(sizes, iterations):
    """Rank worker: `measure` of each size in turn (``iterations``: timed steps per side, by size),
    {size: (rows, fingerprint speed)}."""
    import gc

    import torch

    results = {}
    for size in sizes:
        results[size] = measure(size, iterations[size])
        gc.collect()
        if rank_device().type == "cuda":
            torch.cuda.empty_cache()
    return results


def run(device, sizes, iterations=None):
    """`measure_sizes` on one rank on ``device`` (one start of torch and megatron-core for all sizes);
    ``iterations``: timed steps per side, else `ITERATIONS`' of each size."""
    from ..runtime.launcher import run_ranks_checked

    counts = {size: iterations or ITERATIONS[size] for size in sizes}
    return run_ranks_checked(measure_sizes, 1, args=(list(sizes), counts), device=device, fixes=None,
                             timeout=900)[0]


def table(results, device):
    """The printed table of `run`'s results."""
    lines = []
    for size, (rows, (nbytes, fingerprint_s, sum_s, how)) in results.items():
        lines.append(f"-- {size} GPTModel, {MTP_DEPTHS} MTP depths, 4 sequences, RL forward+backward on {device}")
        lines.append(f"   {'layout':17s} {'side':8s} {'MTP loss per depth':24s} {'syncs':>6s} {'CUDA':>5s} "
                     f"{'aten ops':>8s} {'step ms':>9s}  ratio")
        for row in rows:
            losses = "/".join(f"{loss:.6f}" for loss in row.mtp_losses)
            cuda = "-" if row.cuda_syncs is None else str(row.cuda_syncs)
            ratio = "" if row.ratio is None else f"{row.ratio:.3f}"
            lines.append(f"   {row.layout:17s} {row.side:8s} {losses:24s} {row.syncs:6d} {cuda:>5s} {row.ops:8d} "
                         f"{row.step_ms:9.2f}  {ratio}")
        for row in rows:
            for what, found in (("reads", row.sync_sites), ("CUDA syncs", row.cuda_sites if row.cuda_syncs is not None else None)):
                if found is not None:
                    sites = ", ".join(f"{n}x {_short(place)}" for place, n in sorted(found.items(), key=lambda kv: -kv[1]))
                    lines.append(f"   {what} {row.layout} {row.side}: {sites or 'none'}")
        for side in SIDES:
            lines.append(f"   {side} MTP loss spread across layouts (max relative): {loss_spread(rows, side):.2e}")
        gb = nbytes / 1e9
        lines.append(f"   refit fingerprint ({how}): {gb:.3f} GB in {fingerprint_s * 1e3:.1f} ms = "
                     f"{gb / fingerprint_s:.1f} GB/s; "
                     f"torch.sum over the same tensors {gb / sum_s:.1f} GB/s (fingerprint/sum {sum_s / fingerprint_s:.2f})")
    return "\n".join(lines)


def loss_spread(rows, side):
    """The largest relative difference of one side's MTP loss, per depth, between any two layouts."""
    spread = 0.0
    losses = [row.mtp_losses for row in rows if row.side == side]
    for depth in range(MTP_DEPTHS):
        values = [loss[depth] for loss in losses]
        spread = max(spread, (max(values) - min(values)) / max(abs(min(values)), 1e-12))
    return spread


def _short(place):
    for marker in ("site-packages/", "mtp_overlay/"):
        if marker in place:
            return place.split(marker, 1)[1]
    return place


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--sizes", default=None, help=f"comma-separated of {', '.join(SIZES)} "
                                                        "(default: 655M,22M on cuda, tiny on cpu)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed steps per side (default by size: " + ", ".join(f"{k} {v}" for k, v in ITERATIONS.items()) + ")")
    args = parser.parse_args(argv)
    sizes = (args.sizes or ("655M,22M" if args.device == "cuda" else "tiny")).split(",")
    unknown = [size for size in sizes if size not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {', '.join(unknown)}; expected some of {', '.join(SIZES)}")
    if args.iterations is not None and args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    print(table(run(args.device, sizes, args.iterations), args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
