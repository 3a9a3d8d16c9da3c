"""Which layout a model wants its loss mask in, the check every mask must pass, and its scope.

NeMo-RL PR #3494: the mask must have exactly the layout of the ``input_ids`` handed to the model. A
model that slices context parallelism itself (class attribute
``model_slices_context_parallel_inputs = True``, e.g. Megatron-Bridge's NemotronOmniModel) takes
full rows and returns ``(output, sliced_loss_mask)``; any other model takes the CP-local shard.

Alignment. In an RL forward (``labels=None``) megatron-core derives the labels by rolling
``input_ids`` left and rolls the mask with them (Megatron-LM PR #3457): the MTP mask it takes is
*input-aligned*, ``mask[i]`` weighing token i as a target. The LM loss an RL trainer computes
outside Megatron uses the *label-aligned* mask, ``mask[i]`` weighing label i = token i + 1
(NeMo-RL's ``token_mask[:, 1:]``). Handed to the RL forward, a label-aligned mask trains every MTP
target one token early (the last prompt token in, each sequence's last token out), silently.
`loss_mask_scope` takes the alignment (``aligned="input"`` or ``"label"``, which the hook turns into
the input-aligned mask); `input_aligned_mask` converts full rows; and where the alignment is not
said, mtp-loss-mask refuses the off-by-one's signature (`label_aligned_signature`).
"""

from __future__ import annotations

import contextlib
import contextvars

from .checks import device_assert, full
from .mask import _shape, check_weights, unwrap_model
from .packing import (
    _check_cp,
    _check_cu_seqlens,
    assert_boundaries,
    boundary_tensor,
    chunk_runs,
    covered,
    cp_local_indices,
    cp_shard,
    row_plan,
    slot_geometry,
)

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: torch and megatron load inside the functions
    from collections.abc import Iterator
    from typing import Any

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

_SCOPED_LOSS_MASK: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "mtp_overlay_scoped_loss_mask", default=None
)
INPUT, LABEL = "input", "label"
ALIGNMENTS = (INPUT, LABEL)  # what `loss_mask_scope(aligned=...)` takes (None: not said)
_SCOPED_ALIGNMENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtp_overlay_scoped_alignment", default=None)


def model_slices_context_parallel(model: Any) -> bool:
    """True when the (unwrapped) model declares ``model_slices_context_parallel_inputs = True``."""
    return getattr(unwrap_model(model), "model_slices_context_parallel_inputs", False) is True


def shard_for_model(
    model: Any, tensor: torch.Tensor, cp_size: int, cp_rank: int, cu_seqlens_padded: torch.Tensor | None = None
) -> torch.Tensor:
    """``tensor`` (tokens or mask, full rows) in the layout ``model`` takes: full or CP-local."""
    if model_slices_context_parallel(model):
        return tensor
    return cp_shard(tensor, cp_size, cp_rank, cu_seqlens_padded)


def split_output(output: Any) -> tuple[Any, torch.Tensor | None]:
    """``(logits_or_loss, sliced_loss_mask)``: unwraps a CP-slicing model's 2-tuple, else ``(output, None)``."""
    if isinstance(output, (tuple, list)):
        if len(output) != 2:
            raise ValueError(f"output: expected a tensor or (output, sliced_loss_mask), got a {len(output)}-tuple")
        return output[0], output[1]
    return output, None


def unwrap_output(output: Any) -> Any:
    """The logits (or loss) of a model output, dropping a CP-slicing model's sliced loss mask."""
    return split_output(output)[0]


@contextlib.contextmanager
def loss_mask_scope(loss_mask: torch.Tensor | None, *, aligned: str | None = None) -> Iterator[torch.Tensor | None]:
    """Within the block, GPTModel/HybridModel.forward calls without a ``loss_mask`` get this one.

    Needs the ``mtp-loss-mask`` hook installed (``import mtp_overlay``). Scoped through a
    ContextVar, so concurrent threads and asyncio tasks each see their own mask. ``None`` (what
    `build_mtp_loss_mask` returns when MTP is off) routes no mask. The mask must already be in the
    layout of the input_ids that reach GPTModel/HybridModel.forward: CP-local for a plain model. A
    model that slices CP itself must get its full-row mask as ``loss_mask`` explicitly (the scope
    only reaches the inner forward, after the model's own slicing).

    ``aligned`` says which mask it is, for this one and for a ``loss_mask`` passed explicitly in the
    block: ``"input"`` (unshifted, ``mask[i]`` weighs token i: what an RL forward takes),
    ``"label"`` (``mask[i]`` weighs label i = token i + 1, e.g. the LM loss's ``token_mask[:, 1:]``
    padded back: with ``labels`` megatron-core takes it as is; in an RL forward the hook shifts it
    into the input-aligned mask, at CP=1 (under CP convert the full rows first: `input_aligned_mask`));
    None: not said here (an enclosing scope's word holds; said nowhere, the hook refuses a mask that
    looks label-aligned in an RL forward, `label_aligned_signature`: say ``"input"`` for one that
    only looks so). TypeError unless ``loss_mask`` is a torch.Tensor or None; ValueError for
    another ``aligned``.
    """
    if loss_mask is not None:
        _check_tensor(loss_mask, "loss_mask", "a torch.Tensor or None")
    if aligned is not None and aligned not in ALIGNMENTS:
        raise ValueError(f"aligned must be one of {ALIGNMENTS} or None (not said), got {aligned!r}")
    token = _SCOPED_LOSS_MASK.set(loss_mask)
    alignment = _SCOPED_ALIGNMENT.set(_SCOPED_ALIGNMENT.get() if aligned is None else aligned)
    try:
        yield loss_mask
    finally:
        _SCOPED_ALIGNMENT.reset(alignment)
        _SCOPED_LOSS_MASK.reset(token)


def scoped_loss_mask() -> torch.Tensor | None:
    """The mask of the innermost `loss_mask_scope`, or None."""
    return _SCOPED_LOSS_MASK.get()


def scoped_alignment() -> str | None:
    """The ``aligned`` of the innermost `loss_mask_scope` (None: not said)."""
    return _SCOPED_ALIGNMENT.get()


def input_aligned_mask(label_mask: torch.Tensor, cu_seqlens_padded: torch.Tensor | None = None) -> torch.Tensor:
    """The input-aligned MTP mask of a label-aligned one: each row (or, given ``cu_seqlens_padded``,
    each packed sequence of a full [1, T] row) shifted right by one slot, its first slot 0.

    Exact for an RL forward: the first token of a sequence is never a target, and megatron-core
    rolls the mask back left. Full rows only (before CP sharding). On the mask's device, no host read
    (the boundaries asserted there; checked on the host under ``MTP_OVERLAY_CHECKS=full``).
    """
    import torch

    _check_tensor(label_mask, "label_mask")
    if label_mask.dim() < 1:
        raise ValueError(f"label_mask must have a sequence dimension last, got {_shape(label_mask)}")
    length = label_mask.shape[-1]
    shifted = torch.roll(label_mask, shifts=1, dims=-1)
    if cu_seqlens_padded is None:
        first = torch.arange(length, device=label_mask.device) == 0
    else:
        cu = boundary_tensor(cu_seqlens_padded, "cu_seqlens_padded", label_mask.device)
        if full():
            _check_cu_seqlens(cu, "cu_seqlens_padded", length, label_mask.device)
        else:
            assert_boundaries(cu, length, 1, "cu_seqlens_padded")
        starts, lengths, _ = chunk_runs(cu)
        first = covered(starts, lengths.clamp(max=1), length)
    return shifted.masked_fill(first, 0)


def check_loss_mask_layout(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    packed_seq_params: PackedSeqParams | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> None:
    """ValueError unless ``loss_mask`` has the layout of ``input_ids`` (NeMo-RL PR #3494).

    Rules: same shape as ``input_ids``, on the same device; finite weights >= 0; for packed input
    (``packed_seq_params`` given; a row that is CP-local when ``cp_size`` > 1) zeros in every
    padding slot, i.e. past a sequence's real length (``cu_seqlens_q``) within its padded slot
    (``cu_seqlens_q_padded``) and past the last sequence. TypeError for a non-tensor
    ``input_ids``/``loss_mask`` or a ``packed_seq_params`` without ``cu_seqlens_q``; ValueError
    unless ``cp_size`` >= 1 and 0 <= ``cp_rank`` < ``cp_size``. Reads the values on the host (a
    device sync): the hook runs `assert_loss_mask_layout` instead unless ``MTP_OVERLAY_CHECKS=full``.
    """
    _check_layout_arguments(input_ids, loss_mask, packed_seq_params, cp_size, cp_rank)
    check_weights(loss_mask, "loss_mask")
    if packed_seq_params is None:
        return
    padding = padding_slots(input_ids.shape[-1], packed_seq_params, cp_size, cp_rank, input_ids.device)
    stray = (loss_mask != 0) & padding
    if bool(stray.any()):
        positions = stray.nonzero()[:, -1].unique()
        raise ValueError(
            f"loss_mask is nonzero in {int(positions.numel())} padding slot(s) of the packed input_ids "
            f"(first at {positions[:8].tolist()}; input_ids layout: cu_seqlens_q="
            f"{_as_list(packed_seq_params.cu_seqlens_q)}, cu_seqlens_q_padded={_as_list(packed_seq_params.cu_seqlens_q_padded)}, "
            f"cp {cp_rank}/{cp_size}): pack the mask with the tokens' boundaries and per-sequence padding, "
            "pad slots 0 (mtp_overlay.mtp.pack_sequences)"
        )


def assert_loss_mask_layout(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    packed_seq_params: PackedSeqParams | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> None:
    """The rules of `check_loss_mask_layout` without a host read (the hook's default mode).

    Types, shapes and devices are checked on the host (the same errors); the weights, the packed
    boundaries and the padding slots on the device (`mtp_overlay.mtp.checks.device_assert`: on CPU a RuntimeError
    at once; on CUDA a device-side assert at the next sync).
    """
    import torch

    _check_layout_arguments(input_ids, loss_mask, packed_seq_params, cp_size, cp_rank)
    if loss_mask.dtype != torch.bool and loss_mask.numel():
        if loss_mask.is_floating_point():  # one read of the mask: NaN makes both extremes NaN, so both tests False
            least, most = torch.aminmax(loss_mask)
            valid = (least >= 0) & (most < float("inf"))
        else:
            valid = loss_mask.min() >= 0
        device_assert(valid, "loss_mask must hold finite weights >= 0")
    if packed_seq_params is None:
        return
    length = input_ids.shape[-1]
    plan = row_plan(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded, length, cp_size, cp_rank,
                    input_ids.device, ("packed_seq_params.cu_seqlens_q", "packed_seq_params.cu_seqlens_q_padded"))
    tokens = torch.minimum((plan.real_lengths - plan.offsets).clamp(min=0), plan.lengths)  # each run's real slots come first
    padding = ~covered(plan.starts, tokens, length)
    device_assert(~((loss_mask != 0) & padding).any(), f"loss_mask is nonzero in a padding slot (cp rank {cp_rank}/{cp_size})")


def label_aligned_signature(
    loss_mask: torch.Tensor, packed_seq_params: PackedSeqParams, cp_group: Any = None, cp_rank: int = 0
) -> int | None:
    """How many sequences carry the label-aligned signature, when all the weighted ones do; else None.

    A label-aligned mask is 0 on each sequence's last real token (no label lies past it). An
    input-aligned RL mask weighs its responses, which end a sequence: nonzero there. So a packed row
    whose every weighted sequence is zero on its last real token most likely holds the LM loss's
    mask, one token early (NeMo-RL's ``token_mask[:, 1:]``). Decidable where the real ends are
    known: ``cu_seqlens_q`` the real boundaries, apart from ``cu_seqlens_q_padded``; otherwise (BSHD,
    the padded flavour) None. Under CP the CP-local row's per-sequence counts are summed over
    ``cp_group`` (a collective: every rank of it calls this), so every rank gives the same answer.
    One host read. An input-aligned mask whose every response is followed by masked tokens (a
    multi-turn sample ending in a tool turn, in every sequence) looks the same: say ``aligned="input"``.
    """
    import torch

    padded_cu = packed_seq_params.cu_seqlens_q_padded
    if padded_cu is None:
        return None
    length, device = loss_mask.shape[-1], loss_mask.device
    real = boundary_tensor(packed_seq_params.cu_seqlens_q, "packed_seq_params.cu_seqlens_q", device)
    padded = boundary_tensor(padded_cu, "packed_seq_params.cu_seqlens_q_padded", device)
    count = real.numel() - 1
    if count < 1 or padded.shape != real.shape:
        return None
    cp_size = 1 if cp_group is None else cp_group.size()
    geometry = slot_geometry(padded, length, cp_size, cp_rank)
    weighted = (loss_mask != 0).reshape(-1, length).any(0)
    at_end = geometry.position == (real[1:] - real[:-1])[geometry.sequence] - 1
    sums = torch.zeros(2, count, device=device)
    sums[0].index_add_(0, geometry.sequence, weighted.float())
    sums[1].index_add_(0, geometry.sequence, (weighted & at_end).float())
    if cp_size > 1:
        torch.distributed.all_reduce(sums, group=cp_group)
    has_weight = sums[0] > 0
    signature = has_weight & (sums[1] == 0)
    unpadded = (real != padded).any()
    found = torch.stack([unpadded.long(), has_weight.sum(), signature.sum()]).tolist()
    if found[0] and found[1] and found[2] == found[1]:
        return int(found[1])
    return None


def _check_layout_arguments(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, packed_seq_params: PackedSeqParams | None, cp_size: int, cp_rank: int
) -> None:
    """What both layout checks refuse without reading a value: types, CP rank, shape, device."""
    _check_tensor(input_ids, "input_ids")
    _check_tensor(loss_mask, "loss_mask")
    if packed_seq_params is not None and not hasattr(packed_seq_params, "cu_seqlens_q"):
        raise TypeError(
            f"packed_seq_params must be a megatron PackedSeqParams (with cu_seqlens_q) or None, got {type(packed_seq_params).__name__}"
        )
    _check_cp(cp_size, cp_rank)
    if tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"loss_mask has layout {_shape(loss_mask)} but input_ids has {_shape(input_ids)}: the MTP loss mask "
            "must have exactly the layout of the input_ids given to the model (same rows, same packing, "
            "same CP shard; NeMo-RL PR #3494)"
        )
    if loss_mask.device != input_ids.device:
        raise ValueError(
            f"loss_mask is on {loss_mask.device} but input_ids on {input_ids.device}: the MTP loss mask must be on "
            "the tokens' device (megatron-core multiplies the two)"
        )


def padding_slots(
    local_length: int,
    packed_seq_params: PackedSeqParams,
    cp_size: int = 1,
    cp_rank: int = 0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Boolean [local_length]: which slots of a (CP-local) packed row are padding."""
    import torch

    real_cu = _check_cu_seqlens(packed_seq_params.cu_seqlens_q, "packed_seq_params.cu_seqlens_q", None, device)
    padded_cu = packed_seq_params.cu_seqlens_q_padded
    padded_cu = real_cu if padded_cu is None else _check_cu_seqlens(padded_cu, "packed_seq_params.cu_seqlens_q_padded", None, device)
    if real_cu.shape != padded_cu.shape or bool((real_cu.diff() > padded_cu.diff()).any()):
        raise ValueError(
            f"packed_seq_params: cu_seqlens_q {real_cu.tolist()[:16]} does not fit in cu_seqlens_q_padded {padded_cu.tolist()[:16]}"
        )
    real, padded = real_cu.diff(), padded_cu.diff()
    if cp_size > 1 and bool((padded % (2 * cp_size)).any()):
        raise ValueError(
            f"packed_seq_params: padded sequence lengths {padded.tolist()[:16]} are not multiples of 2*cp_size={2 * cp_size}"
        )
    if local_length * cp_size != int(padded_cu[-1]):
        where = f"{local_length} slots on CP rank {cp_rank} of {cp_size}" if cp_size > 1 else f"{local_length} slots"
        raise ValueError(
            f"packed row: input_ids has {where}, but packed_seq_params.cu_seqlens_q_padded ends at "
            f"{int(padded_cu[-1])}: expected {int(padded_cu[-1]) / cp_size:g} slots per row (pack the row "
            "with those boundaries, no slot past the last one)"
        )
    # padding over the whole packed row, then this rank's slots of it (the 2*cp-chunk layout)
    position = torch.arange(int(padded_cu[-1]), device=real_cu.device)
    sequence = torch.searchsorted(padded_cu, position, right=True) - 1
    padding = position - padded_cu[sequence] >= real[sequence]
    return padding[cp_local_indices(padded_cu, cp_size, cp_rank)]


def _check_tensor(value: object, name: str, expected: str = "a torch.Tensor") -> None:
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def _as_list(tensor: torch.Tensor | None) -> list[int] | None:
    return None if tensor is None else tensor.tolist()[:16]
