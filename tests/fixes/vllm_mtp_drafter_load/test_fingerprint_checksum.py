"""The refit fingerprint's checksum: what it tells apart and what it guarantees across devices."""

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_overlay.bed.runtime.preloaded import run_python
from mtp_overlay.mtp import device, fingerprint, mtp_layer_of, mtp_name_filter, record_fingerprints
from mtp_overlay.mtp import refit
from mtp_overlay.mtp.refit import tensor_checksum


def digest(tensor, dtype=None):
    return fingerprint([("t", tensor)], dtype=dtype)["t"]


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 3000), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_any_changed_byte_or_swapped_pair_of_blocks_changes_the_checksum(size, seed, data):
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    before = digest(tensor)
    flipped = tensor.clone()
    index = data.draw(st.integers(0, size - 1))
    flipped[index] ^= data.draw(st.integers(1, 255))
    assert digest(flipped).checksum != before.checksum
    if size >= 4:
        half = size // 2
        swapped = torch.cat([tensor[half:2 * half], tensor[:half], tensor[2 * half:]])
        if not torch.equal(swapped, tensor):
            assert digest(swapped).checksum != before.checksum


def test_layout_dtype_and_shape_are_part_of_the_digest():
    matrix = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    assert digest(matrix.t()) == digest(matrix.t().contiguous())  # logical order, not memory order
    assert digest(matrix.t()).checksum != digest(matrix).checksum
    assert digest(matrix.reshape(4, 6)).shape != digest(matrix).shape
    assert digest(matrix.to(torch.bfloat16)) == digest(matrix, dtype=torch.bfloat16) != digest(matrix)
    assert digest(torch.tensor(7)).size == 8 and digest(torch.empty(0)).checksum == (0, 0, 0, 0)


def reference(tensor):
    """The checksum by its definition (refit's docstring), in Python integers: the tensor's bytes as
    little-endian signed 64-bit words, the row sums of the R x C matrix of the first R * C of them,
    its column sums then the words past it and a zero-padded last word of left-over bytes, sums
    wrapped to signed 64 bits, each vector hashed ``sum_i v_i * r^i mod p``."""
    data = bytes(tensor.detach().reshape(-1).contiguous().view(torch.uint8).tolist())
    count = len(data) // 8
    words = [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, 8 * count, 8)]
    left = [int.from_bytes(data[8 * count:] + bytes(8 - len(data) % 8), "little", signed=True)] if len(data) % 8 else []
    width = 16
    while width * width < count:
        width += 1
    rows = count // width

    def wrap(n):
        return (n + 2**63) % 2**64 - 2**63

    a = [wrap(sum(words[r * width:(r + 1) * width])) for r in range(rows)]
    b = [wrap(sum(words[r * width + c] for r in range(rows))) for c in range(width)] + words[rows * width:] + left

    def hashes(values):
        return tuple(sum(v * pow(r, i, p) for i, v in enumerate(values)) % p for p, r in refit._MODULI)

    return hashes(a) + hashes(b)


def test_the_checksum_is_its_definition():
    """Sizes with and without tail words and left-over bytes, views at odd byte offsets, transposes."""
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in (1, 2, 3, 4, 63, 64, 129, 1001)]
    tensors += [torch.randn(33, 5, generator=generator).to(torch.bfloat16).t(), torch.tensor(-7), torch.randn(300)]
    tensors += [torch.randn(301, generator=generator).to(torch.bfloat16)[1:], torch.randint(0, 256, (70,), dtype=torch.uint8)[3:]]
    tensors += [torch.randint(-2**31, 2**31 - 1, (4099,), dtype=torch.int32, generator=generator)]
    digests = fingerprint([(str(i), t) for i, t in enumerate(tensors)])  # all hashed in one batch
    assert [digests[str(i)].checksum for i in range(len(tensors))] == [reference(t) for t in tensors]
    assert all(d.format == refit.FORMAT for d in digests.values())
    assert tuple(tensor_checksum(tensors[-1]).tolist()) == reference(tensors[-1])


def test_the_hash_windows_do_not_change_the_checksum(monkeypatch):
    """`refit._hash` weighs its values window by window: segments (each tensor's row sums, column
    sums and tail) that start, end and span any number of windows, and empty ones, give the
    checksum of the definition at every window width."""
    generator = torch.Generator().manual_seed(8)
    tensors = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=generator)
               for n in (2, 40, 513, 1, 9000, 0, 3)]
    expected = [reference(t) for t in tensors]
    for window in (1, 3, 64, 1024):
        monkeypatch.setattr(refit, "_WINDOW", window)
        digests = fingerprint([(str(i), t) for i, t in enumerate(tensors)])
        assert [digests[str(i)].checksum for i in range(len(tensors))] == expected, window


def test_checksum_is_exact_where_sums_wrap():
    """The largest and the smallest word in every place, 64 x 64 of them: every row and column sum
    wraps past 64 bits; against the geometric series by hand."""
    for word in (2**63 - 1, -2**63):
        data = torch.full((64 * 64,), word, dtype=torch.int64)
        wrapped = ((word * 64 + 2**63) % 2**64) - 2**63  # a sum of 64 words
        expected = [(wrapped * (pow(r, 64, p) - 1) * pow(r - 1, -1, p)) % p for p, r in refit._MODULI]
        assert tuple(tensor_checksum(data).tolist()) == tuple(expected * 2) == reference(data)


def is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def prime_factors(n):
    found, d = set(), 2
    while d * d <= n:
        while n % d == 0:
            found.add(d)
            n //= d
        d += 1
    return found | ({n} if n > 1 else set())


def test_the_constants_are_what_the_guarantees_rest_on():
    """Each p a prime below 2**31 (a residue times a residue stays in int64), each r a primitive root
    of it (weights repeat only after p - 1 values), and no change of one element of up to 4 bytes
    vanishes modulo both: its word changes by e * 2**(8k), 0 < |e| < min(2**32, 2**(64 - 8k)) (the
    element lies in the word from byte k), a sum by that plus j * 2**64 (a wrap, j in -1, 0, 1), which
    p1 * p2 divides only for e = -j * 2**(64 - 8k) mod p1 * p2: no such residue is that close to 0."""
    for p, r in refit._MODULI:
        assert is_prime(p) and p < 2**31 and 1 < r < p
        assert all(pow(r, (p - 1) // q, p) != 1 for q in prime_factors(p - 1))
    (p1, _), (p2, _) = refit._MODULI
    both = p1 * p2
    assert p1 != p2 and both > 2**61
    for shift in range(8):
        for j in (-1, 1):
            residue = (-j * pow(2, 64 - 8 * shift, both)) % both
            assert min(residue, both - residue) >= min(2**32, 2**(64 - 8 * shift))


def test_a_digest_of_another_format_is_refused_not_compared():
    from mtp_overlay.mtp import TensorDigest, check_fresh, compare_fingerprints

    current = digest(torch.ones(3))
    older = TensorDigest(*current[:3], (5, 6))  # as unpickled from an mtp-overlay before the format was recorded
    assert older.format == 1
    for expected, received, argument in (({"w": older}, {"w": current}, "expected"), ({"w": current}, {"w": tuple(older[:4])}, "received")):
        with pytest.raises(ValueError, match=rf"{argument}\['w'\] is a digest of format 1 .* not 2: it was computed by another mtp-overlay"):
            compare_fingerprints(expected, received)
    with pytest.raises(ValueError, match="format None"):
        check_fresh({"w": current}, {"w": "stale"})
    assert compare_fingerprints({"w": current}, {"w": digest(torch.ones(3))}) == {}


def flip(tensor, index, new_bytes):
    changed = tensor.clone()
    view = changed.view(torch.uint8).reshape(-1, tensor.element_size())
    view[index] = torch.tensor(list(new_bytes), dtype=torch.uint8)
    return changed


def test_what_the_earlier_position_weight_missed_is_caught():
    """A Fletcher pair (plain sum, weight (i mod 65521) + 1) missed all three: rows 65521 weights apart,
    and a crafted change of one float32 element (+1, -2, +1 in three bytes)."""
    generator = torch.Generator().manual_seed(11)
    rows = torch.randn(2, 65521, generator=generator)
    assert digest(rows.flip(0)).checksum != digest(rows).checksum
    embedding = torch.randn(131072, 8, generator=generator).to(torch.bfloat16)
    swapped = embedding.clone()
    swapped[[10, 65531]] = embedding[[65531, 10]]
    assert not torch.equal(swapped, embedding) and digest(swapped).checksum != digest(embedding).checksum
    element = torch.frombuffer(bytearray(b"\x10\x22\x10\x3f"), dtype=torch.float32)
    crafted = torch.frombuffer(bytearray(b"\x11\x20\x11\x3f"), dtype=torch.float32)
    assert sum(element.view(torch.uint8).tolist()) == sum(crafted.view(torch.uint8).tolist())  # same plain sum
    assert digest(crafted).checksum != digest(element).checksum


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.int8]


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(DTYPES), size=st.integers(1, 2000), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_any_change_to_one_element_or_an_exchange_of_two_is_caught(dtype, size, seed, data):
    """The two guarantees of the docstring on random tensors: one element changed to any other bytes,
    and two unequal elements exchanged at any distance."""
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randint(0, 256, (size * dtype.itemsize,), dtype=torch.uint8, generator=generator).view(dtype)
    before = digest(tensor).checksum
    index = data.draw(st.integers(0, size - 1))
    old = bytes(tensor.view(torch.uint8).reshape(size, -1)[index].tolist())
    new = data.draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize).filter(lambda b: b != old))
    assert digest(flip(tensor, index, new)).checksum != before
    other = data.draw(st.integers(0, size - 1))
    exchanged = tensor.clone()
    exchanged.view(torch.uint8).reshape(size, -1)[[index, other]] = tensor.view(torch.uint8).reshape(size, -1)[[other, index]]
    if not torch.equal(exchanged.view(torch.uint8), tensor.view(torch.uint8)):
        assert digest(exchanged).checksum != before


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="meta device"):
        fingerprint([("w", torch.empty(2, device="meta"))])
    with pytest.raises(TypeError, match=r"named_tensors\[1\] must be a \(name, tensor\) pair"):
        fingerprint([("a", torch.ones(1)), ("b", [1.0])])
    with pytest.raises(ValueError, match="'a' appears twice"):
        fingerprint([("a", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(ValueError, match="num_mtp_layers must be an int >= 1"):
        mtp_name_filter(88, 0)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mtp.layers.0.mixer.q_proj.weight", ("mtp.*", 0)),
        ("language_model.mtp.layers.1.eh_proj.weight", ("mtp.*", 1)),
        ("model.mtp.fc.weight", ("mtp.*", None)),
        ("model.layers.88.self_attn.q_proj.weight", ("positional", 0)),
        ("backbone.layers.89.mixer.o_proj.weight", ("positional", 1)),
        ("model.language_model.layers.88.eh_proj.weight", ("positional", 0)),
        ("model.layers.87.self_attn.q_proj.weight", None),  # the backbone's last layer
        ("model.layers.90.self_attn.q_proj.weight", None),  # past the MTP layers
        ("lm_head.weight", None),
    ],
)
def test_both_namings_of_an_mtp_layer_are_recognised(name, expected):
    assert mtp_layer_of(name, 88, 2) == expected


# what the kernels are checked on: sizes with and without tail words and left-over bytes, a matrix
# wider than a program's columns, views at odd byte offsets, a transpose, an empty tensor, views
# that overlap, wrapping sums
KERNEL_CASES = """
generator = torch.Generator().manual_seed(11)
tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in (1, 7, 8, 127, 128, 129, 5000, 300001)]
tensors += [torch.randn(33, 5, generator=generator).to(torch.bfloat16).t(), torch.tensor(-7), torch.empty(0)]
tensors += [torch.randn(301, generator=generator).to(torch.bfloat16)[1:], torch.full((300, 64), -2**63)]
whole = torch.randn(9000, generator=generator)
tensors += [whole[:4000], whole[2000:6000], whole[:4000], whole[1:]]
"""
KERNELS = """
import json
import torch
from mtp_overlay.mtp import device, refit
exec(CASES)
device.uses_kernels = lambda _: True  # Triton's interpreter runs the CUDA path's kernels on host tensors
calls = []
word_sums = device.word_sums
device.word_sums = lambda entries, *rest: calls.append(len(entries)) or word_sums(entries, *rest)
digests = refit.fingerprint([(str(i), t) for i, t in enumerate(tensors)])
refit._BATCH_BYTES = 4096  # batches of a few tensors, and a cast: the same digests
small = refit.fingerprint([(str(i), t) for i, t in enumerate(tensors)], dtype=torch.float32)
device.uses_kernels = lambda _: False
print(json.dumps({"kernels": [digests[str(i)].checksum for i in range(len(tensors))], "batches": calls,
                  "small": small == refit.fingerprint([(str(i), t) for i, t in enumerate(tensors)], dtype=torch.float32)}))
"""


def test_the_cuda_kernels_give_the_checksum_of_its_definition():
    """`mtp.device.word_sums`' Triton kernels (the CUDA path), run by Triton's interpreter on host
    tensors in a fresh interpreter (``TRITON_INTERPRET`` is read when the kernels are made)."""
    result = run_python(f"CASES = {KERNEL_CASES!r}\n" + KERNELS, {**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    cases: dict = {"torch": torch}
    exec(KERNEL_CASES, cases)
    assert [tuple(checksum) for checksum in found["kernels"]] == [reference(t) for t in cases["tensors"]]
    # one batch of every tensor; cast to float32 in batches of 4 KiB, a new one once a batch holds 4 KiB
    batches, held = [0], 0
    for tensor in cases["tensors"]:
        if held >= 4096:
            batches, held = batches + [0], 0
        batches[-1] += 1
        held += tensor.numel() * 4 // 8 * 8
    assert found["batches"] == [len(cases["tensors"])] + batches and found["small"]


def test_kernels_that_fail_here_warn_once_and_torch_ops_give_the_same_digests(monkeypatch):
    """A Triton that cannot compile or launch the kernels (never run on this GPU, a driver it does not
    know) costs speed, not the check: the batch is summed with torch ops, one OverlayWarning names
    the failure, and the kernels are not tried again in the process."""
    from mtp_overlay import OverlayWarning

    tried = []

    def failing(*arguments):
        tried.append(arguments)
        raise RuntimeError("PTX .version 9.9 does not support .target sm_999")

    monkeypatch.setattr(device, "_unavailable", [])
    monkeypatch.setattr(device, "word_sums", failing)
    monkeypatch.setattr(device, "uses_kernels", lambda _: not device._unavailable)
    generator = torch.Generator().manual_seed(2)
    tensors = [(str(i), torch.randn(n, generator=generator)) for i, n in enumerate((5, 300, 4097))]
    tensors.append(("odd", torch.randn(301, generator=generator).to(torch.bfloat16)[1:]))
    with pytest.warns(OverlayWarning, match="CUDA kernels failed here .*sm_999.*torch ops"):
        digests = fingerprint(tensors)
    assert [digests[name].checksum for name, _ in tensors] == [reference(t) for _, t in tensors]
    assert len(tried) == 1 and fingerprint(tensors) == digests and len(tried) == 1


def test_the_cuda_kernels_compile_for_hopper():
    """What an H100 / H200 runs: both kernels through Triton's compiler to a cubin for sm_90 (its own
    ptxas; no GPU needed)."""
    from triton import compile as compile_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mtp_overlay.mtp import kernels

    sizes = {"ROWS": kernels.ROWS, "COLUMNS": kernels.COLUMNS}
    for kernel in (kernels.row_sums, kernels.column_sums):
        for count, value in (("i32", {}), ("i64", {}), ("constexpr", {"tensors": 1})):  # as Triton types the count
            signature = {"layout": "*i64", "tensors": count, "out": "*i64", "partials": "*i64", "ROWS": "constexpr",
                         "COLUMNS": "constexpr"}
            source = ASTSource(fn=kernel, signature=signature, constexprs={**sizes, **value})
            compiled = compile_kernel(source, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm["cubin"] and "ld.global" in compiled.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_bytes_give_the_same_digest_on_cuda_and_cpu():
    """On CUDA the kernels sum (`device.uses_kernels`); a producer that refills one buffer is read by
    record_fingerprints as each tensor passes."""
    assert device.uses_kernels(torch.device("cuda"))
    generator = torch.Generator().manual_seed(3)
    tensors = [("bf16", torch.randn(1000, 37, generator=generator).to(torch.bfloat16)),
               ("fp32", torch.randn(5 << 20, generator=generator)),  # several chunks
               ("int", torch.randint(-9, 9, (17,), generator=generator)), ("t", torch.randn(8, 3, generator=generator).t()),
               ("wraps", torch.full((300, 64), -2**63)), ("odd place", torch.randn(1001, generator=generator).to(torch.bfloat16)[3:])]
    on_cpu = fingerprint(tensors)
    assert fingerprint([(name, t.cuda()) for name, t in tensors]) == on_cpu
    assert fingerprint([(name, t.cuda()) for name, t in tensors], dtype=torch.bfloat16) == fingerprint(tensors, dtype=torch.bfloat16)
    sources = [torch.randn(1 << 20, generator=generator).cuda() for _ in range(4)]
    buffer = torch.empty_like(sources[0])

    def refilled():  # one buffer, refilled on the stream for each tensor yielded
        for index, source in enumerate(sources):
            buffer.copy_(source)
            yield f"layers.{index}.weight", buffer

    received = {}
    for _ in record_fingerprints(refilled(), received):
        pass
    assert received == fingerprint((f"layers.{i}.weight", s.cpu()) for i, s in enumerate(sources))
