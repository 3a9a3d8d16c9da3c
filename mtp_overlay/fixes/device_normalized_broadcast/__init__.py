"""device-normalized-broadcast: a vLLM weight-refit producer sends every tensor from the communicator's device.

vLLM's NCCL weight transfer packs each (name, tensor) of the trainer's export stream into one uint8
buffer with ``torch.cat`` (``packed_tensor.pack_tensors``, called by ``packed_nccl_broadcast_producer``;
``packed_broadcast_producer`` in older vLLM) and broadcasts it; the unpacked path of
``NCCLTrainerWeightTransferEngine._broadcast`` (vLLM 0.25.1: the staticmethod
``NCCLWeightTransferEngine.trainer_send_weights``) sends tensors one by one. One host tensor in the stream
(a non-learnable constant that never followed ``.to(device)``: an audio filterbank, image-normalization
statistics) makes ``torch.cat`` refuse mixed devices, and an all-host chunk fails the communicator's
device check. Found in NeMo-RL weight refit; no vLLM release normalizes devices.

The producer owns its buffer's device: a tensor elsewhere (host, another accelerator index) is moved
to the communicator's device; a tensor already there passes through untouched (no copy, no sync).
Names, shapes, dtypes and bytes are unchanged. Every module binding of the producer is wrapped (the
engine imports it by name), and `to_device_stream` does the same for trainers running their own
producer (NeMo-RL's ``nemo_rl.utils.packed_tensor.packed_broadcast_producer``).
"""

import importlib

from ...calls import argument, with_argument
from ...contract import Marker, State, Verdict, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from types import ModuleType
    from typing import Any

PRODUCERS = ("packed_nccl_broadcast_producer", "packed_broadcast_producer")  # vLLM 0.33.0, older vLLM
PRODUCER_PARAMETERS = ("iterator", "group", "src", "post_iter_func")  # every producer starts so (the probe checks)
GROUP, POST_ITER_FUNC = PRODUCER_PARAMETERS.index("group"), PRODUCER_PARAMETERS.index("post_iter_func")
PACK_PARAMETERS = ("iterator", "post_iter_func", "buffer_size_bytes")
ONE_BY_ONE_PATHS = (  # (class, method, its parameters): vLLM 0.33.0, vLLM 0.25.1
    ("NCCLTrainerWeightTransferEngine", "_broadcast", ("self", "source", "meta")),
    ("NCCLWeightTransferEngine", "trainer_send_weights", ("iterator", "trainer_args")),
)


def canonical_device(device: "Any") -> "Any":
    """``device`` as torch names its tensors (``"cuda"`` -> ``cuda:<current index>``); checks it is usable."""
    import torch

    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, str or int, got {type(device).__name__}: {device!r}")
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError) as exc:  # a CPU-only torch asserts for "cuda"
        raise ValueError(f"device {device!r} is not a device this process can allocate on: {exc}") from exc


def on_device(tensor: "Any", device: "Any") -> "Any":
    """``tensor`` itself when it already lives on ``device`` (canonical), else its copy there."""
    return tensor if tensor.device == device else tensor.to(device)


def to_device_stream(named_tensors: "Iterable[tuple[str, Any]]", device: "Any") -> "Iterator[tuple[str, Any]]":
    """Yield each ``(name, tensor)`` of ``named_tensors`` with its tensor on ``device``.

    For trainers that run their own producer: wrap the export stream before packing. Lazy, one pair
    at a time; a tensor already on ``device`` is yielded as it is (same object, no copy).
    """
    device = canonical_device(device)
    try:
        pairs = iter(named_tensors)
    except TypeError:
        raise TypeError(
            f"named_tensors must be an iterable of (name, tensor) pairs, got {type(named_tensors).__name__}"
        ) from None
    return _pairs_on_device(pairs, device)


def _pairs_on_device(pairs: "Iterator[Any]", device: "Any") -> "Iterator[tuple[str, Any]]":
    import torch

    for index, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_tensors[{index}] must be a (name, tensor) pair, got {pair!r:.200}")
        yield pair[0], on_device(pair[1], device)


def communicator_device(group: "Any") -> "Any":
    """The communicator's device (vLLM's PyNcclCommunicator has ``device``), else the current
    accelerator device the producer's streams use; None when there is neither."""
    import torch

    device = getattr(group, "device", None)
    if device is not None:
        return canonical_device(device)
    if torch.accelerator.is_available():
        return canonical_device(torch.accelerator.current_accelerator())
    return None


def normalizing_producer(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                         kwargs: "dict[str, Any]") -> "Any":
    """vLLM's packed producer; what ``post_iter_func`` hands to the buffer is on the communicator's device."""
    device = communicator_device(argument(args, kwargs, GROUP, "group"))
    if device is not None:
        post_iter_func = argument(args, kwargs, POST_ITER_FUNC, "post_iter_func")
        args, kwargs = with_argument(args, kwargs, POST_ITER_FUNC, "post_iter_func",
                                     lambda item: on_device(post_iter_func(item), device))
    return wrapped(*args, **kwargs)


class SourceOnDevice:
    """A vLLM WeightSource whose ``iter_full()`` yields its tensors on ``device``; the rest is delegated."""

    def __init__(self, source: "Any", device: "Any") -> None:
        self._source, self._device = source, device

    def iter_full(self) -> "Iterator[tuple[str, Any]]":
        return to_device_stream(self._source.iter_full(), self._device)

    def __getattr__(self, name: str) -> "Any":
        return getattr(self._source, name)


def normalizing_engine_broadcast(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                 kwargs: "dict[str, Any]") -> "Any":
    """``NCCLTrainerWeightTransferEngine._broadcast`` on a source normalized to its communicator's
    device: covers the one-by-one path (and the packed one) whatever the producer binding."""
    group = getattr(instance, "model_update_group", None)
    if not instance.is_sender or group is None:
        return wrapped(*args, **kwargs)
    device = communicator_device(group)
    if device is None:
        return wrapped(*args, **kwargs)
    args, kwargs = with_argument(args, kwargs, 0, "source", SourceOnDevice(argument(args, kwargs, 0, "source"), device))
    return wrapped(*args, **kwargs)  # (self,) source, meta: the probe checks


def normalizing_trainer_send_weights(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                     kwargs: "dict[str, Any]") -> "Any":
    """vLLM 0.25.1's ``NCCLWeightTransferEngine.trainer_send_weights`` (the staticmethod holding the
    one-by-one path) on a copy of ``trainer_args`` whose ``post_iter_func`` (default ``item[1]``, as
    vLLM's) returns tensors on the communicator's device; the packed path calls the hooked producer."""
    import dataclasses

    trainer_args = argument(args, kwargs, 1, "trainer_args")  # (iterator, trainer_args): the probe checks
    is_dict = isinstance(trainer_args, dict)
    if not (is_dict or dataclasses.is_dataclass(trainer_args)):
        return wrapped(*args, **kwargs)  # vLLM's own error
    fields = trainer_args if is_dict else vars(trainer_args)
    device = communicator_device(fields.get("group"))
    if device is None:
        return wrapped(*args, **kwargs)
    post_iter_func = fields.get("post_iter_func") or (lambda item: item[1])
    normalized = {"post_iter_func": lambda item: on_device(post_iter_func(item), device)}
    normalized_args = {**trainer_args, **normalized} if is_dict else dataclasses.replace(trainer_args, **normalized)
    args, kwargs = with_argument(args, kwargs, 1, "trainer_args", normalized_args)
    return wrapped(*args, **kwargs)


ONE_BY_ONE_WRAPPERS = {
    "_broadcast": normalizing_engine_broadcast,
    "trainer_send_weights": normalizing_trainer_send_weights,
}


def one_by_one_path(module: "ModuleType") -> "tuple[type, str, tuple[str, ...]] | None":
    """``(class, method, expected parameters)`` of the one-by-one path ``module`` defines, or None."""
    for class_name, method, parameters in ONE_BY_ONE_PATHS:
        owner = getattr(module, class_name, None)
        if owner is not None and method in vars(owner):
            return owner, method, parameters
    return None


def _parameters(function: "Callable[..., Any]") -> "tuple[str, ...]":
    import inspect

    return tuple(inspect.signature(function).parameters)


def _producer_drift(module: "ModuleType") -> "str | None":
    """Why the producer bindings of ``module`` no longer fit the hook, or None."""
    for name in PRODUCERS:
        function = vars(module).get(name)
        if function is not None and _parameters(function)[:4] != PRODUCER_PARAMETERS:
            return f"{name}{_parameters(function)} no longer starts with {PRODUCER_PARAMETERS}"
    return None


def stock_packing_error(packed_tensor: "ModuleType") -> "str | None":
    """What the real ``pack_tensors`` raises on a tiny host+meta stream; None when it packs it."""
    import torch

    stream = iter([("host", torch.zeros(2)), ("on_device", torch.zeros(2, device="meta"))])
    try:
        packed_tensor.pack_tensors(stream, lambda item: item[1], 1 << 20)
    except RuntimeError as exc:
        return str(exc)
    return None


def stock_packing_verdict(packed_tensor: "ModuleType") -> Verdict:
    """Needed when stock ``pack_tensors`` refuses a host+meta stream, redundant when it packs it."""
    pack = getattr(packed_tensor, "pack_tensors", None)
    if pack is None:
        return needed("no pack_tensors to probe (older vLLM packs in the producer); none normalizes devices")
    if _parameters(pack)[:3] != PACK_PARAMETERS:
        return drifted(f"pack_tensors{_parameters(pack)} no longer starts with {PACK_PARAMETERS}")
    error = stock_packing_error(packed_tensor)
    if error is None:
        return redundant("stock pack_tensors packs a host+meta stream: vLLM normalizes devices itself")
    if "device" not in error:  # a platform error (no driver, no memory...) says nothing about the bug
        return Verdict(State.FAILED, f"stock pack_tensors failed on a host+meta stream for another reason: {error}")
    return needed(f"stock pack_tensors refuses a host+meta stream: {error}")


class DeviceNormalizedBroadcastFix(Fix):
    declaration = DECLARATION  # targets "packed_tensor" (the packed producer), "nccl_engine" (the one-by-one path)

    def _patched(self, module: "ModuleType") -> "str | None":
        """The function of ``module`` the source patch changed, when it calls the marker (else None)."""
        path = one_by_one_path(module) if self.role_of(module) == "nccl_engine" else None
        functions = [getattr(path[0], path[1])] if path else [vars(module)[n] for n in PRODUCERS if n in vars(module)]
        for function in functions:
            qualname: str = getattr(function, "__qualname__", "")
            marker = Marker(module.__name__, qualname, self.marker.calls)
            if hasattr(function, "__code__") and marker.in_function(function):
                return qualname
        return None

    def probe(self, module: "ModuleType") -> Verdict:
        if self.role_of(module) == "nccl_engine":
            path = one_by_one_path(module)
            if path is None:
                paths = " nor ".join(f"{owner}.{method}" for owner, method, _ in ONE_BY_ONE_PATHS)
                return drifted(f"{module.__name__} has neither {paths} (the one-by-one path)")
            owner, method, expected = path
            found = _parameters(getattr(owner, method))
            if found != expected:
                return drifted(f"{owner.__name__}.{method}{found} is no longer {expected}")
        elif not any(name in vars(module) for name in PRODUCERS):
            return drifted(f"{module.__name__} has neither {' nor '.join(PRODUCERS)}")
        why = _producer_drift(module)
        if why is not None:
            return drifted(why)
        patched = self._patched(module)
        if patched is not None:
            return redundant(f"{patched} already calls {self.marker.calls} (patched on disk)")
        packed_tensor = module if self.role_of(module) == "packed_tensor" else importlib.import_module(self.target("packed_tensor"))
        return stock_packing_verdict(packed_tensor)

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        for name in PRODUCERS:
            if name in vars(module):
                yield module, name, normalizing_producer
        path = one_by_one_path(module) if self.role_of(module) == "nccl_engine" else None
        if path is not None:
            owner, method, _ = path
            yield owner, method, ONE_BY_ONE_WRAPPERS[method]


FIX = DeviceNormalizedBroadcastFix()
