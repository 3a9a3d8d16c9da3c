"""How the hot path checks what reaches it: ``MTP_OVERLAY_CHECKS``.

A hook runs on every forward of every microbatch. On a GPU, any check that reads a tensor's values
on the host (``bool(t.any())``, ``.item()``, ``.tolist()``, ``torch.equal``, ``.nonzero()``) waits
for the device to drain its queue first, once or more per microbatch: the pattern Megatron keeps out
of its step. So the hooks check in one of two modes:

* default (unset, empty or ``default``): no host read of a tensor per forward. What depends only
  on shapes, dtypes and devices is checked on the host as always (ValueError naming the argument).
  What depends on values runs on the device: ``torch._assert_async`` of the condition, queued with
  the work, no wait. A failed assert stops the run at the device's next sync: on CPU at once, as a
  RuntimeError carrying the message; on CUDA as "device-side assert triggered" (PyTorch drops the
  message there), after which the process cannot use the device again. The message, or the
  traceback's hook, says which check it was; ``MTP_OVERLAY_CHECKS=full`` reruns it with the detail.
* ``full``: every check on the host, each failure a ValueError naming the argument, the offending
  positions and what to do (the behaviour of earlier releases): one or more device syncs per
  forward. For debugging, or a first step on a new data pipeline.

A value that is neither warns (it starts with ``mtp-overlay``, an `OverlayWarning`) and the default
mode stays: a typo must not silently turn the checks up or down. The variable is read at each call,
so a test or a debugging session can switch modes in a running process.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from ..contract import OverlayWarning

if TYPE_CHECKING:  # annotations only: torch loads inside the functions
    import torch

VARIABLE = "MTP_OVERLAY_CHECKS"
DEFAULT, FULL = "default", "full"
MODES = (DEFAULT, FULL)
RERUN = f"{VARIABLE}={FULL} raises a ValueError with the detail"

_last: tuple[str, str] = ("", DEFAULT)  # (raw value, mode) of the last read


def mode() -> str:
    """The checking mode, ``"default"`` or ``"full"``, from ``MTP_OVERLAY_CHECKS`` (any case, spaces
    ignored); an unknown value warns once per value and gives ``"default"``."""
    global _last
    raw = os.environ.get(VARIABLE, "")
    if raw == _last[0]:
        return _last[1]
    value = raw.strip().lower()
    if value in ("", DEFAULT):
        found = DEFAULT
    elif value == FULL:
        found = FULL
    else:
        warnings.warn(OverlayWarning(
            f"mtp-overlay: {VARIABLE}={raw!r} is not one of {', '.join(MODES)}: the {DEFAULT} mode stays "
            "(no host read per forward; value checks run on the device)"), stacklevel=3)
        found = DEFAULT
    _last = (raw, found)
    return found


def full() -> bool:
    """Whether every check runs on the host (``MTP_OVERLAY_CHECKS=full``)."""
    return mode() == FULL


def device_assert(condition: torch.Tensor, message: str) -> None:
    """Queue the check that ``condition`` (a bool tensor, one element) holds, without a host read.

    ``message`` says what is wrong, naming the argument; the text is the RuntimeError's on CPU.
    """
    import torch

    torch._assert_async(condition, f"mtp-overlay: {message} ({RERUN})")
