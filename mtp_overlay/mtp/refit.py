"""MTP weights in a rollout refit: which names are MTP weights, and did the drafter get the trainer's head?

Two namings of the same MTP head reach vLLM's drafters: the ``mtp.*`` namespace (Nemotron-H, Qwen3-Next
checkpoints; ``mtp.layers.<i>.``) and positional naming, the MTP layers indexed after the backbone
(DeepSeek-V3 style ``model.layers.<num_hidden_layers + i>.``; NeMo-RL's ``load_mtp_weights_from_disk``
expected it, NeMo-RL PR #3494). Each drafter reads one and skips the other without a word (vLLM
#43456: 0% acceptance). `mtp_layer_of` recognises both.

The freshness check: `fingerprint` the trainer's MTP head before a refit, `record_fingerprints` on the
tensors the rollout worker receives (the stream its drafter's ``load_weights`` consumes), then
`check_fresh`. A stale drafter (refit never reached it, or reached it with old tensors) names its
tensors instead of showing up weeks later as "acceptance is low".

Checksum guarantees (`tensor_checksum`): computed on the tensor's own device, 16 bytes per tensor,
from the tensor's bytes in its own dtype with exact integer arithmetic (order-independent sums that
never overflow below 2**39 bytes), so the same bytes give the same checksum on any device (CPU, CUDA,
any index) and after any transport. Different dtypes are different bytes: pass ``dtype=`` to compare
a trainer's fp32 tensors with a bf16 wire (the cast rounds to nearest-even, the same on every
device). A Fletcher-style pair (plain sum, position-weighted sum mod 65521) catches any single
changed byte and moved/swapped blocks; it is a staleness check, not a cryptographic hash.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # annotations only: torch loads inside the functions
    from collections.abc import Callable, Iterable, Iterator
    from typing import TypeAlias

    import torch

    NamedTensors: TypeAlias = "Iterable[tuple[str, torch.Tensor]]"

# multimodal wrappers nest the language model's weights (vLLM strips these for Nemotron-H VL)
_WRAPPER_PREFIXES = ("model.language_model.", "language_model.")
_NAMESPACE = re.compile(r"(?:model\.)?mtp\.(?:layers\.(\d+)\.)?")
_POSITIONAL = re.compile(r"(?:model\.|backbone\.)?layers\.(\d+)\.")
NAMESPACE, POSITIONAL = "mtp.*", "positional"
_MODULUS = 65521  # largest prime below 2**16: position weights stay below 2**16
_CHUNK_BYTES = 1 << 22  # bytes checksummed per step: bounds the int64 working set at 32 MiB


class TensorDigest(NamedTuple):
    """A tensor's fingerprint: shape (tuple), dtype (str), size in bytes, checksum (int pair)."""

    shape: tuple[int, ...]
    dtype: str
    size: int
    checksum: tuple[int, ...]


def strip_wrapper_prefix(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def mtp_layer_of(name: str, num_hidden_layers: int, num_mtp_layers: int) -> tuple[str, int | None] | None:
    """``(naming, layer)`` when ``name`` is an MTP checkpoint weight, else None.

    naming: `NAMESPACE` for ``[model.]mtp.*``, `POSITIONAL` for ``[model.|backbone.]layers.<k>.``
    with ``num_hidden_layers <= k < num_hidden_layers + num_mtp_layers``. layer: the MTP layer's
    index counted from 0 (``mtp.layers.<i>`` gives i, positional ``k`` gives ``k - num_hidden_layers``),
    None for an MTP weight outside the layers (``mtp.fc.weight``). A ``language_model.`` /
    ``model.language_model.`` prefix (multimodal checkpoints) is ignored.
    """
    stripped = strip_wrapper_prefix(name)
    match = _NAMESPACE.match(stripped)
    if match:
        return NAMESPACE, None if match.group(1) is None else int(match.group(1))
    match = _POSITIONAL.match(stripped)
    if match:
        layer = int(match.group(1)) - num_hidden_layers
        if 0 <= layer < num_mtp_layers:
            return POSITIONAL, layer
    return None


def mtp_name_filter(num_hidden_layers: int, num_mtp_layers: int) -> Callable[[str], bool]:
    """A predicate on names: True for MTP weights in either naming (see `mtp_layer_of`)."""
    for argument, value, least in (("num_hidden_layers", num_hidden_layers, 0), ("num_mtp_layers", num_mtp_layers, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{argument} must be an int >= {least}, got {value!r}")
    return lambda name: mtp_layer_of(name, num_hidden_layers, num_mtp_layers) is not None


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of bytes, position-weighted sum of bytes mod 65521)`` of ``tensor`` as 0-dim int64 tensors
    on its own device (no host sync); ``dtype``: cast first (a temporary copy on that device)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "meta":
        raise ValueError("tensor is on the meta device: it holds no bytes to checksum")
    tensor = tensor.detach()
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    flat = tensor.reshape(-1)  # a view when contiguous; non-contiguous tensors are read in logical order
    data = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    plain = torch.zeros((), dtype=torch.int64, device=data.device)
    weighted = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), _CHUNK_BYTES):
        chunk = data[start:start + _CHUNK_BYTES].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=data.device)
        weights.remainder_(_MODULUS).add_(1)
        plain += chunk.sum()
        weighted += (chunk * weights).sum()
    return plain, weighted


def _digest(tensor: torch.Tensor, dtype: torch.dtype | None) -> tuple[tuple[int, ...], str, int, torch.Tensor]:
    """(shape, dtype name, size in bytes, [2] int64 checksum on the tensor's device)."""
    import torch

    plain, weighted = tensor_checksum(tensor, dtype)
    wire_dtype = dtype or tensor.dtype
    size = tensor.numel() * wire_dtype.itemsize
    return tuple(tensor.shape), str(wire_dtype).removeprefix("torch."), size, torch.stack((plain, weighted))


def fingerprint(
    named_tensors: NamedTensors, keep: Callable[[str], bool] | None = None, dtype: torch.dtype | None = None
) -> dict[str, TensorDigest]:
    """``{name: TensorDigest}`` of the ``(name, tensor)`` pairs in ``named_tensors``.

    ``keep``: a predicate on names (e.g. `mtp_name_filter`); ``dtype``: checksum the tensors cast to
    it (the wire dtype). One host transfer per device for all checksums. A name seen twice is a ValueError.
    """
    import torch

    entries: dict[str, tuple[tuple[int, ...], str, int]] = {}
    sums: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for index, (name, tensor) in enumerate(_pairs(named_tensors, "named_tensors")):
        if keep is not None and not keep(name):
            continue
        if name in entries:
            raise ValueError(f"named_tensors: {name!r} appears twice (at index {index})")
        shape, dtype_name, size, checksum = _digest(tensor, dtype)
        entries[name] = (shape, dtype_name, size)
        sums.setdefault(checksum.device, []).append((name, checksum))
    values: dict[str, list[int]] = {}
    for pairs in sums.values():
        values.update(zip((name for name, _ in pairs), torch.stack([c for _, c in pairs]).tolist()))
    return {name: TensorDigest(*entries[name], tuple(values[name])) for name in entries}


def record_fingerprints(
    named_tensors: NamedTensors,
    into: dict[str, TensorDigest],
    keep: Callable[[str], bool] | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the pairs of ``named_tensors`` unchanged, adding each one's TensorDigest to ``into`` (a dict).

    For the receiving side: wrap what a drafter's ``load_weights`` consumes, e.g. the chunks of vLLM's
    ``packed_nccl_broadcast_consumer(..., post_unpack_func=lambda chunk:
    drafter.load_weights(record_fingerprints(chunk, received)))``. The checksum is taken as each
    tensor passes, before the consumer reuses its buffer; one host sync per tensor recorded.
    """
    if not isinstance(into, dict):
        raise TypeError(f"into must be a dict to collect the digests in, got {type(into).__name__}")
    for pair in _pairs(named_tensors, "named_tensors"):
        name, tensor = pair
        if keep is None or keep(name):
            shape, dtype_name, size, checksum = _digest(tensor, dtype)
            into[name] = TensorDigest(shape, dtype_name, size, tuple(checksum.tolist()))
        yield pair


def compare_fingerprints(expected: dict[str, TensorDigest], received: dict[str, TensorDigest]) -> dict[str, str]:
    """``{name: why}`` for every tensor whose digests differ or that only one side has ({} when fresh)."""
    for argument, value in (("expected", expected), ("received", received)):
        if not isinstance(value, dict):
            raise TypeError(f"{argument} must be a dict of name -> TensorDigest (from fingerprint), got {type(value).__name__}")
    problems = {}
    for name in sorted(set(expected) | set(received)):
        want, got = expected.get(name), received.get(name)
        if got is None:
            problems[name] = "not received"
        elif want is None:
            problems[name] = "received but not in the trainer's fingerprint"
        elif tuple(want) != tuple(got):
            fields = [f for f in TensorDigest._fields if getattr(TensorDigest(*want), f) != getattr(TensorDigest(*got), f)]
            problems[name] = "differs in " + ", ".join(fields) + f" (trainer {TensorDigest(*want)}, received {TensorDigest(*got)})"
    return problems


class StaleDrafterError(ValueError):
    """The drafter's MTP tensors are not the trainer's after a refit; ``problems`` maps name -> why."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems
        listed = "; ".join(f"{name}: {why}" for name, why in problems.items())
        super().__init__(f"the drafter did not receive the trainer's MTP head ({len(problems)} tensor(s)): {listed}")


def check_fresh(expected: dict[str, TensorDigest], received: dict[str, TensorDigest]) -> None:
    """Raise StaleDrafterError naming every tensor whose received digest is not the trainer's."""
    problems = compare_fingerprints(expected, received)
    if problems:
        raise StaleDrafterError(problems)


def _pairs(named_tensors: NamedTensors, argument: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    try:
        pairs = iter(named_tensors)
    except TypeError:
        raise TypeError(f"{argument} must be an iterable of (name, tensor) pairs, got {type(named_tensors).__name__}") from None
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"{argument}[{index}] must be a (name, tensor) pair, got {pair!r:.200}")
        yield pair
