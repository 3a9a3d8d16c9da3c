"""The MTP loss mask: response tokens of kept samples, in the layout of ``input_ids``.

From megatron-core 0.19.0 (Megatron-LM PR #3457) a forward without ``labels`` derives the MTP labels
by rolling ``input_ids`` and rolls ``loss_mask`` with them; a missing ``loss_mask`` means all ones, so
prompt tokens, padding and filtered samples all train the MTP head. The mask is therefore built
unshifted (Megatron rolls it) and only when MTP is on: building it unconditionally broke non-MTP
self-packing VLM recipes (NeMo-RL issue #2869).
"""

from __future__ import annotations

from .device import for_collective

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: torch and megatron load inside the functions
    from typing import Any, TypeAlias

    import torch
    from megatron.core.transformer import TransformerConfig
    from torch.distributed import ProcessGroup

    # a TransformerConfig, or a model (possibly wrapped through .module) whose .config is one
    ModelOrConfig: TypeAlias = "torch.nn.Module | TransformerConfig"


def unwrap_model(model: Any) -> Any:
    """The model inside DDP / Float16Module-style wrappers (followed through ``.module``)."""
    chain = [model]
    while hasattr(model, "module"):
        model = model.module
        if any(model is seen for seen in chain):
            names = " -> ".join(type(seen).__name__ for seen in chain + [model])
            raise ValueError(f"model: its .module chain is a cycle ({names}); expected it to end at the inner model")
        chain.append(model)
    return model


def config_of(model_or_config: ModelOrConfig) -> TransformerConfig:
    """The TransformerConfig of a (wrapped) model, or the argument itself when it is a config.

    TypeError unless the result has ``mtp_num_layers`` (megatron-core 0.12+ TransformerConfig).
    """
    model = unwrap_model(model_or_config)
    config = getattr(model, "config", model)
    if not hasattr(config, "mtp_num_layers"):
        raise TypeError(
            "model_or_config must be a TransformerConfig with mtp_num_layers, or a model (possibly wrapped "
            f"through .module) whose .config has it; got {type(model_or_config).__name__}"
        )
    return config


def mtp_num_layers(model_or_config: ModelOrConfig) -> int:
    """``config.mtp_num_layers`` as an int; 0 when it is None."""
    return int(config_of(model_or_config).mtp_num_layers or 0)


def mtp_enabled(model_or_config: ModelOrConfig) -> bool:
    return mtp_num_layers(model_or_config) > 0


def check_binary(tensor: torch.Tensor, name: str) -> None:
    """ValueError naming ``name`` unless every element of ``tensor`` is 0 or 1."""
    if not bool(((tensor == 0) | (tensor == 1)).all()):
        raise ValueError(f"{name} must hold only 0 and 1, got values {sorted(set(tensor.unique().tolist()))[:8]}")


def check_weights(tensor: torch.Tensor, name: str) -> None:
    """ValueError naming ``name`` unless every element of ``tensor`` is a finite weight >= 0: a NaN
    or infinite loss-mask entry makes the MTP loss NaN, a negative one trains against the target."""
    import torch

    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name} must hold finite weights, got NaN or inf")
    if tensor.dtype != torch.bool and bool((tensor < 0).any()):
        raise ValueError(f"{name} must hold weights >= 0, got {float(tensor.min())}")


def check_sample_mask(sample_mask: torch.Tensor, batch_size: int) -> None:
    """``sample_mask``: 1-D, one finite non-negative weight per row."""
    import torch

    if not isinstance(sample_mask, torch.Tensor) or sample_mask.dim() != 1:
        raise ValueError(f"sample_mask must be a 1-D tensor of shape [{batch_size}], got {_shape(sample_mask)}")
    if sample_mask.shape[0] != batch_size:
        raise ValueError(f"sample_mask must have shape [{batch_size}] (one weight per row), got {_shape(sample_mask)}")
    if sample_mask.is_floating_point() and not bool(torch.isfinite(sample_mask).all()):
        raise ValueError("sample_mask must hold finite weights, got NaN or inf")
    if bool((sample_mask < 0).any()):
        raise ValueError("sample_mask must hold non-negative weights, got a negative one")


def check_token_mask(token_mask: torch.Tensor) -> None:
    import torch

    if not isinstance(token_mask, torch.Tensor) or token_mask.dim() != 2:
        raise ValueError(f"token_mask must be a 2-D tensor [B, S] like input_ids, got {_shape(token_mask)}")
    check_binary(token_mask, "token_mask")


def check_masks(token_mask: torch.Tensor, sample_mask: torch.Tensor) -> None:
    """Both masks on one device, then `check_token_mask` and `check_sample_mask` (one weight per row)."""
    import torch

    tensors = isinstance(token_mask, torch.Tensor) and isinstance(sample_mask, torch.Tensor)
    if tensors and token_mask.device != sample_mask.device:
        raise ValueError(
            f"token_mask is on {token_mask.device} but sample_mask on {sample_mask.device}: expected both on one device"
        )
    check_token_mask(token_mask)
    check_sample_mask(sample_mask, token_mask.shape[0])


def build_mtp_loss_mask(
    token_mask: torch.Tensor, sample_mask: torch.Tensor, model_or_config: ModelOrConfig
) -> torch.Tensor | None:
    """``token_mask [B, S] * sample_mask[:, None]`` as float32, or None when MTP is off.

    ``token_mask``: 1 on trained (response) tokens, 0 on prompt and padding, in the same [B, S]
    layout as ``input_ids`` and NOT shifted. ``sample_mask``: per-row weight, 0 drops the row.
    Both masks are validated even when MTP is off (a bad mask is a bug either way): ValueError.
    TypeError when ``model_or_config`` has no ``mtp_num_layers`` (see `config_of`).
    """
    import torch

    enabled = mtp_enabled(model_or_config)
    check_masks(token_mask, sample_mask)
    if not enabled:
        return None
    return token_mask.to(torch.float32) * sample_mask.to(torch.float32)[:, None]


def global_valid_tokens(token_mask: torch.Tensor, sample_mask: torch.Tensor, group: ProcessGroup | None = None) -> float:
    """``sum(token_mask[:, 1:] * sample_mask[:, None])`` over the data-parallel ranks, as a float.

    The first token of a row never is a target. When torch.distributed is initialised the sum is
    all-reduced over ``group``: by default megatron-core's data-parallel group when its model
    parallel state is initialised, else the default group. Every rank of that group must call it.
    """
    import torch

    check_masks(token_mask, sample_mask)
    total = (token_mask[:, 1:].to(torch.float64) * sample_mask.to(torch.float64)[:, None]).sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if group is None:
            group = _data_parallel_group()
        total = for_collective(total, group)
        torch.distributed.all_reduce(total, group=group)
    return float(total)


def _data_parallel_group() -> ProcessGroup | None:
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if parallel_state.model_parallel_is_initialized():
        group: ProcessGroup = parallel_state.get_data_parallel_group()
        return group
    return None


def _shape(value: object) -> list[int] | str:
    shape = getattr(value, "shape", None)
    return list(shape) if shape is not None else type(value).__name__
