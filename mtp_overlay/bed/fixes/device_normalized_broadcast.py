"""device-normalized-broadcast on stock vLLM: its packed weight-refit producer fails on a stream
holding one tensor off the communicator's device (on CPU: a host tensor among ``meta`` ones, the
communicator on ``meta``).

The producer itself runs (vLLM's, never hooked: the fix is off here), so a vLLM whose producer
normalizes devices, a source-patched one included, reads as redundant.
"""

import importlib

from mtp_overlay import declarations
from mtp_overlay.calls import original

from ..runtime.streams import RecordingCommunicator, host_streams


def reproduce():
    from mtp_overlay.fixes.device_normalized_broadcast import PRODUCERS

    packed_tensor = importlib.import_module(declarations.load("device-normalized-broadcast").target("packed_tensor"))
    name = next((name for name in PRODUCERS if name in vars(packed_tensor)), None)
    if name is None:
        raise RuntimeError(f"{packed_tensor.__name__} has none of the producers {PRODUCERS}")
    error = stock_producer_error(packed_tensor, original(vars(packed_tensor)[name]))
    return error is not None, f"stock {name} on a host+meta stream to a meta communicator: {error or 'sent it'}"


def stock_producer_error(packed_tensor, producer):
    """What ``producer`` raises on a tiny host+meta stream for a communicator on ``meta``, or None."""
    import torch

    stream = [("host_constant", torch.zeros(2)), ("on_device", torch.zeros(2, device="meta"))]
    with host_streams(packed_tensor):
        try:
            producer(iter(stream), RecordingCommunicator("meta"), 0, lambda item: item[1], buffer_size_bytes=1 << 20)
        except RuntimeError as exc:
            return str(exc)
    return None
