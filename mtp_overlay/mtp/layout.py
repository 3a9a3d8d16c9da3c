"""Which layout a model wants its loss mask in, the check every mask must pass, and its scope.

NeMo-RL PR #3494: the mask must have exactly the layout of the ``input_ids`` handed to the model. A
model that slices context parallelism itself (class attribute
``model_slices_context_parallel_inputs = True``, e.g. Megatron-Bridge's NemotronOmniModel) takes
full rows and returns ``(output, sliced_loss_mask)``; any other model takes the CP-local shard.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any

from .mask import _shape, check_weights, unwrap_model
from .packing import _check_cp, _check_cu_seqlens, cp_local_indices, cp_shard

if TYPE_CHECKING:  # annotations only: torch and megatron load inside the functions
    from collections.abc import Iterator

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

_SCOPED_LOSS_MASK: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "mtp_overlay_scoped_loss_mask", default=None
)


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
def loss_mask_scope(loss_mask: torch.Tensor | None) -> Iterator[torch.Tensor | None]:
    """Within the block, GPTModel/HybridModel.forward calls without a ``loss_mask`` get this one.

    Needs the ``mtp-loss-mask`` hook installed (``import mtp_overlay``). Scoped through a
    ContextVar, so concurrent threads and asyncio tasks each see their own mask. ``None`` (what
    `build_mtp_loss_mask` returns when MTP is off) makes the block a no-op. The mask must already
    be in the layout of the input_ids that reach GPTModel/HybridModel.forward: CP-local for a
    plain model. A model that slices CP itself must get its full-row mask as ``loss_mask``
    explicitly (the scope only reaches the inner forward, after the model's own slicing).
    TypeError unless ``loss_mask`` is a torch.Tensor or None.
    """
    if loss_mask is not None:
        _check_tensor(loss_mask, "loss_mask", "a torch.Tensor or None")
    token = _SCOPED_LOSS_MASK.set(loss_mask)
    try:
        yield loss_mask
    finally:
        _SCOPED_LOSS_MASK.reset(token)


def scoped_loss_mask() -> torch.Tensor | None:
    """The mask of the innermost `loss_mask_scope`, or None."""
    return _SCOPED_LOSS_MASK.get()


def check_loss_mask_layout(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    packed_seq_params: PackedSeqParams | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> None:
    """ValueError unless ``loss_mask`` has the layout of ``input_ids`` (NeMo-RL PR #3494).

    Rules: same shape as ``input_ids``; for packed input (``packed_seq_params`` given; a row that is
    CP-local when ``cp_size`` > 1) zeros in every padding slot, i.e. past a sequence's real length
    (``cu_seqlens_q``) within its padded slot (``cu_seqlens_q_padded``) and past the last sequence.
    TypeError for a non-tensor ``input_ids``/``loss_mask`` or a ``packed_seq_params`` without
    ``cu_seqlens_q``; ValueError unless ``cp_size`` >= 1 and 0 <= ``cp_rank`` < ``cp_size``.
    """
    _check_tensor(input_ids, "input_ids")
    _check_tensor(loss_mask, "loss_mask")
    if packed_seq_params is not None and not hasattr(packed_seq_params, "cu_seqlens_q"):
        raise TypeError(
            f"packed_seq_params must be a megatron PackedSeqParams (with cu_seqlens_q) or None, got {type(packed_seq_params).__name__}"
        )
    _check_cp(cp_size, cp_rank)
    check_weights(loss_mask, "loss_mask")
    if tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"loss_mask has layout {_shape(loss_mask)} but input_ids has {_shape(input_ids)}: the MTP loss mask "
            "must have exactly the layout of the input_ids given to the model (same rows, same packing, "
            "same CP shard; NeMo-RL PR #3494)"
        )
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
