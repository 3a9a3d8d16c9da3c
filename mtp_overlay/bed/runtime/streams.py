"""Test scaffolding, not product: run vLLM's weight-transfer producer and consumer without CUDA.

``host_streams()`` turns the CUDA streams and events they order their work on into no-ops (every host
op is synchronous); the communicators stand in for vLLM's PyNcclCommunicator (a ``device`` and a
``broadcast``). torch and vLLM are imported inside the functions.
"""

import contextlib


class HostStream:
    """A CUDA stream on the host: nothing to wait for."""

    def synchronize(self):
        pass

    def wait_event(self, event):
        pass


class HostEvent:
    """A CUDA event on the host: nothing to record."""

    def record(self, stream=None):
        pass


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
