"""Test scaffolding, not product: run vLLM's weight-transfer producer and consumer without CUDA.

``host_streams()`` turns the CUDA streams and events they order their work on into no-ops (every host
op is synchronous); the communicators stand in for vLLM's PyNcclCommunicator (a ``device`` and a
``broadcast``). torch and vLLM are imported inside the functions.

`HostStream` / `HostEvent` are also what the CPU shims give megatron-core for its CUDA streams (`cpu_shims`).

* ``accelerator_synchronize_stand_in()``: ``WeightTransferEngine.update_weights`` ends with
  ``torch.accelerator.synchronize()`` (vLLM 0.33 ``distributed/weight_transfer/base.py:598``,
  0.25.1 ``:182``), which raises "Found no NVIDIA driver" on a machine without one: inside the block
  it returns at once (host copies are done when they return), and only on a CPU rank (`device.rank_device`).
"""

import contextlib

from .device import rank_device
from .shim import Shim, swapped


class HostStream:
    """A CUDA stream on the host: work is synchronous, so there is nothing to wait for."""

    def synchronize(self):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return HostEvent()


class HostEvent:
    """A CUDA event on the host: already complete."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


@contextlib.contextmanager
def host_streams(module=None):
    """Within it, vLLM's packed producer and consumer use `HostStream` and `HostEvent` (CUDA or not).

    ``module``: where the producer looks up ``_get_streams`` (vLLM's ``packed_tensor`` unless given).
    """
    import importlib
    from unittest import mock

    import torch

    stream = HostStream()
    if module is None:
        from mtp_overlay import declarations

        module = importlib.import_module(declarations.load("device-normalized-broadcast").target("packed_tensor"))
    replacements = [
        (torch.cuda, "Stream", lambda *args, **kwargs: stream),  # vLLM 0.25.1 makes its streams directly
        (torch.accelerator, "current_device_index", lambda: 0),
        (torch.accelerator, "current_stream", lambda device=None: stream),
        (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
        (torch.cuda, "current_stream", lambda device=None: stream),
        (torch, "Event", HostEvent),
        (torch.Tensor, "record_stream", lambda tensor, s: None),
    ]
    if hasattr(module, "_get_streams"):  # the pinned vLLM (0.33) caches them
        replacements.append((module, "_get_streams", lambda index, count: (stream,) * count))
    with contextlib.ExitStack() as stack:
        for owner, attribute, value in replacements:
            stack.enter_context(mock.patch.object(owner, attribute, value))
        yield


class HostCommunicator:
    """PyNcclCommunicator's surface without NCCL: the ``device`` it works on, a broadcast that does nothing."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)

    def broadcast(self, tensor, src, stream=None):
        pass


class RecordingCommunicator(HostCommunicator):
    """A `HostCommunicator` whose sender-side broadcast keeps what it is handed in ``sent``
    (PyNcclCommunicator would assert it is on ``device``)."""

    def __init__(self, device):
        super().__init__(device)
        self.sent = []

    def broadcast(self, tensor, src, stream=None):
        self.sent.append(tensor)


class ReplayCommunicator(HostCommunicator):
    """The receiving end of a `RecordingCommunicator`: each broadcast fills the buffer it is handed
    with the next buffer the sender broadcast (the wire, on the host)."""

    def __init__(self, sent, device):
        super().__init__(device)
        self._sent = iter(sent)

    def broadcast(self, tensor, src, stream=None):
        source = next(self._sent, None)
        if source is None:
            raise ValueError("the receiver asked for more buffers than the sender broadcast")
        if (source.shape, source.dtype) != (tensor.shape, tensor.dtype):
            raise ValueError(f"receive buffer {tuple(tensor.shape)} {tensor.dtype} does not match the sent "
                             f"{tuple(source.shape)} {source.dtype}: sender and receiver disagree on the metadata")
        tensor.copy_(source)


@contextlib.contextmanager
def accelerator_synchronize_stand_in():
    """Inside the block ``torch.accelerator.synchronize`` returns at once on a CPU rank (`device.rank_device`).

    vLLM's ``WeightTransferEngine.update_weights`` synchronizes the device after every chunk so the
    next step reads the new weights (0.33 ``distributed/weight_transfer/base.py:598``); the CUDA
    build of torch raises there without a driver. On the host every copy into a parameter has
    finished when it returns, so there is nothing to wait for. On a CUDA rank the real function stays.
    """
    import torch

    if rank_device().type == "cuda":
        yield
        return

    def synchronize(device=None):
        return None

    with swapped([Shim(torch.accelerator, "synchronize", synchronize)]):
        yield
