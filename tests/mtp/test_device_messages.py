"""The device checks' messages fit CUDA's rule, and the suite enforces that rule on CPU.

CUDA refuses a ``torch._assert_async`` message of 255 bytes or more when the assert is queued,
whatever the condition (PyTorch PR #134813): a long message made every packed forward raise on a GPU
while the CPU suite passed. The suite now emulates the rule (`mtp_overlay.bed.runtime.device`, installed
by tests/conftest.py and in every CPU rank), and every message the overlay queues stays under
`checks.MESSAGE_LIMIT` (200 bytes, prefix included), over packed rows at CP1 and CP2, padded and real
boundaries, good masks and bad ones, with row sizes far beyond a real one's digits.
"""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mtp_overlay import mtp
from mtp_overlay.mtp.checks import MESSAGE_LIMIT
from mtp_overlay.bed.runtime import device

LENGTHS = [5, 9, 1, 13]


def packed_case(cp_size, real, long_row):
    """(CP-local input_ids, its loss mask, PackedSeqParams) of one packed row, for every CP rank."""
    scale = 20_000 if long_row else 1  # rows of 10^5-10^6 slots: the messages' numbers grow
    lengths = [length * scale for length in LENGTHS]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.arange(1, length + 1) % 1000 + 1
    mask = (ids != 0).float()
    packed = mtp.pack_sequences(ids, lengths, mask, pad_multiple=mtp.padding_multiple(cp_size))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens if real else packed.cu_seqlens_padded,
                             cu_seqlens_q_padded=packed.cu_seqlens_padded)
    for cp_rank in range(cp_size):
        shard = mtp.cp_shard(packed.input_ids, cp_size, cp_rank, packed.cu_seqlens_padded)
        local_mask = mtp.cp_shard(packed.loss_mask, cp_size, cp_rank, packed.cu_seqlens_padded)
        yield cp_rank, shard, local_mask, params


@pytest.mark.parametrize("long_row", [False, True])
@pytest.mark.parametrize("real", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_every_device_message_fits_cuda_and_a_bad_mask_is_a_readable_error(cp_size, real, long_row):
    for cp_rank, shard, mask, params in packed_case(cp_size, real, long_row):
        mtp.assert_loss_mask_layout(shard, mask, params, cp_size, cp_rank)  # a good mask passes
        padding = mtp.layout.padding_slots(shard.shape[1], params, cp_size, cp_rank)
        if real and bool(padding.any()):  # real boundaries: each sequence's padding is known
            stray = mask.clone()
            stray[0, int(padding.nonzero()[0, 0])] = 1.0
            with pytest.raises(RuntimeError, match=r"^mtp-overlay: loss_mask is nonzero in a padding slot "
                                                   rf"\(cp rank {cp_rank}/{cp_size}\) \(MTP_OVERLAY_CHECKS=full"):
                mtp.assert_loss_mask_layout(shard, stray, params, cp_size, cp_rank)
        negative = mask.clone()
        negative[0, 0] = -1.0
        with pytest.raises(RuntimeError, match="loss_mask must hold finite weights >= 0"):
            mtp.assert_loss_mask_layout(shard, negative, params, cp_size, cp_rank)
        # boundaries that do not lay out the row: both boundary checks fail, each with its short message
        bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=params.cu_seqlens_q_padded + 1,
                              cu_seqlens_q_padded=params.cu_seqlens_q_padded * 3)
        with pytest.raises(RuntimeError, match="cu_seqlens_q_padded: start 0, never decrease"):
            mtp.assert_loss_mask_layout(shard, mask, bad, cp_size, cp_rank)
    size, longest = device.longest_assert_message()
    assert 0 < size < MESSAGE_LIMIT, longest


def test_the_suite_refuses_a_long_assert_message_as_cuda_does_whatever_the_condition():
    holds = torch.tensor(True)
    torch._assert_async(holds, "x" * (device.CUDA_MESSAGE_LIMIT - 1))
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        torch._assert_async(holds, "x" * device.CUDA_MESSAGE_LIMIT)
    with pytest.raises(RuntimeError, match="Message length must be smaller than 255"):
        torch._assert_async(holds, "é" * 128)  # bytes, not characters, as CUDA counts them
