"""The refit fingerprint's checksum: what it tells apart and what it guarantees across devices."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_overlay.mtp import fingerprint, mtp_layer_of, mtp_name_filter
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


def test_checksum_is_exact_past_one_chunk():
    data = torch.full((3 * (1 << 22) + 5,), 255, dtype=torch.uint8)
    plain, weighted = tensor_checksum(data)
    n = data.numel()
    positions = torch.arange(n, dtype=torch.int64) % 65521 + 1
    assert int(plain) == 255 * n and int(weighted) == 255 * int(positions.sum())


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
