"""Which device the test bed's processes use, and the CUDA rules it enforces on CPU.

The one home of device choices in the test bed:

* `rank_device`: the device every builder and step of a rank uses, set once by the launcher from the
  rank's setup (`set_rank_device`); the CPU in any process no launcher set up.

* CPU ranks, and the preloaded server they fork from, run with CUDA hidden from their start
  (`HIDE_CUDA`): no probe, upstream's or ours, can reach a GPU there. PyTorch's rule is that nothing
  may touch CUDA in a process before a fork whose child will: on a GPU host, triton's
  ``driver.is_active()`` calls ``torch.cuda.is_available()`` (triton PR #10614), which runs
  ``cudaGetDeviceCount`` (``cuInit``) unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and flashinfer
  initialises CUDA at import (flashinfer #4889); a child forked after that gets "Cannot re-initialize
  CUDA in forked subprocess", or "CUDA error: initialization error" from CPU code that merely asks
  (Adam's ``_accelerator_graph_capture_health_check``). With ``CUDA_VISIBLE_DEVICES`` empty and the
  NVML-based check, ``torch.cuda.is_available()`` answers False from the environment, without cuInit.
* CUDA ranks are spawned (`preloaded.rank_context`): a fresh interpreter that initialises CUDA itself.
* `emulate_cuda_asserts`: ``torch._assert_async`` with a message of 255 bytes or more raises on CPU
  as it does on CUDA, where the message is copied into a 256-byte buffer and refused when the assert
  is queued, whatever the condition (PyTorch PR #134813, ``aten/src/ATen/native/cuda/TensorCompare.cu``).
  The suite and every CPU rank run with it, so a long message fails on CPU as it would on a GPU.
"""

import threading

DEVICES = ("cpu", "cuda")
# the environment of a process that must never touch CUDA (and whose forks may): CUDA hidden, and
# torch.cuda.is_available() answered from NVML / the environment instead of cuInit
HIDE_CUDA = {"CUDA_VISIBLE_DEVICES": "", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
CUDA_MESSAGE_LIMIT = 255  # bytes: CUDA refuses a device-assert message of this length or more
_lock = threading.Lock()
_rank_device = ["cpu"]  # this process's device: "cpu" unless the launcher set "cuda" (`set_rank_device`)
_longest = [0, ""]  # the longest assert message queued under the emulation: [bytes, text]


def check_device(device: str) -> str:
    """``device`` if it is one of `DEVICES`; else a ValueError naming them."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    return device


def set_rank_device(device: str) -> None:
    """Record this rank's device (the launcher, once, from the rank's setup); builders and steps read it."""
    _rank_device[0] = check_device(device)


def rank_device():
    """The ``torch.device`` this process builds and steps on: the CPU, or this rank's current CUDA device."""
    import torch

    if _rank_device[0] == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def emulate_cuda_asserts() -> None:
    """Make ``torch._assert_async`` refuse a message of `CUDA_MESSAGE_LIMIT` bytes or more, as CUDA
    does, and record the longest message queued (`longest_assert_message`). Idempotent."""
    import torch

    with _lock:
        if getattr(torch._assert_async, "_mtp_overlay_cuda_rule", False):
            return
        upstream = torch._assert_async

        def assert_async(condition, message=None):
            if message is not None:
                size = len(message.encode())
                if size > _longest[0]:
                    _longest[:] = [size, message]
                if size >= CUDA_MESSAGE_LIMIT:
                    raise RuntimeError(f"Message length must be smaller than {CUDA_MESSAGE_LIMIT} "
                                       f"(CUDA's rule, emulated on CPU; {size} bytes: {message!r})")
                return upstream(condition, message)
            return upstream(condition)

        assert_async._mtp_overlay_cuda_rule = True
        assert_async.__wrapped__ = upstream
        torch._assert_async = assert_async


def longest_assert_message() -> tuple[int, str]:
    """(bytes, text) of the longest ``torch._assert_async`` message queued under the emulation."""
    return _longest[0], _longest[1]
