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

Checksum (`tensor_checksum`): 16 bytes per tensor, computed on the tensor's own device with exact
integer arithmetic, so the same bytes give the same checksum on any device (CPU, CUDA, any index) and
after any transport. The tensor's bytes, in logical order, are read as 16-bit words
``w_i = byte[2i] + 256 * byte[2i+1]`` (an odd last byte is a word of its own), and the checksum is
the pair of polynomial hashes ``sum_i w_i * r^i mod p`` for two primes ``p`` below 2**31, each with
a base ``r`` that is a primitive root of it (`_MODULI`). Every word has its own weights across the
whole tensor: the pair ``(r1^i, r2^i)`` repeats only after ``lcm(p1 - 1, p2 - 1)`` (over 2**57)
words. Different dtypes are different
bytes: pass ``dtype=`` to compare a trainer's fp32 tensors with a bf16 wire (the cast rounds to
nearest-even, the same on every device). Together with the digest's shape, dtype and size it
guarantees, for two tensors of one shape and dtype, that the checksums differ when:

- any bytes within one aligned 4-byte group differ: any change to one element of 1, 2 or 4 bytes
  (float32, bfloat16, float16, int32, int8, float8, bool), a byte, a bit. One word's change ``d``
  changes a hash by ``d * r^i``, never 0 mod p; two words' ``d0 + d1 * r`` vanish mod p1 for 4
  pairs ``(d0, d1)`` and mod p2 for 4 others, never for the same one (checked exhaustively by the tests);
- two unequal elements of 4 bytes trade places less than ``(p2 - 1) / 2 = 1073741814`` elements
  apart (anywhere in a float32 tensor of up to that many elements, just under 4 GiB); two unequal
  elements of 2 bytes, less than ``lcm(p1 - 1, p2 - 1)`` elements apart. The change is
  ``r^a - r^b`` times one element's difference, and ``r^t = 1 mod p`` only at multiples of ``p - 1``.

Beyond that nothing is guaranteed: a change of more than one element (swapped rows, a stale tensor)
goes unnoticed only when the polynomial of its word differences has both bases as roots, which
changes made without regard to these fixed, public constants essentially never do (two 31-bit
coincidences at once), but a change crafted against them can. No fingerprint of 16 bytes can do
more: past 16 bytes there are more tensors than fingerprints, so tensors that differ yet share one
always exist, and with no secret key anyone can construct them. It is a staleness check, not a
cryptographic hash: compare SHA-256 digests of the host bytes where an adversary is the concern.
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
# (prime p < 2**31, base r): r is the first primitive root of p from floor(p * (sqrt 5 - 1) / 2),
# resp. floor(p * (sqrt 2 - 1)); below 2**31 every product of a word (< 2**16) or a residue with a
# residue stays below 2**62 in int64
_MODULI = ((2147483647, 1327217885), (2147483629, 889516854))
_BLOCK = 1 << 16  # words summed exactly in int64 before a reduction: (2**16 - 1) * (2**31 - 2) * 2**16 < 2**63
_CHUNK_WORDS = 32 * _BLOCK  # words checksummed per step (4 MiB of the tensor): an int64 working set of 16 MiB


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
    """The two polynomial hashes of ``tensor``'s bytes (see the module's docstring) as 0-dim int64
    tensors on its own device (no host sync); ``dtype``: cast first (a temporary copy on that device)."""
    return _checksum(tensor, dtype, {})


def _checksum(tensor: torch.Tensor, dtype: torch.dtype | None,
              powers: dict[tuple[torch.device, int, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor_checksum`, keeping its tables of base powers in ``powers`` for the next tensor.

    Word ``i = b * B + j`` (block ``b`` of ``B = min(_BLOCK, words)`` words) weighs ``r^i = (r^B)^b * r^j``:
    each block's sum of ``word * r^j`` is exact in int64, then reduced and weighed by ``(r^B)^b``.
    """
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
    device, words = data.device, (data.numel() + 1) // 2
    width = max(1, min(_BLOCK, words))
    hashes = [torch.zeros((), dtype=torch.int64, device=device) for _ in _MODULI]
    for start in range(0, words, _CHUNK_WORDS):
        chunk = data[2 * start:2 * (start + _CHUNK_WORDS)].to(torch.int64)
        blocks = -(-chunk.numel() // (2 * width))
        chunk = torch.nn.functional.pad(chunk, (0, 2 * width * blocks - chunk.numel()))  # zero words weigh nothing
        values = (chunk[0::2] + chunk[1::2] * 256).view(blocks, width)
        first = start // width
        for k, (modulus, base) in enumerate(_MODULI):
            inner = _powers(powers, device, k, base, width)  # r^j
            outer = _powers(powers, device, k, pow(base, width, modulus), first + blocks)  # (r^B)^b
            sums = (values * inner[:width]).sum(dim=1).remainder_(modulus)
            part = (sums * outer[first:first + blocks]).remainder_(modulus).sum()
            hashes[k] = (hashes[k] + part).remainder_(modulus)
    return hashes[0], hashes[1]


def _powers(cache: dict[tuple[torch.device, int, int], torch.Tensor], device: torch.device, k: int, base: int,
            count: int) -> torch.Tensor:
    """At least ``count`` powers ``base^0, base^1, ... mod p`` of modulus ``k`` (int64, on ``device``),
    grown by doubling and kept in ``cache``."""
    import torch

    modulus = _MODULI[k][0]
    table = cache.get((device, k, base))
    if table is None:
        table = torch.ones(1, dtype=torch.int64, device=device)
    while table.numel() < count:
        step = pow(base, table.numel(), modulus)  # base^n: the next n powers are the first n times base^n
        table = torch.cat((table, (table * step).remainder_(modulus)))
    cache[(device, k, base)] = table
    return table


def _digest(tensor: torch.Tensor, dtype: torch.dtype | None,
            powers: dict[tuple[torch.device, int, int], torch.Tensor]) -> tuple[tuple[int, ...], str, int, torch.Tensor]:
    """(shape, dtype name, size in bytes, [2] int64 checksum on the tensor's device)."""
    import torch

    first, second = _checksum(tensor, dtype, powers)
    wire_dtype = dtype or tensor.dtype
    size = tensor.numel() * wire_dtype.itemsize
    return tuple(tensor.shape), str(wire_dtype).removeprefix("torch."), size, torch.stack((first, second))


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
    powers: dict[tuple[torch.device, int, int], torch.Tensor] = {}
    for index, (name, tensor) in enumerate(_pairs(named_tensors, "named_tensors")):
        if keep is not None and not keep(name):
            continue
        if name in entries:
            raise ValueError(f"named_tensors: {name!r} appears twice (at index {index})")
        shape, dtype_name, size, checksum = _digest(tensor, dtype, powers)
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
    powers: dict[tuple[torch.device, int, int], torch.Tensor] = {}
    for pair in _pairs(named_tensors, "named_tensors"):
        name, tensor = pair
        if keep is None or keep(name):
            shape, dtype_name, size, checksum = _digest(tensor, dtype, powers)
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
