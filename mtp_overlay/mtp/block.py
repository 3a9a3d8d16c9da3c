"""Whether a model forward runs its MTP block: the trainer's word, read by fix mtp-logprob-skip.

An RL step runs forwards that can never train the MTP head (the reference and old policies'
logprobs). With ``import mtp_overlay`` (fix ``mtp-logprob-skip``) GPTModel/HybridModel forwards run
under ``torch.no_grad()`` skip their MTP block; `mtp_block_scope` says otherwise for a block of code.
"""

from __future__ import annotations

import contextlib
import contextvars

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator

_SCOPED_RUN: contextvars.ContextVar[bool | None] = contextvars.ContextVar("mtp_overlay_scoped_mtp_block", default=None)


@contextlib.contextmanager
def mtp_block_scope(run: bool) -> Iterator[None]:
    """Within the block, GPTModel/HybridModel forwards run their MTP block (``run=True``) or skip it
    (``run=False``), whatever the grad mode.

    Without a scope (fix ``mtp-logprob-skip`` installed) a forward skips the block exactly when grad
    is disabled. ``run=False``: a logprob forward that keeps grad enabled (its logits are
    bit-identical to stock's; no MTP loss, no MTP metric). ``run=True``: the opt-out, for a no-grad
    forward that wants the MTP metrics a train-mode forward records (evaluation that logs MTP loss
    and acceptance under ``torch.no_grad()``, a forward hook on the MTP block); disabling the fix
    (``MTP_OVERLAY_DISABLE=mtp-logprob-skip``) opts out everywhere. Scoped through a ContextVar:
    threads and asyncio tasks each see their own. TypeError unless ``run`` is a bool.
    """
    if not isinstance(run, bool):
        raise TypeError(f"mtp_block_scope(run=...) must be a bool, got {run!r}")
    token = _SCOPED_RUN.set(run)
    try:
        yield
    finally:
        _SCOPED_RUN.reset(token)


def scoped_mtp_block() -> bool | None:
    """The innermost `mtp_block_scope`'s ``run``, or None outside every scope."""
    return _SCOPED_RUN.get()
