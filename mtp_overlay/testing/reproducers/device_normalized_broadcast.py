"""device-normalized-broadcast on stock vLLM: its ``pack_tensors`` refuses a stream holding one
tensor off the communicator's device (on CPU: a host tensor next to a ``meta`` one)."""

import importlib

from mtp_overlay import registry
from mtp_overlay.fixes.device_normalized_broadcast import stock_packing_error


def reproduce():
    """Run stock ``pack_tensors`` (never hooked) on a host+meta stream."""
    packed_tensor = importlib.import_module(registry.get("device-normalized-broadcast").targets[0])
    if not hasattr(packed_tensor, "pack_tensors"):
        raise RuntimeError("this vLLM packs inside its producer, which runs only on CUDA streams")
    error = stock_packing_error(packed_tensor)
    return error is not None, f"stock pack_tensors on a host+meta stream: {error or 'packed it'}"
