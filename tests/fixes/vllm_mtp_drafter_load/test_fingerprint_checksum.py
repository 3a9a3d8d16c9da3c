"""The refit fingerprint's checksum: what it tells apart and what it guarantees across devices."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_overlay.mtp import fingerprint, mtp_layer_of, mtp_name_filter
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
    assert digest(torch.tensor(7)).size == 8 and digest(torch.empty(0)).checksum == (0, 0)


def reference(tensor):
    """The checksum by its definition (refit's docstring), in Python integers: the tensor's bytes as
    little-endian 16-bit words, ``sum_i w_i * r^i mod p`` for each (p, r)."""
    data = list(tensor.detach().reshape(-1).contiguous().view(torch.uint8).tolist()) + [0]
    words = [data[i] + 256 * data[i + 1] for i in range(0, len(data) - 1, 2)]
    return tuple(sum(w * pow(r, i, p) for i, w in enumerate(words)) % p for p, r in refit._MODULI)


@pytest.mark.parametrize(("block", "chunk"), [(16, 64), (4, 8), (refit._BLOCK, refit._CHUNK_WORDS)])
def test_the_checksum_is_its_definition_across_blocks_and_chunks(block, chunk, monkeypatch):
    monkeypatch.setattr(refit, "_BLOCK", block)
    monkeypatch.setattr(refit, "_CHUNK_WORDS", chunk)
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in (1, 2, 3, 63, 64, 129, 1001)]
    tensors += [torch.randn(33, 5, generator=generator).to(torch.bfloat16).t(), torch.tensor(-7), torch.randn(300)]
    digests = fingerprint([(str(i), t) for i, t in enumerate(tensors)])  # one table of powers for all of them
    assert [digests[str(i)].checksum for i in range(len(tensors))] == [reference(t) for t in tensors]


def test_checksum_is_exact_past_one_chunk():
    """Three chunks and an odd byte of 0xff: against the geometric series, summed by hand."""
    data = torch.full((2 * 3 * refit._CHUNK_WORDS + 5,), 255, dtype=torch.uint8)
    words = (data.numel() + 1) // 2  # the last one is the odd byte alone: 255
    expected = []
    for p, r in refit._MODULI:
        series = (pow(r, words - 1, p) - 1) * pow(r - 1, -1, p)  # sum of r^i, i < words - 1
        expected.append((0xFFFF * series + 255 * pow(r, words - 1, p)) % p)
    assert tuple(int(h) for h in tensor_checksum(data)) == tuple(expected)


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
    """Each p a prime below 2**31 (products stay in int64), each r a primitive root of it (weights
    repeat only after p - 1 words), and no change of two adjacent words (one aligned 4-byte group:
    a float32 element) vanishes in both hashes at once, checked for every (d0, d1) with |d| < 2**16.
    Either hash alone misses 4 such changes: the pair is what makes the guarantee."""
    span = 1 << 16
    d1 = torch.arange(1, span, dtype=torch.int64)  # (d0, d1) and (-d0, -d1) vanish together; d1 = 0 never does
    residues = []
    for p, r in refit._MODULI:
        assert is_prime(p) and p < 2**31 and 1 < r < p
        assert all(pow(r, (p - 1) // q, p) != 1 for q in prime_factors(p - 1))
        d0 = (-d1 * r) % p  # the one d0 (mod p) with d0 + d1 * r = 0 mod p
        d0 = torch.where(d0 > p // 2, d0 - p, d0)
        residues.append(torch.where(d0.abs() < span, d0, torch.full_like(d0, 2 * span + 1)))  # out of range: no word change
    first, second = residues
    assert int((first.abs() < span).sum()) == int((second.abs() < span).sum()) == 4
    assert not bool(((first == second) & (first.abs() < span)).any())


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_bytes_give_the_same_digest_on_cuda_and_cpu():
    generator = torch.Generator().manual_seed(3)
    tensors = [("bf16", torch.randn(1000, 37, generator=generator).to(torch.bfloat16)),
               ("fp32", torch.randn(5 << 20, generator=generator)),  # several chunks
               ("int", torch.randint(-9, 9, (17,), generator=generator)), ("t", torch.randn(8, 3, generator=generator).t())]
    on_cpu = fingerprint(tensors)
    assert fingerprint([(name, t.cuda()) for name, t in tensors]) == on_cpu
    assert fingerprint([(name, t.cuda()) for name, t in tensors], dtype=torch.bfloat16) == fingerprint(tensors, dtype=torch.bfloat16)
