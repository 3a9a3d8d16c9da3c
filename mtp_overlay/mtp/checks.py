"""How the hot path checks what reaches it: ``MTP_OVERLAY_CHECKS``.

A hook runs on every forward of every microbatch. On a GPU, any check that reads a tensor's values
on the host (``bool(t.any())``, ``.item()``, ``.tolist()``, ``torch.equal``, ``.nonzero()``) waits
for the device to drain its queue first, once or more per microbatch: the pattern Megatron keeps out
of its step. So the hooks check in one of two modes:

* default (unset, empty or ``default``): no host read of a tensor per forward. What depends only
  on shapes, dtypes and devices is checked on the host as always (ValueError naming the argument).
  What depends on values runs on the device: ``torch._assert_async`` of the condition, queued with
  the work, no wait. A failed assert stops the run at the device's next sync: on CPU at once, as a
  RuntimeError carrying the message; on CUDA the message goes to the process's stderr only (the
  kernel prints it), Python sees ``RuntimeError: CUDA error: device-side assert triggered`` at the
  next sync, and the process cannot use the device again. The message names the check in a few
  words; ``MTP_OVERLAY_CHECKS=full`` reruns it with the detail (positions, what to do). A check
  fails on the ranks that hold what it refuses (under CP, the rank whose chunk holds a weighted
  padding slot); the others wait in their next collective until the launcher ends the job
  (torchrun when a rank exits; NCCL's timeout otherwise): no collective is added to tell them.
  The message is short by rule: CUDA copies it into a 256-byte buffer and refuses one of 255 bytes
  or more when the assert is *queued*, whatever the condition (PyTorch PR #134813; MPS: under 250),
  so every message, prefix included, stays under `MESSAGE_LIMIT` bytes.
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

from ..contract import OverlayWarning

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: torch loads inside the functions
    import torch

VARIABLE = "MTP_OVERLAY_CHECKS"
DEFAULT, FULL = "default", "full"
MODES = (DEFAULT, FULL)
RERUN = f"{VARIABLE}={FULL} for detail"
MESSAGE_LIMIT = 200  # bytes a queued message may have, prefix included (CUDA refuses 255+, MPS 250+)

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

    ``message`` says what is wrong in a few words, naming the argument (the detail is the ``full``
    mode's); with the prefix and `RERUN` it stays under `MESSAGE_LIMIT` bytes (the suite's test bed
    enforces CUDA's rule on CPU). The text is the RuntimeError's on CPU, stderr's on CUDA.
    """
    import torch

    torch._assert_async(condition, f"mtp-overlay: {message} ({RERUN})")
