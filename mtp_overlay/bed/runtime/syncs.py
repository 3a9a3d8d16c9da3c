"""Count the data-dependent host reads (device -> host syncs on a GPU) a block of code makes, by who made them.

On a GPU every read of a tensor's *values* on the host waits for the device to finish the work
queued before it: ``bool(t)``, ``t.item()``, ``int(t)``, a 0-dim tensor used as a slice bound or a
size (``x[:n]``, ``torch.arange(n)``: C++ converts it, no Python method is called), ``t.tolist()``,
``t.numpy()``, ``t.cpu()``, ``torch.equal``, and every op whose output *shape* depends on the values
(``nonzero``, ``torch.where(c)``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` with a tensor of repeats, ``bincount``), and ``torch.cuda.synchronize``. Megatron
keeps these out of its step; a hook that adds one per forward stalls the launch queue once per
microbatch. On the CPU test bed such a read costs nothing, so it is counted for what it would be on
a GPU: every tensor stands for a device tensor.

`SyncCounter` counts them where they happen, at the aten level: a ``TorchDispatchMode`` sees every op
dispatched in the block, from Python or from C++ (``aten._local_scalar_dense`` is what every scalar
read dispatches, whoever asked), and records the reading ones (`READING_OPS`, plus boolean-index
``index`` / ``index_put_``, tensor-sized ``repeat_interleave`` and copies to the host). The few reads
that dispatch nothing on a host tensor (``tolist``, ``numpy``, ``cpu``, ``to("cpu")``, ``repr``) are
counted at their Python entry points, once per outermost call (``repr(t)`` is one read, not the scalar
reads inside it). Each read is attributed to the innermost frame outside torch, wrapt and this module,
by its file:

* ``"overlay"``: ``mtp_overlay/`` product code (not ``mtp_overlay/bed/`` nor
  ``mtp_overlay/upstream_tests/``): what the overlay adds;
* ``"megatron"``: ``megatron/`` (megatron-core, Megatron-Bridge): stock's own;
* ``"test bed"``: ``mtp_overlay/bed/`` (the CPU stand-ins, the step's bookkeeping);
* ``"other"``: everything else (the caller, tests, other packages).

The counter also counts every aten op of the block (`SyncCounter.ops`, by origin and op; ``op_files``,
by origin and the file that called it): on a GPU each is a kernel launch or more. On CUDA
(``SyncCounter(device="cuda")``) only reads of device tensors count (a host tensor's read waits for nothing), and CUDA's own detector
(``torch.cuda.set_sync_debug_mode("warn")``) runs beside it: `cuda_syncs` holds what it reported, by
file, and the two must agree. A dispatch mode is per thread: the block's thread counts, the autograd
engine's backward of CPU work included (it runs on the caller's thread).

``torch._assert_async`` is not a read: on a GPU it queues a device-side check and returns.
"""

import collections
import contextlib
import dataclasses
import os
import sys
import threading
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mtp_overlay

ORIGINS = ("overlay", "megatron", "test bed", "other")
_PACKAGE = os.path.dirname(os.path.abspath(mtp_overlay.__file__)) + os.sep
_TEST_CODE = tuple(_PACKAGE + part + os.sep for part in ("bed", "upstream_tests"))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS = os.path.abspath(__file__)
_aten = torch.ops.aten
# aten ops that read values on the host whatever their arguments
READING_OPS = frozenset({
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique.default, _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default, _aten.equal.default, _aten.is_nonzero.default, _aten.allclose.default,
    _aten.bincount.default,
})
# Tensor methods that read on the host without dispatching anything for a host tensor
_HOST_METHODS = ("tolist", "numpy", "__array__", "cpu", "__repr__", "__str__", "__format__")
@dataclasses.dataclass(frozen=True)
class Sync:
    """One host read: what was called (``kind``, e.g. ``"Tensor.item"``), by whom (``origin``, one of
    ORIGINS) and where (``file``, ``line``, ``function`` of that frame)."""

    kind: str
    origin: str
    file: str
    line: int
    function: str

    def __str__(self):
        return f"{self.kind} at {self.file}:{self.line} ({self.function}, {self.origin})"


def origin_of(path):
    """ORIGINS entry of a source file path."""
    path = os.path.abspath(path)
    if path.startswith(_PACKAGE):
        return "test bed" if path.startswith(_TEST_CODE[0]) else "other" if path.startswith(_TEST_CODE[1]) else "overlay"
    parts = path.split(os.sep)
    return "megatron" if "megatron" in parts[:-1] else "other"


class SyncCounter:
    """``with SyncCounter() as syncs: ...`` records every host read of the block in ``syncs.events``
    and every aten op in ``syncs.ops``.

    Reusable: each ``with`` adds to the same record (`clear` empties it). One counter at a time in a
    process (entering a second is a RuntimeError). ``count(origin)``: how many reads ``origin`` made;
    ``overlay`` is ``count("overlay")``; `summary` groups them by origin, kind and place. device:
    ``"cpu"`` counts every read (each host tensor stands for a device tensor); ``"cuda"`` counts reads
    of device tensors and runs CUDA's own sync detector beside (`cuda_syncs`).
    """

    _active = None
    _lock = threading.Lock()

    def __init__(self, device: str = "cpu"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        self.events = []
        self.ops = collections.Counter()  # (origin, aten op name) -> calls
        self.op_files = collections.Counter()  # (origin, file of the innermost frame outside torch) -> calls
        self.cuda_syncs = collections.Counter()  # "file:line" -> syncs CUDA's detector reported
        self._saved = []
        self._local = threading.local()
        self._mode = None
        self._warnings = None

    # --- reading the record -------------------------------------------------------------------------
    def count(self, origin=None):
        return sum(1 for event in self.events if origin is None or event.origin == origin)

    @property
    def overlay(self):
        return self.count("overlay")

    def by_origin(self):
        return {origin: self.count(origin) for origin in ORIGINS}

    def of(self, origin):
        return [event for event in self.events if event.origin == origin]

    def summary(self, origin=None):
        """``{(origin, kind, "file:line"): count}`` of the record (of one origin)."""
        grouped = {}
        for event in self.events:
            if origin is None or event.origin == origin:
                key = (event.origin, event.kind, f"{event.file}:{event.line}")
                grouped[key] = grouped.get(key, 0) + 1
        return grouped

    def op_counts(self, origin=None):
        """``{aten op name: calls}`` of the block (made by one origin)."""
        counts = collections.Counter()
        for (who, name), calls in self.ops.items():
            if origin is None or who == origin:
                counts[name] += calls
        return counts

    def clear(self):
        self.events.clear()
        self.ops.clear()
        self.op_files.clear()
        self.cuda_syncs.clear()

    # --- counting -----------------------------------------------------------------------------------
    def __enter__(self):
        with SyncCounter._lock:
            if SyncCounter._active is not None:
                raise RuntimeError("a SyncCounter is already counting in this process: one at a time")
            SyncCounter._active = self
        wrapt = sys.modules.get("wrapt")  # its pure-Python wrappers, where the C extension is missing
        self._skipped = (_TORCH,) + ((os.path.dirname(os.path.abspath(wrapt.__file__)) + os.sep,) if wrapt else ())
        try:
            self._patch()
            if self.device == "cuda":
                self._warnings = warnings.catch_warnings(record=True)
                self._caught = self._warnings.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            self._mode = _ReadingOps(self)
            self._mode.__enter__()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
            if self._warnings is not None:
                torch.cuda.set_sync_debug_mode("default")
                for caught in self._caught:
                    if "synchronizing" in str(caught.message):
                        self.cuda_syncs[f"{caught.filename}:{caught.lineno}"] += 1
                self._warnings.__exit__(None, None, None)
                self._warnings = None
        finally:
            self._restore()
            SyncCounter._active = None

    def _frame(self, depth):
        """The innermost frame outside torch, wrapt and this module, from ``depth`` frames up."""
        frame = sys._getframe(depth)
        while frame is not None:
            path = frame.f_code.co_filename
            if not (path == _THIS or path.startswith(self._skipped) or path.startswith("<")):
                return frame
            frame = frame.f_back
        return None

    def _record(self, kind, depth=3):
        frame = self._frame(depth)
        if frame is None:
            self.events.append(Sync(kind, "other", "<unknown>", 0, "?"))
            return
        code = frame.f_code
        self.events.append(Sync(kind, origin_of(code.co_filename), code.co_filename, frame.f_lineno, code.co_name))

    def _dispatched(self, func, args, kwargs):
        """One aten op seen by the mode: counted, and recorded when it reads on the host."""
        frame = self._frame(3)
        path = "<unknown>" if frame is None else frame.f_code.co_filename
        origin = "other" if frame is None else origin_of(path)
        self.ops[(origin, func.name())] += 1
        self.op_files[(origin, path)] += 1
        if getattr(self._local, "depth", 0) or not _reads(func, args, kwargs):
            return
        if self.device == "cuda" and not _read_on_device(func, args, kwargs):
            return
        self._record(func.name(), depth=4)

    def _counted(self, kind, function, reads=None):
        """``function`` recording one read of ``kind`` per outermost call (``reads(*args, **kwargs)``
        decides when it is one; None: always); the ops it dispatches are not reads of their own."""
        local = self._local

        def counted(*args, **kwargs):
            if getattr(local, "depth", 0):
                return function(*args, **kwargs)
            if (reads is None or reads(*args, **kwargs)) and (self.device != "cuda" or _on_device(args[:1])):
                self._record(kind)
            local.depth = 1
            try:
                return self.attributing_cuda_syncs(function, *args, **kwargs)
            finally:
                local.depth = 0

        counted.__wrapped__ = function
        return counted

    def attributing_cuda_syncs(self, function, *args, **kwargs):
        """``function(*args, **kwargs)``; on CUDA, the syncs CUDA's detector reports inside it are
        recorded in `cuda_syncs` at the caller outside torch and this module (the detector's warning
        would name the frame that called into C++: ours)."""
        if self.device != "cuda":
            return function(*args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = function(*args, **kwargs)
        for warning in caught:
            if "synchroniz" in str(warning.message):
                frame = self._frame(2)
                place = "<unknown>:0" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
                self.cuda_syncs[place] += 1
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return out

    def _replace(self, owner, name, kind, reads=None):
        if name in vars(owner):
            self._saved.append((owner, name, vars(owner)[name]))
        else:
            self._saved.append((owner, name, None))
        setattr(owner, name, self._counted(kind, getattr(owner, name), reads))

    def _patch(self):
        for name in _HOST_METHODS:
            self._replace(torch.Tensor, name, f"Tensor.{name}")
        self._replace(torch.Tensor, "to", "Tensor.to", _to_host)
        self._replace(torch.cuda, "synchronize", "torch.cuda.synchronize")
        for owner in (getattr(torch.cuda, "Stream", None), getattr(torch.cuda, "Event", None)):
            if owner is not None:
                self._replace(owner, "synchronize", f"torch.cuda.{owner.__name__}.synchronize")
        if hasattr(getattr(torch, "accelerator", None), "synchronize"):
            self._replace(torch.accelerator, "synchronize", "torch.accelerator.synchronize")

    def _restore(self):
        while self._saved:
            owner, name, value = self._saved.pop()
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


class _ReadingOps(TorchDispatchMode):
    """The counter's view of every aten op dispatched in its thread."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counter._dispatched(func, args, kwargs)
        return self.counter.attributing_cuda_syncs(func, *args, **kwargs)


def _reads(func, args, kwargs):
    """Whether aten op ``func`` on these arguments reads values on the host."""
    if func in READING_OPS:
        return True
    packet = func.overloadpacket
    if packet in (_aten.index, _aten.index_put_, _aten.index_put, _aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices)
    if packet is _aten.repeat_interleave and func is not _aten.repeat_interleave.self_int:
        return kwargs.get("output_size") is None and isinstance(args[-1] if func is _aten.repeat_interleave.Tensor
                                                                else args[1], torch.Tensor)
    if packet is _aten._to_copy:
        target = kwargs.get("device")
        return target is not None and torch.device(target).type == "cpu" and args[0].device.type != "cpu"
    if packet is _aten.copy_:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu" and not (len(args) > 2 and args[2])
    return False


def _read_on_device(func, args, kwargs):
    """Whether the tensor whose values ``func`` reads lives on an accelerator (on CUDA, reading a host
    tensor waits for nothing): the indices of a boolean index, the repeats, the source of a copy,
    else the first argument."""
    packet = func.overloadpacket
    if packet in (_aten.index, _aten.index_put_, _aten.index_put, _aten._index_put_impl_):
        read = [index for index in (args[1] if len(args) > 1 else kwargs.get("indices", ())) if index is not None]
    elif packet is _aten.repeat_interleave:
        read = [args[-1] if func is _aten.repeat_interleave.Tensor else args[1]]
    elif packet is _aten.copy_:
        read = [args[1]]
    else:
        read = [args[0]] if args else []
    return _on_device(read)


def _on_device(tensors):
    """Whether any of ``tensors`` (other values ignored) lives on an accelerator."""
    return any(isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu" for tensor in tensors)


def _to_host(self, *args, **kwargs):
    """``Tensor.to(...)`` that targets the host."""
    device = kwargs.get("device")
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            device = arg
        elif isinstance(arg, torch.Tensor):
            device = arg.device
    return device is not None and torch.device(device).type == "cpu"


@contextlib.contextmanager
def checks_mode(mode):
    """``MTP_OVERLAY_CHECKS=mode`` for the block (None: unset), put back after."""
    from mtp_overlay.mtp.checks import VARIABLE

    saved = os.environ.get(VARIABLE)
    if mode is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = mode
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = saved
