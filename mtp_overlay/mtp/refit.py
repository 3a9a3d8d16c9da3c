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

Checksum (`tensor_checksum`, format 2): four exact integers per tensor, computed on the tensor's own
device from sums over its bytes with no arithmetic but the sum (two torch reductions per tensor;
on a CUDA device one read of a whole batch of tensors by `device.word_sums`' two kernels), so the
same bytes give the same checksum on any device (CPU, CUDA, any index) and after any transport.
The tensor's bytes, in logical order, are read as little-endian signed 64-bit words ``w_0 ..
w_(m-1)`` (up to 7 bytes left over, zero-padded, are one more word at the end of ``b``).
The first ``R * C`` words form an ``R x C`` matrix (``C``: the least integer >= 16 with ``C * C >=
m``, ``R = m // C``), the rest are the tail. ``a``: the row sums; ``b``: the column sums, then the
tail words and the left-over word one by one. Two words of the matrix share a row and a column only
if they are one. Sums wrap modulo 2**64 (integer addition is
associative modulo 2**64, so every device and every order of summation gives the same words) and
are read as signed 64-bit integers. The checksum is ``(H1(a), H2(a), H1(b), H2(b))`` with the
polynomial hashes ``Hk(v) = sum_i v_i * r_k^i mod p_k`` for two primes ``p_k`` below 2**31, each
``r_k`` a primitive root of ``p_k`` (`_MODULI`); the hashes of all tensors on a device are taken in
one batch (a handful of kernels over about ``2 * sqrt(m)`` values per tensor). Different dtypes are
different bytes: pass ``dtype=`` to compare a trainer's fp32 tensors with a bf16 wire (the cast
rounds to nearest-even, the same on every device). Together with the digest's
shape, dtype and size it guarantees, for two tensors of one shape and dtype, that the checksums
differ when one element of 1, 2 or 4 bytes (float32, bfloat16, float16, int32, int8, float8, bool),
a byte or a bit changes: its word changes by ``e * 2**(8 * k)`` (``k`` the byte it starts at,
``0 < |e| < min(2**32, 2**(64 - 8 * k))``), one value of ``a`` (and one of ``b``) by ``D = e *
2**(8 * k) + j * 2**64`` (``j`` in -1, 0, 1: a wrap) and its hash by ``D * r^i``, 0 modulo both
primes only when ``p1 * p2`` divides ``D``, which no such ``e`` allows (checked by the tests for
every ``k`` and ``j``). Two unequal elements that trade places change two values of ``a`` (or of
``b``, where they share a row) by ``D`` and ``-D`` up to a wrap: missed only when ``D`` is congruent modulo ``p1 * p2``
(over 2**61) to one of four values the two places fix, which no rule an ordinary change follows
brings about, but which is not excluded by proof.

Beyond that nothing is guaranteed: a change of more than one element (swapped rows, a stale tensor)
goes unnoticed only when it leaves every sum of ``a`` and of ``b`` unchanged or the polynomials of
their changes have the bases as roots, which changes made without regard to these fixed, public
constants essentially never do, but a change crafted against them can. No fingerprint of a few
bytes can do more: past its size there are more tensors than fingerprints, so tensors that differ
yet share one always exist, and with no secret key anyone can construct them. It is a staleness
check, not a cryptographic hash: compare SHA-256 digests of the host bytes where an adversary is the
concern. Digests carry their ``format``; comparing digests of another format (an older mtp-overlay:
format 1: two polynomial hashes of 16-bit words) is a ValueError, never a mismatch.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from typing import NamedTuple

TYPE_CHECKING = False
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
# resp. floor(p * (sqrt 2 - 1)); below 2**31 a product of two residues stays below 2**62 in int64
_MODULI = ((2147483647, 1327217885), (2147483629, 889516854))
_WIDTH = 16  # the least width of the words' matrix
FORMAT = 2  # of TensorDigest.checksum; format 1 (mtp-overlay before it): two hashes of 16-bit words
_BATCH_BYTES = 1 << 28  # a CUDA batch's words (`_DeviceSums`): held temporaries stay under it
_WINDOW = 1024  # `_hash`'s windows of values: weights r^j for j below it, r^(W w) per window


class TensorDigest(NamedTuple):
    """A tensor's fingerprint: shape (tuple), dtype (str), size in bytes, checksum (4 ints), format.

    ``format`` defaults to 1, the format of digests made before it was recorded (unpickled from an
    older mtp-overlay), so that they are refused rather than compared."""

    shape: tuple[int, ...]
    dtype: str
    size: int
    checksum: tuple[int, ...]
    format: int = 1


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


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The checksum of ``tensor``'s bytes (see the module's docstring): a [4] int64 tensor on its own
    device (no host sync); ``dtype``: cast first (a temporary copy on that device)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    sums = _DeviceSums(tensor.device, dtype)
    sums.add(tensor)
    return sums.checksums()[0]


def _words(tensor: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tensor``'s bytes (cast to ``dtype``, in logical order) as aligned little-endian int64
    words, and the bytes left over as one zero-padded word (None when there are none): a view of
    the tensor where its bytes allow, else a copy."""
    import torch

    if tensor.device.type == "meta":
        raise ValueError("tensor is on the meta device: it holds no bytes to checksum")
    tensor = tensor.detach()
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    flat = tensor.reshape(-1)  # a view when contiguous; non-contiguous tensors are read in logical order
    data = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    if data.storage_offset() % 8:  # a view at an odd place: 64-bit words need aligned bytes
        data = data.clone()
    count = data.numel() // 8
    left = None
    if data.numel() > 8 * count:
        left = torch.nn.functional.pad(data[8 * count:], (0, 8 - data.numel() % 8)).view(torch.int64)
    return data[:8 * count].view(torch.int64), left


def _matrix(count: int) -> tuple[int, int]:
    """``(R, C)`` of the matrix of ``count`` words: ``C`` the least >= 16 with ``C * C >= count``."""
    width = max(_WIDTH, math.isqrt(count - 1) + 1 if count else 0)
    return count // width, width


class _DeviceSums:
    """The row and column sums (``a``, ``b``) of tensors on one device, in the order added.

    With torch ops, two reductions per tensor, queued as it is added. On a CUDA device
    (`device.uses_kernels`) tensors gather into batches of up to `_BATCH_BYTES` (held: a temporary,
    a cast, lives until its batch is summed), each summed by `device.word_sums`' two kernel
    launches: a tensor's bytes are read when its batch is, after it was added."""

    def __init__(self, device: torch.device, dtype: torch.dtype | None) -> None:
        from .device import uses_kernels

        self.device, self.dtype = device, dtype
        self.kernels = uses_kernels(device)
        self.values: list[torch.Tensor] = []  # flat int64 pieces: per tensor its a, then its b
        self.lengths: list[int] = []  # per tensor len(a), len(b)
        # not yet summed: (what holds the words, their address, count, left-over word)
        self.batch: list[tuple[torch.Tensor, int, int, torch.Tensor | None]] = []
        self.batch_bytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        left: torch.Tensor | None = None
        if self.kernels and tensor.dtype == (self.dtype or tensor.dtype) and tensor.is_contiguous() and not (
                tensor.data_ptr() % 8 or tensor.nbytes % 8):  # its own bytes are the words: no view made
            held, start, count = tensor, tensor.data_ptr(), tensor.nbytes // 8
        else:
            held, left = _words(tensor, self.dtype)
            start, count = held.data_ptr(), held.numel()
        rows, width = _matrix(count)
        self.lengths += [rows, width + count - rows * width + (left is not None)]
        if not self.kernels:
            self._reduce(held, count, left)
            return
        if self.batch_bytes >= _BATCH_BYTES:
            self._sum_batch()
        self.batch.append((held, start, count, left))
        self.batch_bytes += 8 * count

    def _sum_batch(self) -> None:
        import torch

        from .device import kernels_failed, word_sums

        entries, lefts, at = [], [], 0
        for _, start, count, left in self.batch:
            rows, width = _matrix(count)
            entries.append((start, count, rows, width, at))
            at += rows + width + count - rows * width  # a, then b: the column sums, the words past
            if left is not None:
                lefts.append((at, left))
                at += 1
        batch, self.batch, self.batch_bytes = self.batch, [], 0
        try:
            out = word_sums(entries, at, self.device)
        except Exception as exc:  # the kernels do not compile or launch here: torch ops, warned once
            kernels_failed(exc)
            self.kernels = False
            for held, _, count, left in batch:
                self._reduce(_words(held, None)[0], count, left)
            return
        if lefts:
            places = torch.tensor([place for place, _ in lefts], device=self.device)
            out.index_copy_(0, places, torch.cat([left for _, left in lefts]))
        self.values.append(out)

    def _reduce(self, words: torch.Tensor, count: int, left: torch.Tensor | None) -> None:
        """One tensor's ``a`` and ``b`` by torch ops: two reductions of its ``count`` words."""
        rows, width = _matrix(count)
        block = words[:rows * width].view(rows, width)
        self.values += [block.sum(1), block.sum(0), words[rows * width:]] + ([] if left is None else [left])

    def checksums(self) -> torch.Tensor:
        """[tensors added, 4] int64 on the device: per tensor ``(H1(a), H2(a), H1(b), H2(b))``."""
        if self.batch:
            self._sum_batch()
        return _hash(self.values, self.lengths, self.device)


def _hash(values: list[torch.Tensor], lengths: list[int], device: torch.device) -> torch.Tensor:
    """[len(lengths) // 2, 4] int64 on ``device``: per tensor ``(H1(a), H2(a), H1(b), H2(b))``, all at once;
    ``values`` concatenated are the segments ``a_0, b_0, a_1, b_1, ...`` of ``lengths``.

    No gather or scatter over the values: value ``i`` of the concatenation (``i = W w + j`` in window
    ``w`` of `_WINDOW` ``W``) is weighed by ``r^j`` and summed up its window; each segment boundary's
    prefix ``sum_(i < bound) v_i r^i`` is then a window's running sum times ``r^(W w)`` plus the
    windows before it, and a segment's hash the difference of its two prefixes times ``r^-start``."""
    import torch

    total, window = sum(lengths), _WINDOW
    windows = max(1, -(-total // window))
    moduli = torch.tensor([[p] for p, _ in _MODULI], dtype=torch.int64, device=device)  # [2, 1]
    terms = torch.zeros(2, windows * window, dtype=torch.int64, device=device)
    if values:
        torch.remainder(torch.cat(values), moduli, out=terms[:, :total])  # v mod p, exact for any int64
    low, low_inverse = _powers(1, window, device), _powers(-1, window, device)  # [2, W]: r^j, r^-j
    high, high_inverse = (_powers(step, 1 << (windows - 1).bit_length(), device) for step in (window, -window))
    # per window the running sums of v_i r^j mod p: each term < 2**31, so below W * 2**31
    running = terms.view(2, windows, window).mul_(low[:, None]).remainder_(moduli[:, :, None]).cumsum_(2)
    weighed = (running[:, :, -1] % moduli) * high[:, :windows] % moduli  # a window's sum times r^(W w)
    before = weighed.cumsum(1) - weighed  # the windows before each one, below windows * 2**31
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    last = (bounds - 1).clamp_(min=0)  # the last value before a bound: window last // W, place last % W
    blocks, places = last // window, last % window
    prefix = (before[:, blocks] + high[:, blocks] * (running[:, blocks, places] % moduli)) % moduli * (bounds > 0)
    starts = bounds[:-1]
    inverse = high_inverse[:, starts // window] * low_inverse[:, starts % window] % moduli  # r^-start
    hashes = (prefix[:, 1:] - prefix[:, :-1]) % moduli * inverse % moduli
    return hashes.view(2, len(lengths) // 2, 2).permute(1, 2, 0).reshape(-1, 4)  # (H1(a), H2(a), H1(b), H2(b))


@functools.cache
def _powers(step: int, count: int, device: torch.device) -> torch.Tensor:
    """[2, count] int64 on ``device``: ``(r_k^step)^n mod p_k`` for ``n < count`` (a negative ``step``:
    powers of ``r_k``'s inverse), grown on the host by doubling; kept, as the hash asks for few sizes."""
    import torch

    table = torch.ones(2, 1, dtype=torch.int64)
    moduli = torch.tensor([[p] for p, _ in _MODULI], dtype=torch.int64)
    while table.shape[1] < count:  # the next n powers are the first n times (r^step)^n
        factor = torch.tensor([[pow(r, step * table.shape[1], p)] for p, r in _MODULI], dtype=torch.int64)
        table = torch.cat((table, (table * factor).remainder_(moduli)), 1)
    return table[:, :count].to(device)


def _digest(tensor: torch.Tensor, dtype: torch.dtype | None) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, size in bytes) of the digest of ``tensor`` (cast to ``dtype``)."""
    wire_dtype = dtype or tensor.dtype
    return tuple(tensor.shape), str(wire_dtype).removeprefix("torch."), tensor.numel() * wire_dtype.itemsize


def fingerprint(
    named_tensors: NamedTensors, keep: Callable[[str], bool] | None = None, dtype: torch.dtype | None = None
) -> dict[str, TensorDigest]:
    """``{name: TensorDigest}`` of the ``(name, tensor)`` pairs in ``named_tensors``.

    ``keep``: a predicate on names (e.g. `mtp_name_filter`); ``dtype``: checksum the tensors cast to
    it (the wire dtype). Per tensor two reductions over its bytes (on a CUDA device two kernel
    launches for a whole batch of tensors); the hashes of all tensors of a device in one batch and
    one host transfer per device. A name seen twice is a ValueError.

    Each tensor must keep its bytes until the call returns: on a CUDA device it is read with its
    batch, after later tensors were handed in. A producer that refills one buffer for each tensor it
    yields is read with `record_fingerprints`, which takes each tensor as it passes.
    """
    entries: dict[str, tuple[tuple[int, ...], str, int]] = {}
    sums: dict[torch.device, tuple[list[str], _DeviceSums]] = {}
    for index, (name, tensor) in enumerate(_pairs(named_tensors, "named_tensors")):
        if keep is not None and not keep(name):
            continue
        if name in entries:
            raise ValueError(f"named_tensors: {name!r} appears twice (at index {index})")
        entries[name] = _digest(tensor, dtype)
        if tensor.device not in sums:
            sums[tensor.device] = ([], _DeviceSums(tensor.device, dtype))
        names, device_sums = sums[tensor.device]
        device_sums.add(tensor)
        names.append(name)
    values: dict[str, list[int]] = {}
    for names, device_sums in sums.values():
        values.update(zip(names, device_sums.checksums().tolist()))
    return {name: TensorDigest(*entries[name], tuple(values[name]), FORMAT) for name in entries}


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
            into[name] = TensorDigest(*_digest(tensor, dtype), tuple(tensor_checksum(tensor, dtype).tolist()), FORMAT)
        yield pair


def compare_fingerprints(expected: dict[str, TensorDigest], received: dict[str, TensorDigest]) -> dict[str, str]:
    """``{name: why}`` for every tensor whose digests differ or that only one side has ({} when fresh)."""
    for argument, value in (("expected", expected), ("received", received)):
        if not isinstance(value, dict):
            raise TypeError(f"{argument} must be a dict of name -> TensorDigest (from fingerprint), got {type(value).__name__}")
        for name, digest in value.items():
            made = TensorDigest(*digest).format if isinstance(digest, tuple) and 4 <= len(digest) <= 5 else None
            if made != FORMAT:
                raise ValueError(
                    f"{argument}[{name!r}] is a digest of format {made} ({digest!r:.120}), not {FORMAT}: it was computed "
                    "by another mtp-overlay version, whose checksums cannot be compared with this one's; "
                    "fingerprint both sides with the same version"
                )
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
