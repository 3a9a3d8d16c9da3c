"""Scope ``config.mtp_grad_scale_func`` to one training step.

megatron-core 0.19+ reads ``config.mtp_grad_scale_func`` (``_get_mtp_loss_scale`` in
``pipeline_parallel/schedules.py``) to scale the MTP loss gradient. With per-token losses the RL
trainer normalises by the global number of valid target tokens; the callable must not outlive the
step, or it lands in a saved config.
"""

from __future__ import annotations

import contextlib

from ..contract import distribution_version
from .config import FIRST_RELEASE
from .mask import config_of, global_valid_tokens

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: torch loads inside the functions
    from collections.abc import Iterator

    import torch
    from torch.distributed import ProcessGroup

    from .mask import ModelOrConfig


@contextlib.contextmanager
def mtp_grad_scale(
    model_or_config: ModelOrConfig,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    group: ProcessGroup | None = None,
) -> Iterator[float]:
    """Within the block ``config.mtp_grad_scale_func() == 1 / max(global_valid_tokens, 1)``.

    ``global_valid_tokens`` = ``sum(token_mask[:, 1:] * sample_mask[:, None])`` all-reduced over the
    data-parallel ``group`` (see `global_valid_tokens`). Needs ``calculate_per_token_loss=True``.
    The function is reset to None on exit, exceptions included. Yields the token count.
    """
    config = config_of(model_or_config)
    if not hasattr(config, "mtp_grad_scale_func"):
        raise ValueError(
            f"{type(config).__name__} has no mtp_grad_scale_func field: megatron-core {distribution_version('megatron-core')} "
            f"predates it (added in {FIRST_RELEASE['mtp_grad_scale_func']})"
        )
    if not getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "mtp_grad_scale needs config.calculate_per_token_loss=True: without it megatron-core divides "
            "each microbatch's MTP loss by its own token count and by num_microbatches already"
        )
    valid_tokens = global_valid_tokens(token_mask, sample_mask, group)
    scale = 1.0 / max(valid_tokens, 1.0)
    config.mtp_grad_scale_func = lambda: scale
    try:
        yield valid_tokens
    finally:
        config.mtp_grad_scale_func = None
