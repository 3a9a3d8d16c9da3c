"""Packed (THD) sequences through stock megatron-core GPTModel and HybridModel, against each sequence alone.

NeMo-RL packs an RL/SFT batch into one row per microbatch, each sequence padded to 2*CP*TP (CP) or TP
(SP), with ``PackedSeqParams`` in one of two flavours: "padded" (``cu_seqlens_q ==
cu_seqlens_q_padded``, NeMo-RL's default) or "unpadded" (``cu_seqlens_q`` real, ``cu_seqlens_q_padded``
padded: the ``model_slices_context_parallel_inputs`` path of NeMo-RL PR #3494). The reference is every
sequence alone, BSHD and unpadded, at TP1. The local attention refuses packed input; the test bed's
exact attention shim (per-sequence causal mask from the padded boundaries) stands in for TE's.
"""

import dataclasses

import numpy as np
import pytest
from testbed_cases import LAYOUTS, MODELS, layout_params, lengths, packed_name, packed_row

from mtp_overlay.bed.models.packed import expected_mtp

TOLERANCE = 1e-5
ALL_LAYOUTS = layout_params(*LAYOUTS)


def task(labels):
    return "sft" if labels else "rl"


def row_of(layout, flavour):
    return packed_row(LAYOUTS[layout]["pad_multiple"], flavour)


def max_abs(a, b):
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def grad_delta(result, reference):
    return max(max_abs(a, b) for a, b in zip(result.grads, reference.grads))


def trained(result, real=None, depth=0):
    return result.trained(real, depth)


def mtp_mean_loss(result, depth=0):
    return float(result.mtp[depth]["losses"][result.mtp[depth]["trained"]].mean())


def assert_lm_matches(result, reference, real):
    assert result.error is None, result.error
    assert max_abs(result.lm_losses[real], reference.lm_losses) <= TOLERANCE
    if reference.logits is not None:
        assert max_abs(result.logits[real], reference.logits) <= TOLERANCE


@pytest.mark.parametrize("labels", [True, False], ids=task)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_padded_flavour_equals_each_sequence_alone(request, tp1, layout, model, labels):
    """NeMo-RL's default flavour: LM losses, logits, MTP targets/losses and every gradient equal the
    per-sequence reference (gradients of LM + MTP loss, each normalised by its global token count)."""
    ranks = request.getfixturevalue(layout)
    reference = tp1[0][f"reference/{model}/{task(labels)}"]
    result = ranks[0][packed_name(model, "padded", labels)]
    real = row_of(layout, "padded").real_slots().numpy()
    assert_lm_matches(result, reference, real)
    assert trained(result, real) == trained(reference) and len(trained(reference)) > 0
    assert not result.mtp[0]["trained"][~real].any()  # no padding slot trains
    assert max_abs(result.mtp[0]["losses"][real], reference.mtp[0]["losses"]) <= TOLERANCE
    assert grad_delta(result, reference) <= TOLERANCE
    assert all(np.array_equal(rank[packed_name(model, "padded", labels)].lm_losses, result.lm_losses) for rank in ranks)


@pytest.mark.parametrize("layout", layout_params("cp2", "tp2_cp2_sp"))
def test_grouped_query_attention_under_cp(request, tp1, layout):
    """4 query heads on 2 K/V heads: the CP attention repeats the all-gathered K/V heads."""
    result = request.getfixturevalue(layout)[0]["packed/hybrid/padded/sft/gqa"]
    reference = tp1[0]["reference/hybrid/sft/gqa"]
    real = row_of(layout, "padded").real_slots().numpy()
    assert_lm_matches(result, reference, real)
    assert max_abs(result.lm_losses[real], tp1[0]["reference/hybrid/sft"].lm_losses) > 1e-3  # GQA changed the model
    assert grad_delta(result, reference) <= TOLERANCE


@pytest.mark.parametrize("labels", [True, False], ids=task)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_unpadded_flavour_lm_equals_each_sequence_alone(request, tp1, layout, labels):
    """Real boundaries in cu_seqlens_q: attention and RoPE go by the padded ones, so the LM side is exact."""
    real = row_of(layout, "unpadded").real_slots().numpy()
    for model in MODELS:
        result = request.getfixturevalue(layout)[0][packed_name(model, "unpadded", labels)]
        assert_lm_matches(result, tp1[0][f"reference/{model}/{task(labels)}"], real)


@pytest.mark.parametrize("labels", [True, False], ids=task)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_unpadded_flavour_mtp_is_wrong_on_stock_and_equals_each_sequence_alone_with_mtp_packed_roll(
    request, tp1, layout, labels
):
    """Stock megatron-core rolls the packed MTP labels and loss mask by cu_seqlens_q, i.e. by the real
    boundaries in a padded layout (under CP divided by the CP size): positions from the second sequence
    on train shifted targets or none, and padding slots train (Megatron-LM #4494/#6205). With
    mtp-packed-roll the MTP targets, losses and every gradient equal each sequence alone."""
    reference = tp1[0][f"reference/hybrid/{task(labels)}"]
    results = request.getfixturevalue(layout)[0]
    stock = results[packed_name("hybrid", "unpadded", labels)]
    fixed = results[packed_name("hybrid", "unpadded", labels) + "/roll-fixed"]
    real = row_of(layout, "unpadded").real_slots().numpy()
    expected = trained(reference)
    assert trained(stock, real) != expected or stock.mtp[0]["trained"][~real].any()
    assert grad_delta(stock, reference) > 1e-3
    assert trained(fixed, real) == expected and not fixed.mtp[0]["trained"][~real].any()
    assert max_abs(fixed.mtp[0]["losses"][real], reference.mtp[0]["losses"]) <= TOLERANCE
    assert grad_delta(fixed, reference) <= TOLERANCE


@pytest.mark.parametrize("flavour", ["padded", "unpadded"])
def test_without_a_mask_mtp_packed_roll_masks_each_sequence_end_and_its_padding(tp1, flavour):
    """No loss mask (all ones, padding included): stock trains padding targets from each padded
    sequence's last-but-one real token on. Given the real lengths (unpadded flavour), mtp-packed-roll
    masks every sequence's last real token(s) and its padding (Megatron-LM #7278), so exactly the real
    next-token targets train; the padded flavour tells nobody where a sequence really ends, so there
    the fix trains what stock trains and only a loss mask zero on padding helps (test above)."""
    row = row_of("tp1", flavour)
    unmasked = dataclasses.replace(row, prompts=(0,) * len(row.prompts))
    weights, targets = (t.numpy() for t in expected_mtp(unmasked, labels=False))
    expected = {(int(slot), int(targets[slot])) for slot in np.nonzero(weights)[0]}
    stock = tp1[0][packed_name("hybrid", flavour, False, None)]
    fixed = tp1[0][packed_name("hybrid", flavour, False, None) + "/roll-fixed"]
    assert trained(stock) != expected
    assert trained(fixed) == (expected if flavour == "unpadded" else trained(stock))


def test_reference_trains_the_expected_mtp_targets(tp1):
    """The per-sequence reference (stock BSHD) trains exactly what the text says each position must."""
    for labels in (True, False):
        weights, targets = (t.numpy() for t in expected_mtp(packed_row(1), labels=labels))
        expected = {(int(slot), int(targets[slot])) for slot in np.nonzero(weights)[0]}
        for model in MODELS:
            reference = tp1[0][f"reference/{model}/{task(labels)}"]
            assert trained(reference) == expected
            assert np.array_equal(reference.mtp[0]["trained"], weights != 0)


def roll_within(values, boundaries):
    """megatron-core 0.19's packed roll at CP1 (``_roll_tensor_packed_seq``): each segment of
    ``boundaries`` shifted left by one with its last slot zeroed; slots past the last boundary kept."""
    rolled = values.copy()
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        if end > start:
            rolled[start : end - 1], rolled[end - 1] = values[start + 1 : end], 0
    return rolled


@pytest.mark.parametrize("loss_mask", ["explicit", None])
@pytest.mark.parametrize("flavour", ["padded", "unpadded"])
def test_stock_rolls_packed_mtp_by_cu_seqlens_q(tp1, flavour, loss_mask):
    """What stock trains in an RL forward at TP1 is two rolls within cu_seqlens_q: right in the padded
    flavour with a mask that is zero on padding; in the unpadded flavour every sequence after the first
    is shifted (and padding trains); without a mask the slots from each padded sequence's last-but-one
    real token to its padding train padding targets."""
    row = row_of("tp1", flavour)
    result = tp1[0][packed_name("hybrid", flavour, False, loss_mask)]
    boundaries = row.packed_seq_params.cu_seqlens_q.tolist()
    mask = row.loss_mask[0].numpy() if loss_mask else np.ones(row.input_ids.shape[1])
    labels = roll_within(row.input_ids[0].numpy(), boundaries)
    targets, weights = roll_within(labels, boundaries), roll_within(roll_within(mask, boundaries), boundaries)
    predicted = {(int(slot), int(targets[slot])) for slot in np.nonzero(weights)[0]}
    assert trained(result) == predicted

    weights, targets = (t.numpy() for t in expected_mtp(row, labels=False))
    if loss_mask is None:  # the expectation for an all-ones mask over the real tokens
        unmasked = dataclasses.replace(row, prompts=(0,) * len(row.prompts))
        weights, targets = (t.numpy() for t in expected_mtp(unmasked, labels=False))
    expected = {(int(slot), int(targets[slot])) for slot in np.nonzero(weights)[0]}
    if flavour == "padded" and loss_mask:
        assert predicted == expected
        return
    assert predicted != expected
    wrong_slots = {slot for slot, _ in predicted ^ expected}
    starts, real_lengths = row.cu_seqlens_padded.tolist(), lengths()
    if flavour == "padded":  # no mask: exactly the slots [L-2, P-2) of each padded sequence, padding targets
        pad_targets = {(start + i, 0) for start, n, end in zip(starts, real_lengths, starts[1:])
                       for i in range(n - 2, end - start - 2)}
        assert predicted - expected == pad_targets and expected <= predicted
    else:  # the first sequence keeps its real slots; every later one is shifted
        first = range(starts[0], starts[0] + real_lengths[0])
        assert {slot for slot, _ in expected if slot in first} <= {slot for slot, _ in predicted}
        assert all(any(start <= slot < end for slot in wrong_slots) for start, end in zip(starts[1:], starts[2:]))
