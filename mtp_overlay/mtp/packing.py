"""THD packing and context-parallel sharding of tokens and MTP loss mask, vectorised.

Layout rule (NeMo-RL PR #3494): the loss mask must have exactly the layout of the ``input_ids`` the
model gets. Packing puts tokens and mask through the same index, so they share boundaries and
per-sequence padding by construction (pad slots: ``pad_token_id`` for tokens, 0 for the mask).
CP sharding is the load-balanced layout of megatron-core's ``get_batch_on_this_cp_rank``: each padded
sequence is cut into ``2 * cp_size`` chunks and rank r keeps chunks r and ``2 * cp_size - 1 - r``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from .checks import device_assert
from .mask import _shape, check_weights

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: torch and megatron load inside the functions
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams


class PackedBatch(NamedTuple):
    """Output of `pack_sequences`.

    input_ids, loss_mask: [1, T] (loss_mask None when none was given); cu_seqlens: int32 [n+1] real
    boundaries; cu_seqlens_padded: int32 [n+1] padded boundaries, T == cu_seqlens_padded[-1];
    max_seqlen: longest padded sequence (int).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int


def padding_multiple(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Per-sequence padding multiple: ``2 * cp_size`` under CP, times ``tp_size`` under SP."""
    for name, value in (("cp_size", cp_size), ("tp_size", tp_size)):
        _check_positive_int(value, name)
    return (2 * cp_size if cp_size > 1 else 1) * (tp_size if sequence_parallel else 1)


def pack_sequences(
    input_ids: torch.Tensor,
    lengths: torch.Tensor | Sequence[int],
    loss_mask: torch.Tensor | None = None,
    *,
    pad_multiple: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack rows ``input_ids[b, :lengths[b]]`` into one [1, T] row, and ``loss_mask`` identically.

    ``input_ids``: [B, S]; ``lengths``: B integers in [0, S]; ``loss_mask``: [B, S] or None.
    Each sequence is padded to a multiple of ``pad_multiple`` (see `padding_multiple`) with
    ``pad_token_id``: an int in [0, max of input_ids' dtype].
    """
    import torch

    batch_size, seq_len = _check_rows(input_ids, "input_ids")
    lengths = _check_lengths(lengths, batch_size, seq_len, input_ids.device)
    _check_positive_int(pad_multiple, "pad_multiple")
    _check_pad_token_id(pad_token_id, input_ids.dtype)
    if loss_mask is not None:
        _check_same_shape(loss_mask, "loss_mask", input_ids, "input_ids")
        check_weights(loss_mask, "loss_mask")
    padded = (lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    cu_seqlens = _cumulative(lengths)
    cu_seqlens_padded = _cumulative(padded)
    # one gather index shared by every packed tensor: slot k of sequence b reads input[b, k - start_b]
    # (slots past the row's end are clamped; they are padding and get filled below)
    rows = torch.arange(batch_size, device=lengths.device)
    source = _ramp(padded, rows * seq_len - cu_seqlens_padded[:-1]).clamp_(max=max(input_ids.numel() - 1, 0))
    padding = _ramp(padded - lengths, cu_seqlens[1:])  # slots past each sequence's length

    def pack(values: torch.Tensor, fill: int) -> torch.Tensor:
        return values.reshape(-1).index_select(0, source).index_fill_(0, padding, fill)[None, :]

    tokens = pack(input_ids, pad_token_id)
    mask = None if loss_mask is None else pack(loss_mask, 0)
    max_seqlen = int(padded.max()) if batch_size else 0
    return PackedBatch(tokens, mask, cu_seqlens.to(torch.int32), cu_seqlens_padded.to(torch.int32), max_seqlen)


def unpack_sequences(
    packed: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    cu_seqlens_padded: torch.Tensor | Sequence[int],
    seq_len: int,
    fill: float = 0,
) -> torch.Tensor:
    """Inverse of `pack_sequences` for one packed row ([1, T] or [T]): back to [B, seq_len]."""
    row = _packed_row(packed)
    cu_padded = _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded", row.shape[0], row.device)
    cu_real = _check_cu_seqlens(cu_seqlens, "cu_seqlens", None, row.device)
    if cu_real.shape != cu_padded.shape:
        raise ValueError(f"cu_seqlens {_shape(cu_seqlens)} and cu_seqlens_padded {_shape(cu_seqlens_padded)} differ in length")
    lengths = cu_real.diff()
    _check_positive_int(seq_len, "seq_len", minimum=0)
    if bool((lengths > cu_padded.diff()).any()):
        raise ValueError("cu_seqlens has a sequence longer than its slot in cu_seqlens_padded")
    if lengths.numel() and int(lengths.max()) > seq_len:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest sequence ({int(lengths.max())})")
    import torch

    starts = cu_real[:-1]
    target = _ramp(lengths, torch.arange(lengths.numel(), device=row.device) * seq_len - starts)
    source = _ramp(lengths, cu_padded[:-1] - starts)
    out = row.new_full((lengths.numel(), seq_len), fill)
    out.view(-1).index_copy_(0, target, row.index_select(0, source))
    return out


def cp_shard(
    tensor: torch.Tensor, cp_size: int, cp_rank: int, cu_seqlens_padded: torch.Tensor | Sequence[int] | None = None
) -> torch.Tensor:
    """This CP rank's part of ``tensor`` along its last (sequence) dimension.

    Without ``cu_seqlens_padded`` every row is one sequence (BSHD) of length divisible by
    ``2 * cp_size``; with it, the row is packed (THD) and each padded sequence is sharded.
    ``cp_size == 1`` keeps everything (the BSHD tensor itself).
    """
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        raise ValueError(f"tensor must be a tensor with a sequence dimension last, got {_shape(tensor)}")
    _check_cp(cp_size, cp_rank)
    chunks = 2 * cp_size
    length = tensor.shape[-1]
    if cu_seqlens_padded is not None:
        return tensor.index_select(-1, cp_local_indices(cu_seqlens_padded, cp_size, cp_rank, length, tensor.device))
    if cp_size == 1:
        return tensor
    if length % chunks:
        raise ValueError(
            f"cp_size={cp_size}: sequence length {length} of tensor {_shape(tensor)} is not a multiple of 2*cp_size={chunks}"
        )
    view = tensor.reshape(*tensor.shape[:-1], chunks, length // chunks)
    index = torch.tensor([cp_rank, chunks - 1 - cp_rank], device=tensor.device)
    return view.index_select(-2, index).reshape(*tensor.shape[:-1], -1)


def cp_local_indices(
    cu_seqlens_padded: torch.Tensor | Sequence[int],
    cp_size: int,
    cp_rank: int,
    total: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Positions of the packed row that CP rank ``cp_rank`` keeps, in its local order.

    Checked on the host (ValueError naming the argument; the row's length is read from the
    boundaries): a data-preparation call. The hooks use `slot_geometry`, which reads nothing.
    """
    import torch

    _check_cp(cp_size, cp_rank)
    cu = _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded", total, device)
    if cp_size == 1:
        return torch.arange(int(cu[-1]), device=cu.device)
    chunks = 2 * cp_size
    padded = cu.diff()
    if bool((padded % chunks).any()):
        raise ValueError(
            f"cu_seqlens_padded: every padded sequence length must be a multiple of 2*cp_size={chunks}, got {padded.tolist()}"
        )
    chunk = padded // chunks
    # two runs per sequence, in local order: chunk r, then chunk 2*cp-1-r
    run_sizes = torch.stack([chunk, chunk], 1).reshape(-1)
    run_sources = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (chunks - 1 - cp_rank) * chunk], 1).reshape(-1)
    return _ramp(run_sizes, run_sources - _cumulative(run_sizes)[:-1])


class SlotGeometry(NamedTuple):
    """Where each slot of a CP-local packed row sits (`slot_geometry`): int64 [local_length] each.

    sequence: the padded sequence holding the slot; position: its place in the whole padded
    sequence (0 .. padded length - 1), which is what real lengths are compared with.
    """

    sequence: torch.Tensor
    position: torch.Tensor


def slot_geometry(cu_seqlens_padded: torch.Tensor, local_length: int, cp_size: int = 1, cp_rank: int = 0) -> SlotGeometry:
    """`SlotGeometry` of a CP-local packed row of ``local_length`` slots, on ``cu_seqlens_padded``'s device.

    ``cu_seqlens_padded``: int64 [n+1] on the row's device, valid for the row (`assert_boundaries`;
    under CP each padded length a multiple of 2*cp_size, rank r holding chunks r and 2*cp-1-r of each
    sequence). Static shapes, device work only, no host read, from the boundaries given at each call.
    One search per slot: what needs a slot's sequence uses it; what needs only which slots a run
    covers uses `chunk_runs` and `covered` (a cumulative sum, several times cheaper on a long row).
    """
    import torch

    cu = cu_seqlens_padded
    count = cu.numel() - 1
    slot = torch.arange(local_length, device=cu.device)
    if count < 1:  # no sequence: every slot (there should be none) is past the end
        return SlotGeometry(torch.zeros_like(slot), slot)
    local = cu // cp_size if cp_size > 1 else cu
    sequence = (torch.searchsorted(local, slot, right=True) - 1).clamp_(0, count - 1)
    offset = slot - local[sequence]
    if cp_size == 1:
        return SlotGeometry(sequence, offset)
    chunk = ((cu[1:] - cu[:-1]) // (2 * cp_size))[sequence]
    back = (2 * cp_size - 1 - cp_rank) * chunk + (offset - chunk)
    return SlotGeometry(sequence, torch.where(offset < chunk, cp_rank * chunk + offset, back))


def chunk_runs(
    cu_seqlens_padded: torch.Tensor, cp_size: int = 1, cp_rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs of consecutive slots a CP-local packed row is made of: (starts, lengths, offsets),
    int64 on the boundaries' device, no host read.

    Without CP one run per padded sequence; under CP two, its front chunk (r) and back chunk
    (2*cp-1-r), interleaved. ``offsets``: each run's first slot's place in its whole padded sequence.
    ``cu_seqlens_padded``: int64 [n+1], valid for the row (`assert_boundaries`).
    """
    import torch

    cu = cu_seqlens_padded
    lengths = cu[1:] - cu[:-1]
    if cp_size == 1:
        return cu[:-1], lengths, torch.zeros_like(lengths)
    chunk = lengths // (2 * cp_size)
    front = cu[:-1] // cp_size
    starts = torch.stack([front, front + chunk], 1).flatten()
    offsets = torch.stack([cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk], 1).flatten()
    return starts, torch.stack([chunk, chunk], 1).flatten(), offsets


def covered(starts: torch.Tensor, counts: torch.Tensor, length: int) -> torch.Tensor:
    """Bool [length]: True on the first ``counts[i]`` slots from ``starts[i]`` of runs that do not
    overlap (a run may be empty, or start at ``length``). One cumulative sum, on the device."""
    import torch

    steps = torch.zeros(length + 1, dtype=torch.int32, device=starts.device)
    ones = torch.ones(starts.shape, dtype=torch.int32, device=starts.device)
    steps.index_add_(0, starts.clamp(max=length), ones)
    steps.index_add_(0, (starts + counts).clamp(max=length), -ones)
    return steps.cumsum(0, dtype=torch.int32)[:length] > 0


def boundary_tensor(cu: torch.Tensor | Sequence[int], name: str, device: torch.device | None = None) -> torch.Tensor:
    """``cu`` as an int64 [n+1] tensor on ``device``, refused on what needs no host read (its dtype
    and shape): ValueError naming ``name``. No value is read (`assert_boundaries` checks them)."""
    import torch

    if isinstance(cu, torch.Tensor):
        if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got dtype {cu.dtype}")
        cu = cu.detach().to(torch.int64)
        if device is not None and cu.device != torch.device(device):  # only a move is a copy (to the host: a sync)
            cu = cu.to(device)
    else:
        cu = torch.as_tensor(cu, dtype=torch.int64, device=device)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D [n+1] (0, then each packed sequence's end), got shape {list(cu.shape)}")
    return cu


def assert_boundaries(
    cu: torch.Tensor, local_length: int, cp_size: int, name: str, real: torch.Tensor | None = None,
    real_name: str = "cu_seqlens_q",
) -> None:
    """Queue the device-side check (`mtp_overlay.mtp.checks.device_assert`, one assert, no host read) that
    ``cu`` (int64 [n+1], the padded boundaries) lays out a CP-local row of ``local_length`` slots:
    starts at 0, never decreases, each length a multiple of 2*cp_size under CP, ends at
    local_length * cp_size; and, given ``real`` (int64, same shape), that it starts at 0, never
    decreases and fits in ``cu``."""
    lengths = cu[1:] - cu[:-1]
    valid = (cu[0] == 0) & (cu[-1] == local_length * cp_size)
    bad = lengths < 0
    if cp_size > 1:
        bad |= lengths % (2 * cp_size) != 0
    rule = f", lengths multiples of {2 * cp_size}" if cp_size > 1 else ""
    message = f"{_short(name)}: start 0, never decrease{rule}, end {local_length * cp_size}"
    if real is not None:
        real_lengths = real[1:] - real[:-1]
        valid &= real[0] == 0
        bad |= (real_lengths < 0) | (real_lengths > lengths)
        message += f"; {_short(real_name)}: start 0, never decrease, lengths <= those"
    device_assert(valid & ~bad.any(), message)


class RowPlan(NamedTuple):
    """What a CP-local packed row's boundaries say (`row_plan`), int64 on the row's device.

    real, padded: the boundaries ([n+1]); starts, lengths, offsets: the row's runs (`chunk_runs`);
    real_lengths: the real length of each run's sequence (per run).
    """

    real: torch.Tensor
    padded: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    real_lengths: torch.Tensor


_FORWARD: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar("mtp_overlay_forward", default=None)


@contextlib.contextmanager
def forward_scope() -> Iterator[None]:
    """One model forward: what `per_forward` works out from its packed boundaries (the rolls' plan,
    the boundaries' checks) is worked out once in it and shared by every roll of every MTP depth and
    by the checks, then dropped. Outside a scope nothing is kept: each call works it out anew."""
    token = _FORWARD.set({})
    try:
        yield
    finally:
        _FORWARD.reset(token)


def per_forward(key: tuple[Any, ...], inputs: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """``build()``, once per `forward_scope` for the same ``key`` and the same ``inputs`` objects (by
    identity: within one forward Megatron hands every roll the same boundary tensors); outside a
    scope, every time."""
    memo = _FORWARD.get()
    if memo is None:
        return build()
    key = key + tuple(id(value) for value in inputs)
    found = memo.get(key)
    if found is None:
        found = memo[key] = (build(), inputs)  # the inputs held: their ids stay theirs in the scope
    return found[0]


def row_plan(
    cu_seqlens_q: torch.Tensor | Sequence[int], cu_seqlens_q_padded: torch.Tensor | Sequence[int] | None,
    length: int, cp_size: int, cp_rank: int, device: torch.device, names: tuple[str, str],
) -> RowPlan:
    """The `RowPlan` of a CP-local packed row of ``length`` slots, its boundaries checked on the
    device (`assert_boundaries`, one assert), once per `forward_scope`. ``names``: the real and the
    padded boundaries' argument names (ValueError naming them on a wrong dtype or shape)."""

    def build() -> RowPlan:
        import torch

        real = boundary_tensor(cu_seqlens_q, names[0], device)
        padded = real if cu_seqlens_q_padded is None else boundary_tensor(cu_seqlens_q_padded, names[1], device)
        if padded.numel() != real.numel():
            shorter = "shorter than" if padded.numel() < real.numel() else "longer than"
            raise ValueError(
                f"{names[1]} has {padded.numel()} entries, {shorter} {_short(names[0])} ({real.numel()}): both must be "
                "[n+1], one start per packed sequence plus the end"
            )
        assert_boundaries(padded, length, cp_size, names[1] if cu_seqlens_q_padded is not None else names[0],
                          None if cu_seqlens_q_padded is None else real, names[0])
        starts, lengths, offsets = chunk_runs(padded, cp_size, cp_rank)
        real_lengths = real[1:] - real[:-1]
        if cp_size > 1:
            real_lengths = torch.stack([real_lengths, real_lengths], 1).flatten()
        return RowPlan(real, padded, starts, lengths, offsets, real_lengths)

    plan: RowPlan = per_forward(("row", length, cp_size, cp_rank, str(device)), (cu_seqlens_q, cu_seqlens_q_padded),
                                build)
    return plan


def _short(name: str) -> str:
    """An argument's name in a device message (``packed_seq_params.`` is implied there)."""
    return name.removeprefix("packed_seq_params.")


def packed_seq_params(packed: PackedBatch, real_lengths: bool = False) -> PackedSeqParams:
    """megatron-core PackedSeqParams (THD) for a `PackedBatch`.

    The tensors are laid out on the padded boundaries (``cu_seqlens_q_padded``). ``cu_seqlens_q``
    holds them too by default (NeMo-RL's default path): stock megatron-core 0.19 rolls the MTP labels
    and loss mask by ``cu_seqlens_q`` alone, and pad slots are masked out of the loss instead.
    ``real_lengths=True`` puts the real boundaries there (NeMo-RL's ``model_slices_context_parallel_inputs``
    path, PR #3494): attention then skips the padding, and the MTP roll needs fix mtp-packed-roll (or an
    upstream rolling on the padded boundaries, Megatron-LM #4494).

    ``total_tokens`` is the row's length where megatron-core has the field (0.18.2 and 0.19.2 do,
    0.16.1 not): only then does ``PackedSeqParams.__post_init__`` compute ``seq_idx``, the sequence of
    every packed slot, which is all a Mamba layer learns of the boundaries (0.19.2
    ``ssm/mamba_mixer.py:750``); without it the SSM state and the conv window run on from one sequence
    into the next. Megatron-Bridge's ``gpt_step`` sets it for hybrid models for that reason.
    """
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    cu = packed.cu_seqlens_padded
    real = packed.cu_seqlens if real_lengths else cu
    fields = {field.name for field in dataclasses.fields(PackedSeqParams)}
    total = {"total_tokens": int(cu[-1])} if "total_tokens" in fields else {}
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=real,
        cu_seqlens_kv=real,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
        **total,
    )


# --- helpers ------------------------------------------------------------------------------------
def _ramp(sizes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``arange(sum(sizes)) + repeat_interleave(offsets, sizes)``: runs of consecutive integers.

    Built as one cumulative sum of steps (1 inside a run, a jump at each run's start; empty runs
    share a start and their jumps telescope), in place: torch's CPU repeat_interleave and the
    temporaries of the plain formula cost several times more at 256k slots.
    """
    import torch

    starts = _cumulative(sizes)
    steps = torch.ones(int(starts[-1]) + 1, dtype=torch.int64, device=sizes.device)
    steps[0] = 0
    steps.index_add_(0, starts[:-1], offsets.diff(prepend=offsets.new_zeros(1)))
    return steps.cumsum_(0)[:-1]


def _cumulative(sizes: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])


def _check_rows(tensor: torch.Tensor, name: str) -> torch.Size:
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [B, S], got {_shape(tensor)}")
    return tensor.shape


def _check_same_shape(tensor: object, name: str, reference: torch.Tensor, reference_name: str) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.shape != reference.shape:
        raise ValueError(
            f"{name} must have the shape of {reference_name} {_shape(reference)}, got {_shape(tensor)}"
        )


def _check_lengths(
    lengths: torch.Tensor | Sequence[int], batch_size: int, seq_len: int, device: torch.device
) -> torch.Tensor:
    import torch

    if isinstance(lengths, (list, tuple)) and not lengths:
        lengths = torch.zeros(0, dtype=torch.int64)  # an empty batch, whatever holds its lengths
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.shape[0] != batch_size:
        raise ValueError(f"lengths must have shape [{batch_size}] (one per row of input_ids), got {_shape(lengths)}")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
    lengths = lengths.to(torch.int64)
    if bool((lengths < 0).any()) or bool((lengths > seq_len).any()):
        raise ValueError(f"lengths must lie in [0, {seq_len}] (S of input_ids), got {lengths.tolist()[:16]}")
    return lengths


def _check_cu_seqlens(
    cu_seqlens: torch.Tensor | Sequence[int], name: str, total: int | None, device: torch.device | None
) -> torch.Tensor:
    import torch

    cu = torch.as_tensor(cu_seqlens, device=device)
    if cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor [n+1], got {_shape(cu)} {cu.dtype}")
    cu = cu.to(torch.int64)
    if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()[:16]}")
    if total is not None and int(cu[-1]) != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {int(cu[-1])}")
    return cu


def _packed_row(packed: torch.Tensor) -> torch.Tensor:
    import torch

    if not isinstance(packed, torch.Tensor) or packed.dim() not in (1, 2) or (packed.dim() == 2 and packed.shape[0] != 1):
        raise ValueError(f"packed must be one packed row [1, T] or [T], got {_shape(packed)}")
    return packed.reshape(-1)


def _check_cp(cp_size: int, cp_rank: int) -> None:
    _check_positive_int(cp_size, "cp_size")
    _check_positive_int(cp_rank, "cp_rank", minimum=0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must lie in [0, cp_size={cp_size}), got {cp_rank}")


def _check_positive_int(value: object, name: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_pad_token_id(pad_token_id: int, dtype: torch.dtype) -> None:
    import torch

    _check_positive_int(pad_token_id, "pad_token_id", minimum=0)
    largest: float  # an int but for floating dtypes
    if dtype == torch.bool:
        largest = 1
    else:
        largest = (torch.finfo if dtype.is_floating_point else torch.iinfo)(dtype).max
    if pad_token_id > largest:
        raise ValueError(f"pad_token_id must lie in [0, {largest}] (input_ids dtype {dtype}), got {pad_token_id}")
