"""The test bed's packed-row builder, its MTP expectation and the self-slicing-CP wrapper, in-process."""

import types

import pytest
import torch

from mtp_overlay import mtp
from mtp_overlay.bed.models.packed import SelfSlicingCP, expected_mtp, make_packed_row


def test_rows_pack_like_nemo_rl_in_both_flavours():
    padded = make_packed_row((5, 3), pad_multiple=4, prompts=(1, 0), seed=3)
    unpadded = make_packed_row((5, 3), pad_multiple=4, prompts=(1, 0), seed=3, flavour="unpadded")
    text = padded.texts
    assert padded.cu_seqlens.tolist() == [0, 5, 8] and padded.cu_seqlens_padded.tolist() == [0, 8, 12]
    assert padded.input_ids[0].tolist() == text[0][:-1].tolist() + [0] * 3 + text[1][:-1].tolist() + [0]
    assert padded.labels[0].tolist() == text[0][1:].tolist() + [0] * 3 + text[1][1:].tolist() + [0]
    assert padded.loss_mask[0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]
    assert padded.position_ids[0].tolist() == list(range(8)) + list(range(4))
    assert padded.real_slots().tolist() == [True] * 5 + [False] * 3 + [True] * 3 + [False]
    params = padded.packed_seq_params  # NeMo-RL's default: the padded boundaries everywhere
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, name).tolist() == [0, 8, 12], name
    other = unpadded.packed_seq_params  # the self-slicing path: real cu_seqlens_q, padded cu_seqlens_q_padded
    assert other.cu_seqlens_q.tolist() == [0, 5, 8] and other.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    assert other.qkv_format == "thd" and other.max_seqlen_q == 8
    assert torch.equal(unpadded.input_ids, padded.input_ids)
    assert [batch["input_ids"].tolist() for batch in padded.sequences()] == [[t[:-1].tolist()] for t in text]


def test_expected_mtp_targets_follow_each_sequence_alone():
    row = make_packed_row((5, 2), pad_multiple=4, prompts=(1, 0), seed=4)
    text = row.texts[0]
    weights, targets = expected_mtp(row, labels=True)  # SFT: slot i weighs mask[i+1], predicts text[i+2]
    assert weights.tolist() == [1, 1, 1, 1, 0, 0, 0, 0] + [1, 0, 0, 0]
    assert targets[:4].tolist() == text[2:6].tolist() and targets[8] == row.texts[1][2]
    weights, targets = expected_mtp(row, labels=False)  # RL: slot i weighs mask[i+2]
    assert weights.tolist() == [1, 1, 1, 0, 0, 0, 0, 0] + [0, 0, 0, 0]
    assert targets[:3].tolist() == text[2:5].tolist()
    weights, _ = expected_mtp(row, labels=False, depth=2)
    assert weights.tolist() == [1, 1] + [0] * 10


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(lengths=(4,), flavour="thd"), "flavour must be one of"),
    (dict(lengths=(4, 0)), "lengths must be one or more positive ints"),
    (dict(lengths=(4, 2), prompts=(1,)), "prompts must give one count"),
    (dict(lengths=(4, 2), prompts=(1, 3)), "prompts must give one count"),
])
def test_bad_rows_are_refused(arguments, message):
    lengths = arguments.pop("lengths")
    with pytest.raises(ValueError, match=message):
        make_packed_row(lengths, **arguments)


class Recorder(torch.nn.Module):
    """Stands where the GPTModel/HybridModel goes: records what reaches it."""

    def __init__(self, cp_rank):
        super().__init__()
        self.config = types.SimpleNamespace(mtp_num_layers=1)
        self.model_type = "encoder_or_decoder"
        group = types.SimpleNamespace(size=lambda: 2, rank=lambda: cp_rank)
        self.pg_collection = types.SimpleNamespace(cp=group)

    def forward(self, input_ids, position_ids, attention_mask, labels=None, loss_mask=None, packed_seq_params=None):
        self.seen = dict(input_ids=input_ids, position_ids=position_ids, labels=labels, loss_mask=loss_mask,
                         packed_seq_params=packed_seq_params)
        return input_ids.float()


@pytest.mark.parametrize("flavour", ["padded", "unpadded"])
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_self_slicing_wrapper_slices_the_full_row_per_sequence(flavour, cp_rank):
    row = make_packed_row((5, 3, 7), pad_multiple=4, flavour=flavour)
    inner = Recorder(cp_rank)
    model = SelfSlicingCP(inner)
    assert mtp.model_slices_context_parallel(model) and model.config is inner.config

    def local(tensor):
        return mtp.cp_shard(tensor, 2, cp_rank, row.cu_seqlens_padded)

    output, sliced = model(row.input_ids, row.position_ids, None, row.labels, loss_mask=row.loss_mask,
                           packed_seq_params=row.packed_seq_params)
    for name in ("input_ids", "position_ids", "labels", "loss_mask"):
        assert torch.equal(inner.seen[name], local(getattr(row, name))), name
    assert torch.equal(sliced, local(row.loss_mask)) and inner.seen["packed_seq_params"] is row.packed_seq_params
    assert torch.equal(output, local(row.input_ids).float())
    assert isinstance(model(row.input_ids, row.position_ids), torch.Tensor)  # no loss_mask: the output alone
    with pytest.raises(ValueError, match=r"loss_mask must be a full row of input_ids' shape \(1, 20\)"):
        model(row.input_ids, row.position_ids, loss_mask=local(row.loss_mask), packed_seq_params=row.packed_seq_params)
