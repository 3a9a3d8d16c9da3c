"""The MTP library refuses what would train the MTP head wrongly, naming the argument, and takes an
empty batch in any container."""

import math

import pytest
import torch

from mtp_overlay import mtp


def packed_params(cu_seqlens, cu_seqlens_padded):
    from megatron.core.packed_seq_params import PackedSeqParams

    real, padded = torch.tensor(cu_seqlens, dtype=torch.int32), torch.tensor(cu_seqlens_padded, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)


@pytest.mark.parametrize(("bad", "message"), [(math.nan, "finite"), (math.inf, "finite"), (-1.0, "weights >= 0")])
def test_a_loss_mask_with_nan_inf_or_negative_weights_is_refused(bad, message):
    ids = torch.arange(8).reshape(2, 4)
    mask = torch.ones(2, 4)
    mask[1, 2] = bad
    with pytest.raises(ValueError, match=f"loss_mask must hold {message}"):
        mtp.pack_sequences(ids, [4, 3], mask)
    packed = mtp.pack_sequences(ids, [4, 3], torch.ones(2, 4), pad_multiple=4)
    row_mask = packed.loss_mask.clone()
    row_mask[0, 1] = bad
    with pytest.raises(ValueError, match=f"loss_mask must hold {message}"):
        mtp.check_loss_mask_layout(packed.input_ids, row_mask, mtp.packed_seq_params(packed))
    with pytest.raises(ValueError, match=f"loss_mask must hold {message}"):
        mtp.check_loss_mask_layout(ids, mask)  # BSHD too


@pytest.mark.parametrize("extra", [-2, 2], ids=["shorter", "longer"])
def test_a_packed_row_that_is_not_as_long_as_its_last_padded_boundary_is_refused(extra):
    params = packed_params([0, 3, 8], [0, 4, 12])
    row = torch.ones(1, 12 + extra, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"input_ids has {12 + extra} slots, but packed_seq_params.cu_seqlens_q_padded ends at 12"):
        mtp.check_loss_mask_layout(row, torch.zeros_like(row, dtype=torch.float), params)


def test_a_cp_local_row_must_be_its_share_of_the_last_padded_boundary():
    params = packed_params([0, 3, 8], [0, 4, 12])
    local = torch.ones(1, 6, dtype=torch.int64)
    mtp.check_loss_mask_layout(local, torch.zeros(1, 6), params, cp_size=2, cp_rank=1)  # 6 * 2 == 12: fine
    wrong = torch.ones(1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="input_ids has 8 slots on CP rank 1 of 2, but .* ends at 12: expected 6 slots"):
        mtp.check_loss_mask_layout(wrong, torch.zeros(1, 8), params, cp_size=2, cp_rank=1)


@pytest.mark.parametrize("lengths", [[], (), torch.zeros(0, dtype=torch.int64)], ids=["list", "tuple", "tensor"])
def test_an_empty_batch_packs_whatever_holds_its_lengths(lengths):
    packed = mtp.pack_sequences(torch.zeros(0, 4, dtype=torch.int64), lengths, torch.zeros(0, 4))
    assert packed.input_ids.shape == (1, 0) and packed.cu_seqlens.tolist() == [0] and packed.max_seqlen == 0
