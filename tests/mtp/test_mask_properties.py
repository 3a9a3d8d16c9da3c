"""Properties of the MTP mask library: packing, CP sharding, mask build, bad input.

The CP layout is compared with the pinned megatron-core's own ``get_batch_on_this_cp_rank``, run on
torch's in-process "fake" process group so any (cp_size, cp_rank) can be asked for without
spawning ranks.
"""

import contextlib
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mtp_overlay import mtp

PROPERTY = settings(max_examples=200, deadline=None)
VOCAB = 1000


@st.composite
def batches(draw, max_batch=6, max_len=24):
    """(input_ids [B, S] with tokens >= 1, lengths [B], float mask [B, S])."""
    batch = draw(st.integers(1, max_batch))
    seq_len = draw(st.integers(1, max_len))
    lengths = draw(st.lists(st.integers(0, seq_len), min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (batch, seq_len), generator=generator)
    mask = (torch.rand(batch, seq_len, generator=generator) < 0.6).float()
    return input_ids, torch.tensor(lengths), mask


def real_slots(lengths, seq_len):
    return torch.arange(seq_len)[None, :] < lengths[:, None]


@PROPERTY
@given(batches(), st.integers(1, 8))
def test_pack_then_unpack_is_the_identity(batch, pad_multiple):
    input_ids, lengths, mask = batch
    packed = mtp.pack_sequences(input_ids, lengths, mask, pad_multiple=pad_multiple)
    seq_len = input_ids.shape[1]
    tokens = mtp.unpack_sequences(packed.input_ids, packed.cu_seqlens, packed.cu_seqlens_padded, seq_len)
    back = mtp.unpack_sequences(packed.loss_mask, packed.cu_seqlens, packed.cu_seqlens_padded, seq_len)
    real = real_slots(lengths, seq_len)
    assert torch.equal(tokens, torch.where(real, input_ids, 0))
    assert torch.equal(back, torch.where(real, mask, 0.0))
    padded = packed.cu_seqlens_padded.diff()
    assert torch.equal(packed.cu_seqlens.diff(), lengths.int())
    assert bool((padded % pad_multiple == 0).all()) and bool((padded - lengths < pad_multiple).all())
    assert packed.input_ids.shape == packed.loss_mask.shape == (1, int(padded.sum()))


@PROPERTY
@given(batches(), st.integers(1, 8))
def test_mask_and_tokens_share_boundaries(batch, pad_multiple):
    input_ids, lengths, mask = batch
    packed = mtp.pack_sequences(input_ids, lengths, mask, pad_multiple=pad_multiple)
    # packing a tensor that names each slot (row, column) shows where every element went: the mask
    # packed alone lands exactly where it lands packed with the tokens, and only on real tokens
    where = (torch.arange(input_ids.numel()).reshape(input_ids.shape) + 1).float()
    slots = mtp.pack_sequences(input_ids, lengths, where, pad_multiple=pad_multiple).loss_mask
    alone = mtp.pack_sequences(mask, lengths, pad_multiple=pad_multiple).input_ids
    assert torch.equal(alone, packed.loss_mask)
    assert torch.equal(slots.long() != 0, packed.input_ids != 0)  # tokens are >= 1, pad is 0
    expected = torch.where(slots > 0, mask.reshape(-1)[(slots.long() - 1).clamp(min=0)], 0.0)
    assert torch.equal(packed.loss_mask, expected)


@PROPERTY
@given(batches(), st.integers(1, 8), st.booleans())
def test_packed_seq_params_tell_every_slot_its_sequence(batch, pad_multiple, real_lengths):
    """A Mamba layer learns where packed sequences start only from ``PackedSeqParams.seq_idx``, which
    megatron-core computes only when ``total_tokens`` is given: each slot gets the sequence whose
    padded span holds it, in both flavours."""
    input_ids, lengths, mask = batch
    packed = mtp.pack_sequences(input_ids, lengths, mask, pad_multiple=pad_multiple)
    params = mtp.packed_seq_params(packed, real_lengths=real_lengths)
    padded = packed.cu_seqlens_padded.long()
    slot_sequence = torch.searchsorted(padded, torch.arange(int(padded[-1])), right=True) - 1
    assert params.total_tokens == int(padded[-1])
    assert torch.equal(params.seq_idx.long(), slot_sequence[None, :])


@PROPERTY
@given(batches(), st.integers(2, 4))
def test_all_cp_shards_in_chunk_order_rebuild_the_packed_row(batch, cp_size):
    input_ids, lengths, mask = batch
    packed = mtp.pack_sequences(input_ids, lengths, mask, pad_multiple=mtp.padding_multiple(cp_size))
    assert torch.equal(mtp.cp_shard(packed.loss_mask, 1, 0, packed.cu_seqlens_padded), packed.loss_mask)
    shards = [mtp.cp_shard(packed.loss_mask, cp_size, r, packed.cu_seqlens_padded) for r in range(cp_size)]
    assert all(shard.shape == (1, packed.loss_mask.shape[1] // cp_size) for shard in shards)
    # rebuild by hand, sequence by sequence: chunk k of a sequence sits on rank k (first half of
    # that rank's part of the sequence) or on rank 2*cp-1-k (second half)
    rebuilt, local_start = [], 0
    for padded in packed.cu_seqlens_padded.diff().tolist():
        chunk = padded // (2 * cp_size)
        for k in range(2 * cp_size):
            rank, half = (k, 0) if k < cp_size else (2 * cp_size - 1 - k, 1)
            begin = local_start + half * chunk
            rebuilt.append(shards[rank][0, begin : begin + chunk])
        local_start += 2 * chunk
    assert torch.equal(torch.cat(rebuilt)[None, :], packed.loss_mask)


@contextlib.contextmanager
def fake_cp_group(cp_size, cp_rank):
    """torch's in-process fake process group: this process is rank ``cp_rank`` of ``cp_size``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=cp_rank, world_size=cp_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def upstream_shard(tensor, group):
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = {"tokens": tensor.clone(), "cu_seqlens": None}
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)["tokens"]


@PROPERTY
@given(batches(), st.integers(2, 4), st.data())
def test_cp_shard_equals_upstream_get_batch_on_this_cp_rank(batch, cp_size, data):
    input_ids, lengths, mask = batch
    cp_rank = data.draw(st.integers(0, cp_size - 1))
    packed = mtp.pack_sequences(input_ids, lengths, mask, pad_multiple=mtp.padding_multiple(cp_size))
    cu = packed.cu_seqlens_padded.tolist()
    # BSHD rows: the whole [B, S'] row is one sequence (S' padded to a multiple of 2*cp)
    width = math.ceil(input_ids.shape[1] / (2 * cp_size)) * (2 * cp_size)
    rows = torch.nn.functional.pad(input_ids, (0, width - input_ids.shape[1]))
    with fake_cp_group(cp_size, cp_rank) as group:
        assert torch.equal(mtp.cp_shard(rows, cp_size, cp_rank), upstream_shard(rows, group))
        # THD: upstream's layout applied to each padded sequence on its own, in order
        expected = [upstream_shard(packed.loss_mask[:, a:b], group) for a, b in zip(cu, cu[1:])]
    ours = mtp.cp_shard(packed.loss_mask, cp_size, cp_rank, packed.cu_seqlens_padded)
    assert torch.equal(ours, torch.cat(expected, dim=1))


@PROPERTY
@given(batches(), st.integers(1, 4), st.data())
def test_layout_check_finds_exactly_the_padding_slots_of_every_cp_shard(batch, cp_size, data):
    from megatron.core.packed_seq_params import PackedSeqParams

    input_ids, lengths, mask = batch
    cp_rank = data.draw(st.integers(0, cp_size - 1))
    packed = mtp.pack_sequences(input_ids, lengths, mask, pad_multiple=mtp.padding_multiple(cp_size))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_q_padded=packed.cu_seqlens_padded)
    shard = mtp.cp_shard(packed.input_ids, cp_size, cp_rank, packed.cu_seqlens_padded)
    # tokens are >= 1 and pad slots hold pad_token_id 0: the padding is where the shard holds 0
    padding = mtp.layout.padding_slots(shard.shape[1], params, cp_size, cp_rank)
    assert torch.equal(padding, shard[0] == 0)
    local_mask = mtp.cp_shard(packed.loss_mask, cp_size, cp_rank, packed.cu_seqlens_padded)
    mtp.check_loss_mask_layout(shard, local_mask, params, cp_size, cp_rank)
    mtp.assert_loss_mask_layout(shard, local_mask, params, cp_size, cp_rank)  # the hook's device-side twin agrees
    if bool(padding.any()):
        stray = local_mask.clone()
        stray[0, int(padding.nonzero()[data.draw(st.integers(0, int(padding.sum()) - 1)), 0])] = 1
        with pytest.raises(ValueError, match="padding slot"):
            mtp.check_loss_mask_layout(shard, stray, params, cp_size, cp_rank)
        with pytest.raises(RuntimeError, match="mtp-overlay: loss_mask is nonzero in a padding slot"):
            mtp.assert_loss_mask_layout(shard, stray, params, cp_size, cp_rank)


@pytest.fixture(scope="module")
def mtp_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, mtp_num_layers=1)


@pytest.fixture(scope="module")
def mtp_off_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)


@PROPERTY
@given(batches(), st.data())
def test_mask_is_token_mask_times_sample_weight_only_with_mtp(mtp_config, batch, data):
    _, _, token_mask = batch
    weights = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=len(token_mask), max_size=len(token_mask))))
    mask = mtp.build_mtp_loss_mask(token_mask, weights, mtp_config)
    assert mask.shape == token_mask.shape and mask.dtype == torch.float32
    for row in range(len(token_mask)):
        assert torch.equal(mask[row], token_mask[row] * weights[row])  # not shifted
    assert mtp.build_mtp_loss_mask(token_mask, weights, mtp_config.__class__(
        num_layers=1, hidden_size=8, num_attention_heads=1)) is None  # MTP off: NeMo-RL issue #2869
    expected = float((token_mask[:, 1:] * weights[:, None]).sum())
    assert mtp.global_valid_tokens(token_mask, weights) == pytest.approx(expected)


MALFORMED = [
    "loss_mask_rows", "loss_mask_columns", "length_beyond_s", "negative_length", "lengths_count",
    "cp_not_dividing", "bshd_cp_not_dividing", "non_binary_token_mask", "nan_sample_weight",
    "sample_mask_rows", "cu_seqlens_end",
]


@PROPERTY
@given(batches(max_batch=4, max_len=12), st.sampled_from(MALFORMED), st.integers(2, 4), st.data())
def test_every_malformed_input_is_a_value_error_naming_the_argument(mtp_config, mtp_off_config, batch, kind, cp_size, data):
    input_ids, lengths, mask = batch
    config = data.draw(st.sampled_from([mtp_config, mtp_off_config]))  # masks are checked with MTP off too
    batch_size, seq_len = input_ids.shape
    if kind == "loss_mask_rows":
        call, name = lambda: mtp.pack_sequences(input_ids, lengths, mask[:-1] if batch_size > 1 else mask.repeat(2, 1)), "loss_mask"
    elif kind == "loss_mask_columns":
        call, name = lambda: mtp.pack_sequences(input_ids, lengths, torch.cat([mask, mask[:, :1]], 1)), "loss_mask"
    elif kind == "length_beyond_s":
        bad = lengths.clone()
        bad[data.draw(st.integers(0, batch_size - 1))] = seq_len + data.draw(st.integers(1, 5))
        call, name = lambda: mtp.pack_sequences(input_ids, bad, mask), "lengths"
    elif kind == "negative_length":
        bad = lengths.clone()
        bad[data.draw(st.integers(0, batch_size - 1))] = -data.draw(st.integers(1, 5))
        call, name = lambda: mtp.pack_sequences(input_ids, bad, mask), "lengths"
    elif kind == "lengths_count":
        call, name = lambda: mtp.pack_sequences(input_ids, torch.cat([lengths, lengths[:1]]), mask), "lengths"
    elif kind == "cp_not_dividing":
        # packed without the 2*cp padding: some padded length is not a multiple of 2*cp
        assume(bool((lengths % (2 * cp_size)).any()))
        packed = mtp.pack_sequences(input_ids, lengths, mask)
        rank = data.draw(st.integers(0, cp_size - 1))
        call, name = lambda: mtp.cp_shard(packed.loss_mask, cp_size, rank, packed.cu_seqlens_padded), "cu_seqlens_padded"
    elif kind == "bshd_cp_not_dividing":
        assume(seq_len % (2 * cp_size))
        call, name = lambda: mtp.cp_shard(mask, cp_size, 0), "cp_size"
    elif kind == "non_binary_token_mask":
        bad = mask.clone()
        bad[data.draw(st.integers(0, batch_size - 1)), data.draw(st.integers(0, seq_len - 1))] = data.draw(
            st.sampled_from([0.5, 2.0, -1.0, float("nan")]))
        call, name = lambda: mtp.build_mtp_loss_mask(bad, torch.ones(batch_size), config), "token_mask"
    elif kind == "nan_sample_weight":
        weights = torch.ones(batch_size)
        weights[data.draw(st.integers(0, batch_size - 1))] = float("nan")
        call, name = lambda: mtp.build_mtp_loss_mask(mask, weights, config), "sample_mask"
    elif kind == "sample_mask_rows":
        call, name = lambda: mtp.build_mtp_loss_mask(mask, torch.ones(batch_size + 1), config), "sample_mask"
    else:  # cu_seqlens_end: boundaries that do not cover the packed row
        packed = mtp.pack_sequences(input_ids, lengths, mask, pad_multiple=2 * cp_size)
        cu = packed.cu_seqlens_padded.clone()
        cu[-1] += 2 * cp_size
        call, name = lambda: mtp.cp_shard(packed.loss_mask, cp_size, 0, cu), "cu_seqlens_padded"
    with pytest.raises(ValueError, match=name):
        call()


def test_layout_check_names_both_layouts_and_finds_padding_slots():
    from megatron.core.packed_seq_params import PackedSeqParams

    input_ids = torch.arange(1, 25).reshape(3, 8)
    packed = mtp.pack_sequences(input_ids, torch.tensor([3, 8, 5]), torch.ones(3, 8), pad_multiple=4)
    with pytest.raises(ValueError, match=r"loss_mask has layout \[3, 8\] but input_ids has \[1, 20\]"):
        mtp.check_loss_mask_layout(packed.input_ids, torch.ones(3, 8))
    # TE convention: real boundaries in cu_seqlens_q, padded in cu_seqlens_q_padded
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_q_padded=packed.cu_seqlens_padded)
    mtp.check_loss_mask_layout(packed.input_ids, packed.loss_mask, params)
    unpadded = mtp.pack_sequences(input_ids, torch.tensor([3, 8, 5]), torch.ones(3, 8)).loss_mask
    shifted = torch.nn.functional.pad(unpadded, (0, 20 - unpadded.shape[1]))  # packed without per-sequence padding
    with pytest.raises(ValueError, match=r"in 1 padding slot\(s\).*first at \[3\]"):
        mtp.check_loss_mask_layout(packed.input_ids, shifted, params)
    # CP-local rows: rank 1 of 2 holds global slots [1, 2] [6..9] [14..17] of the padded layout
    local = mtp.cp_shard(packed.loss_mask, 2, 1, packed.cu_seqlens_padded)
    mtp.check_loss_mask_layout(local, local, params, cp_size=2, cp_rank=1)
    bad = local.clone()
    bad[0, 1] = 1  # global slot 2 of the first sequence: real (length 3)
    mtp.check_loss_mask_layout(local, bad, params, cp_size=2, cp_rank=1)
    bad[0, -1] = 1  # global slot 17: padding of the third sequence
    with pytest.raises(ValueError, match="padding slot"):
        mtp.check_loss_mask_layout(local, bad, params, cp_size=2, cp_rank=1)


def test_mtp_config_keys_go_onto_the_config_and_anything_else_is_refused(mtp_config):
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    @dataclasses.dataclass
    class Provider(TransformerConfig):  # a Megatron-Bridge-style provider subclass
        seq_length: int = 128

    provider = Provider(num_layers=1, hidden_size=8, num_attention_heads=1)
    assert mtp.apply_mtp_config(provider, {"mtp_num_layers": 2, "mtp_detach_heads": True}) is provider
    assert (provider.mtp_num_layers, provider.mtp_detach_heads, provider.mtp_loss_scaling_factor) == (2, True, 0.1)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['mtp_num_layer'\]"):
        mtp.apply_mtp_config(provider, {"mtp_num_layer": 3})
    with pytest.raises(TypeError, match="config must be a TransformerConfig instance"):
        mtp.apply_mtp_config({"mtp_num_layers": 1}, {"mtp_num_layers": 2})


def test_grad_scale_is_set_for_the_block_only_and_needs_per_token_loss(mtp_config):
    token_mask, weights = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]), torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="calculate_per_token_loss=True"):
        with mtp.mtp_grad_scale(mtp_config, token_mask, weights):
            pass
    mtp_config.calculate_per_token_loss = True
    try:
        with pytest.raises(RuntimeError, match="step failed"):
            with mtp.mtp_grad_scale(mtp_config, token_mask, weights) as valid_tokens:
                assert valid_tokens == 1.0 and mtp_config.mtp_grad_scale_func() == 1.0
                raise RuntimeError("step failed")
        assert mtp_config.mtp_grad_scale_func is None
    finally:
        mtp_config.calculate_per_token_loss = False


def test_output_of_a_cp_slicing_model_is_unwrapped():
    logits, sliced = torch.zeros(2, 3), torch.ones(2, 3)
    assert mtp.split_output((logits, sliced)) == (logits, sliced)
    assert mtp.unwrap_output((logits, sliced)) is logits and mtp.unwrap_output(logits) is logits
    with pytest.raises(ValueError, match="output: expected a tensor or"):
        mtp.unwrap_output((logits, sliced, sliced))


def test_layout_check_refuses_non_tensors_and_out_of_range_cp_arguments():
    from megatron.core.packed_seq_params import PackedSeqParams

    packed = mtp.pack_sequences(torch.arange(1, 17).reshape(2, 8), torch.tensor([3, 8]), torch.ones(2, 8), pad_multiple=4)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_q_padded=packed.cu_seqlens_padded)
    local = mtp.cp_shard(packed.loss_mask, 2, 1, packed.cu_seqlens_padded)
    mtp.check_loss_mask_layout(local, local, params, cp_size=2, cp_rank=1)  # the valid call
    # rank 7 of 2 used to pass the shape check and report stray "padding slots"
    with pytest.raises(ValueError, match=r"cp_rank must lie in \[0, cp_size=2\), got 7"):
        mtp.check_loss_mask_layout(local, local, params, cp_size=2, cp_rank=7)
    with pytest.raises(ValueError, match=r"cp_size must be an int >= 1, got 0"):
        mtp.check_loss_mask_layout(local, local, params, cp_size=0, cp_rank=0)
    with pytest.raises(ValueError, match=r"cp_rank must be an int >= 0, got -1"):
        mtp.check_loss_mask_layout(local, local, params, cp_size=2, cp_rank=-1)
    with pytest.raises(TypeError, match="cp_size must be an int >= 1, got float 2.0"):
        mtp.check_loss_mask_layout(local, local, params, cp_size=2.0, cp_rank=1)
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor, got list"):
        mtp.check_loss_mask_layout(local.tolist(), local)
    with pytest.raises(TypeError, match="loss_mask must be a torch.Tensor, got NoneType"):
        mtp.check_loss_mask_layout(local, None)
    with pytest.raises(TypeError, match=r"packed_seq_params must be a megatron PackedSeqParams \(with cu_seqlens_q\) or None, got dict"):
        mtp.check_loss_mask_layout(local, local, {"cu_seqlens_q": packed.cu_seqlens}, cp_size=2, cp_rank=1)


class Wrapper:
    """A DDP / Float16Module-style wrapper: the wrapped model under ``.module``."""

    def __init__(self, module):
        self.module = module


class Model:
    def __init__(self, config):
        self.config = config


@pytest.mark.parametrize("bad", [{"mtp_num_layers": 1}, None, object(), Wrapper(Model({"mtp_num_layers": 1}))])
def test_mask_build_refuses_anything_but_a_config_or_model_with_mtp_num_layers(mtp_config, mtp_off_config, bad):
    token_mask, weights = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]), torch.tensor([1.0, 0.5])
    expected = torch.tensor([[0.0, 1.0, 1.0], [0.5, 0.5, 0.0]])
    assert torch.equal(mtp.build_mtp_loss_mask(token_mask, weights, Wrapper(Wrapper(Model(mtp_config)))), expected)
    assert mtp.build_mtp_loss_mask(token_mask, weights, Wrapper(Model(mtp_off_config))) is None
    with pytest.raises(TypeError, match=f"model_or_config must be a TransformerConfig with mtp_num_layers.*got {type(bad).__name__}"):
        mtp.build_mtp_loss_mask(token_mask, weights, bad)


DEVICES = [("cpu", "meta"), ("meta", "cpu"), pytest.param("cuda", "cpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("token_device, sample_device", DEVICES)
def test_masks_on_two_devices_are_a_value_error_naming_both(mtp_config, mtp_off_config, token_device, sample_device):
    if "cuda" in (token_device, sample_device) and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    token_mask, weights = torch.ones(2, 3, device=token_device), torch.ones(2, device=sample_device)
    # the devices as the tensors name them ("cuda:0" for "cuda")
    message = f"token_mask is on {token_mask.device} but sample_mask on {weights.device}"
    for config in (mtp_config, mtp_off_config):
        with pytest.raises(ValueError, match=message):
            mtp.build_mtp_loss_mask(token_mask, weights, config)
    with pytest.raises(ValueError, match=message):
        mtp.global_valid_tokens(token_mask, weights)


@pytest.mark.parametrize("bad", [{"mask": 1}, [[1.0, 0.0]], 1.0])
def test_loss_mask_scope_takes_only_a_tensor_or_none(bad):
    mask = torch.ones(1, 4)
    with mtp.loss_mask_scope(mask):
        with pytest.raises(TypeError, match=f"loss_mask must be a torch.Tensor or None, got {type(bad).__name__}"):
            with mtp.loss_mask_scope(bad):
                pass
        assert mtp.scoped_loss_mask() is mask  # the refused scope changed nothing
        with mtp.loss_mask_scope(None):
            assert mtp.scoped_loss_mask() is None
    assert mtp.scoped_loss_mask() is None


def test_unwrap_model_names_a_module_cycle_instead_of_looping(mtp_config):
    inner = Model(mtp_config)
    assert mtp.unwrap_model(Wrapper(Wrapper(inner))) is inner
    looped = Wrapper(None)
    looped.module = looped
    with pytest.raises(ValueError, match=r"model: its .module chain is a cycle \(Wrapper -> Wrapper\)"):
        mtp.unwrap_model(looped)
    first = Wrapper(None)
    second = Wrapper(first)
    first.module = second
    with pytest.raises(ValueError, match=r"cycle \(Wrapper -> Wrapper -> Wrapper\)"):
        mtp.build_mtp_loss_mask(torch.ones(1, 2), torch.ones(1), first)


@PROPERTY
@given(st.sampled_from([torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]), st.data())
def test_pad_token_id_fills_the_padding_and_must_fit_the_dtype(dtype, data):
    largest = torch.iinfo(dtype).max
    pad = data.draw(st.integers(0, largest))
    input_ids = torch.ones(2, 4, dtype=dtype)
    packed = mtp.pack_sequences(input_ids, torch.tensor([1, 3]), pad_multiple=4, pad_token_id=pad)
    assert packed.input_ids.tolist() == [[1, pad, pad, pad, 1, 1, 1, pad]]
    too_large = data.draw(st.integers(largest + 1, 2 * largest + 2))
    for bad in (too_large, -data.draw(st.integers(1, largest))):
        with pytest.raises(ValueError, match="pad_token_id must "):
            mtp.pack_sequences(input_ids, torch.tensor([1, 3]), pad_token_id=bad)
    for bad in (1.0, True, None, torch.tensor(0)):
        with pytest.raises(TypeError, match=f"pad_token_id must be an int >= 0, got {type(bad).__name__}"):
            mtp.pack_sequences(input_ids, torch.tensor([1, 3]), pad_token_id=bad)


def test_version_in_errors_comes_from_the_shared_distribution_version():
    import dataclasses

    from mtp_overlay.contract import distribution_version

    version = distribution_version("megatron-core")
    assert version and not hasattr(mtp.scaling, "_core_version")

    @dataclasses.dataclass
    class OldConfig:  # a TransformerConfig from before mtp_detach_heads and mtp_grad_scale_func
        mtp_num_layers: int = 1
        calculate_per_token_loss: bool = True

    with pytest.raises(ValueError, match=f"OldConfig of the installed megatron-core {version} has no field 'mtp_detach_heads'"):
        mtp.apply_mtp_config(OldConfig(), {"mtp_detach_heads": True})
    with pytest.raises(ValueError, match=f"no mtp_grad_scale_func field: megatron-core {version} predates it"):
        with mtp.mtp_grad_scale(OldConfig(), torch.ones(1, 2), torch.ones(1)):
            pass
