"""Count the data-dependent host reads (device -> host syncs on a GPU) a block of code makes, by who made them.

On a GPU every read of a tensor's *values* on the host waits for the device to finish the work
queued before it: ``bool(t)``, ``t.item()``, ``t.tolist()``, ``int(t)``, ``float(t)``, using ``t``
as an index, ``t.numpy()``, ``t.cpu()`` / ``t.to("cpu")``, ``torch.equal``, ``torch.allclose``, and
every op whose output *shape* depends on the values (``nonzero``, ``argwhere``, ``torch.where(c)``,
boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` with a tensor of
repeats, ``bincount``), a factory sized by a tensor (``torch.arange(t)``), printing a tensor, and
``torch.cuda.synchronize`` / stream and event ``synchronize``. Megatron keeps these out of its step;
a hook that adds one per forward stalls the launch queue once per microbatch. On the CPU test bed
such a read costs nothing, so it is counted for what it would be on a GPU: every tensor stands for
a device tensor (``.to("cpu")`` of a tensor already on the host counts too).

`SyncCounter` patches those entry points for the length of a ``with`` block (process-wide: every
thread's reads count, the autograd engine's backward included) and records each read once, at the
outermost counted call (``repr(t)`` is one read, not the ``item()`` calls inside it). Each read is
attributed to the innermost frame outside torch, wrapt and this module, by its file:

* ``"overlay"``: ``mtp_overlay/`` product code (not ``mtp_overlay/testing/`` nor
  ``mtp_overlay/upstream_tests/``): what the overlay adds;
* ``"megatron"``: ``megatron/`` (megatron-core, Megatron-Bridge): stock's own;
* ``"test bed"``: ``mtp_overlay/testing/`` (the CPU stand-ins, the step's bookkeeping);
* ``"other"``: everything else (the caller, tests, other packages).

``torch._assert_async`` is not a read: on a GPU it queues a device-side check and returns.
"""

import contextlib
import dataclasses
import os
import sys
import threading

import torch

import mtp_overlay

ORIGINS = ("overlay", "megatron", "test bed", "other")
_PACKAGE = os.path.dirname(os.path.abspath(mtp_overlay.__file__)) + os.sep
_TEST_CODE = tuple(_PACKAGE + part + os.sep for part in ("testing", "upstream_tests"))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS = os.path.abspath(__file__)
# Tensor methods that read values on the host whatever their arguments
_METHODS = ("__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist", "numpy", "__array__",
            "__repr__", "__str__", "__format__", "nonzero", "argwhere", "masked_select", "unique",
            "unique_consecutive", "bincount", "equal", "allclose", "is_nonzero", "__contains__", "cpu")
# torch functions of that kind
_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "equal",
              "allclose", "is_nonzero")
# factories whose size is read from a tensor argument
_FACTORIES = ("arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "linspace", "eye")


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
    """``with SyncCounter() as syncs: ...`` records every host read of the block in ``syncs.events``.

    Reusable: each ``with`` adds to the same record (`clear` empties it). One counter at a time in a
    process (entering a second is a RuntimeError). ``count(origin)``: how many reads ``origin`` made;
    ``overlay`` is ``count("overlay")``; `summary` groups them by origin, kind and place.
    """

    _active = None
    _lock = threading.Lock()

    def __init__(self):
        self.events = []
        self._saved = []
        self._local = threading.local()

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

    def clear(self):
        self.events.clear()

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
        except BaseException:
            self._restore()
            SyncCounter._active = None
            raise
        return self

    def __exit__(self, *exc):
        self._restore()
        SyncCounter._active = None

    def _record(self, kind):
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if not (path == _THIS or path.startswith(self._skipped) or path.startswith("<")):
                break
            frame = frame.f_back
        if frame is None:
            self.events.append(Sync(kind, "other", "<unknown>", 0, "?"))
            return
        code = frame.f_code
        self.events.append(Sync(kind, origin_of(code.co_filename), code.co_filename, frame.f_lineno, code.co_name))

    def _counted(self, kind, function, reads=None):
        """``function`` recording one read of ``kind`` per outermost call (``reads(*args, **kwargs)``
        decides when it is one; None: always)."""
        local = self._local

        def counted(*args, **kwargs):
            if getattr(local, "depth", 0):
                return function(*args, **kwargs)
            if reads is None or reads(*args, **kwargs):
                self._record(kind)
            local.depth = 1
            try:
                return function(*args, **kwargs)
            finally:
                local.depth = 0

        counted.__wrapped__ = function
        return counted

    def _replace(self, owner, name, kind, reads=None):
        if name in vars(owner):
            self._saved.append((owner, name, vars(owner)[name]))
        else:
            self._saved.append((owner, name, None))
        setattr(owner, name, self._counted(kind, getattr(owner, name), reads))

    def _patch(self):
        tensor = torch.Tensor
        for name in _METHODS:
            self._replace(tensor, name, f"Tensor.{name}")
        self._replace(tensor, "to", "Tensor.to", _to_host)
        self._replace(tensor, "repeat_interleave", "Tensor.repeat_interleave", _tensor_repeats_method)
        self._replace(tensor, "__getitem__", "Tensor.__getitem__", _boolean_index)
        self._replace(tensor, "__setitem__", "Tensor.__setitem__", _boolean_index)
        for name in _FUNCTIONS:
            self._replace(torch, name, f"torch.{name}")
        self._replace(torch, "where", "torch.where", lambda *args, **kwargs: len(args) + len(kwargs) == 1)
        self._replace(torch, "repeat_interleave", "torch.repeat_interleave", _tensor_repeats)
        for name in _FACTORIES:
            self._replace(torch, name, f"torch.{name}", _sized_by_tensor)
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


def _to_host(self, *args, **kwargs):
    """``Tensor.to(...)`` that targets the host."""
    device = kwargs.get("device")
    for arg in args:
        if isinstance(arg, (str, torch.device)):
            device = arg
        elif isinstance(arg, torch.Tensor):
            device = arg.device
    return device is not None and torch.device(device).type == "cpu"


def _tensor_repeats(input, repeats=None, dim=None, *, output_size=None):
    """``torch.repeat_interleave`` sized by a tensor: tensor repeats without ``output_size``, or the
    one-argument form (``input`` is the repeats)."""
    if repeats is None:
        return True
    return isinstance(repeats, torch.Tensor) and output_size is None


def _tensor_repeats_method(self, repeats, dim=None, *, output_size=None):
    return isinstance(repeats, torch.Tensor) and output_size is None


def _boolean_index(self, index, *value):
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8) for part in parts)


def _sized_by_tensor(*args, **kwargs):
    sizes = args + tuple(kwargs.get(name) for name in ("size", "end", "start", "steps", "n", "high", "low"))
    for size in sizes:
        if isinstance(size, torch.Tensor) or (isinstance(size, (tuple, list)) and any(isinstance(s, torch.Tensor) for s in size)):
            return True
    return False


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
