"""The overlay's megatron-core fixes on the path users run: HybridModel, packed THD, context parallelism.

Each fix is off and on in the same rank pool (stock megatron-core, the pinned release, otherwise), on the same model.
mtp-sp-scatter: a HybridModel built with ``scatter_embedding_sequence_parallel=False`` (Megatron-Bridge's
Nemotron Omni/VL providers build it so) never scatters the MTP embedding (Megatron-LM PR #6256).
mtp-loss-mask: an RL forward (labels=None) trains the MTP head on every token unless the mask reaches
the model in its input_ids' layout (NeMo-RL PR #3494), here packed and CP-sliced.
"""

import numpy as np
import pytest
from test_packed_thd import TOLERANCE, assert_lm_matches, grad_delta, max_abs, row_of, trained
from testbed_cases import layout_params

from mtp_overlay.bed.models.packed import expected_mtp

SP_LAYOUTS = layout_params("tp2_sp", "tp2_cp2_sp")
CONCAT_CRASH = "Sizes of tensors must match except in dimension 2"


# --- mtp-sp-scatter --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", SP_LAYOUTS)
def test_sp_scatter_not_scattering_hybrid_crashes_without_the_fix_and_matches_with_it(request, tp1, layout):
    """BSHD (tiny_gpt.train_step): stock crashes in the MTP concat on every rank; with the fix the model
    trains exactly like the same HybridModel that scatters its own embedding, and like TP1 (under CP
    with mtp-cp-loss-scale on both)."""
    ranks = request.getfixturevalue(layout)
    assert all(CONCAT_CRASH in rank["sp_scatter/bshd/off"]["error"] for rank in ranks)
    fixed, scattering = ranks[0]["sp_scatter/bshd/on"], ranks[0]["bshd/hybrid"]
    assert fixed["error"] is None
    assert fixed["step"] == scattering["step"]
    assert max(np.abs(a - b).max() for a, b in zip(fixed["grads"], scattering["grads"])) == 0
    assert fixed["step"].zero_grad_params == ()
    reference = tp1[0]["bshd/hybrid"]["step"]
    assert fixed["step"].lm_loss == pytest.approx(reference.lm_loss, rel=1e-5)
    assert fixed["step"].mtp_losses == pytest.approx(reference.mtp_losses, rel=1e-5)
    assert fixed["step"].mtp_tokens == reference.mtp_tokens


@pytest.mark.parametrize("layout", SP_LAYOUTS)
def test_sp_scatter_not_scattering_hybrid_on_packed_thd(request, tp1, layout):
    """Packed (padded flavour, SFT): the same crash; with the fix LM, MTP and gradients equal each
    sequence alone."""
    ranks = request.getfixturevalue(layout)
    assert all(CONCAT_CRASH in rank["sp_scatter/packed/off"].error for rank in ranks)
    fixed, reference = ranks[0]["sp_scatter/packed/on"], tp1[0]["reference/hybrid/sft"]
    real = row_of(layout, "padded").real_slots().numpy()
    assert_lm_matches(fixed, reference, real)
    assert trained(fixed, real) == trained(reference)
    assert max_abs(fixed.mtp[0]["losses"][real], reference.mtp[0]["losses"]) <= TOLERANCE
    assert grad_delta(fixed, reference) <= TOLERANCE


# --- mtp-loss-mask ---------------------------------------------------------------------------------
def expected_rl_mtp():
    weights, targets = (t.numpy() for t in expected_mtp(row_of("cp2", "padded"), labels=False))
    return {(int(slot), int(targets[slot])) for slot in np.nonzero(weights)[0]}


def assert_trains_the_response_mask(result, tp1, cp2):
    """MTP trains exactly the response tokens, and everything equals each sequence alone."""
    assert result.error is None, result.error
    assert trained(result) == expected_rl_mtp()
    reference = tp1[0]["reference/hybrid/rl"]
    real = row_of("cp2", "padded").real_slots().numpy()
    assert_lm_matches(result, reference, real)
    assert max_abs(result.mtp[0]["losses"][real], reference.mtp[0]["losses"]) <= TOLERANCE
    assert grad_delta(result, reference) <= TOLERANCE
    assert grad_delta(result, cp2[0]["packed/hybrid/padded/rl"]) <= TOLERANCE  # = passing the mask explicitly


def test_loss_mask_scoped_on_packed_cp2(tp1, cp2):
    """The trainer scopes the CP-local packed mask and passes none: stock trains prompts and padding
    targets (exactly what it trains without any mask); the hook routes the mask to the model."""
    expected = expected_rl_mtp()
    for rank in cp2:
        stock = rank["loss_mask/scoped/off"]
        assert trained(stock) == trained(tp1[0]["packed/hybrid/padded/rl/None"]) != expected
        assert expected < trained(stock) and any(target == 0 for _, target in trained(stock) - expected)
        assert_trains_the_response_mask(rank["loss_mask/scoped/on"], tp1, cp2)


def test_loss_mask_through_a_model_that_slices_cp_itself(tp1, cp2):
    """The Omni contract: the full-row mask goes in explicitly with the full row, the wrapper slices both
    and hands back ``(output, sliced_loss_mask)``; the hook checks the sliced mask against the sliced
    input_ids and changes nothing on such a call."""
    row = row_of("cp2", "padded")
    for rank in cp2:
        fixed, stock = rank["loss_mask/wrapper/explicit/on"], rank["loss_mask/wrapper/explicit/off"]
        assert_trains_the_response_mask(fixed, tp1, cp2)
        assert np.array_equal(fixed.sliced_loss_mask, row.loss_mask[0].numpy())  # each rank's share, reassembled
        assert grad_delta(fixed, stock) == 0 and trained(fixed) == trained(stock)


def test_loss_mask_scoped_around_a_model_that_slices_cp_itself(tp1, cp2):
    """A full-row mask scoped around a self-slicing model reaches the inner model after its slicing: with
    the hook that is a layout error naming both shapes; stock ignores it and trains every token."""
    row = row_of("cp2", "padded")
    local, full = row.input_ids.shape[1] // 2, row.input_ids.shape[1]
    for rank in cp2:
        error = rank["loss_mask/wrapper/scoped/on"].error
        assert error.startswith(f"ValueError: loss_mask has layout [1, {full}] but input_ids has [1, {local}]")
        assert trained(rank["loss_mask/wrapper/scoped/off"]) == trained(tp1[0]["packed/hybrid/padded/rl/None"])


def test_loss_mask_in_the_unpadded_flavour_needs_mtp_packed_roll_and_trains_right_with_it(tp1, cp2):
    """cu_seqlens_q != cu_seqlens_q_padded (NeMo-RL's model_slices_context_parallel_inputs path): with
    the stock roll the hook refuses, naming mtp-packed-roll (stock would roll the MTP labels and mask
    across the padding, see test_packed_thd); with mtp-packed-roll on the same call trains exactly the
    response tokens and equals each sequence alone."""
    row = row_of("cp2", "unpadded")
    reference = tp1[0]["reference/hybrid/rl"]
    real = row.real_slots().numpy()
    for rank in cp2:
        error = rank["loss_mask/unpadded/on"].error
        assert error.startswith(f"ValueError: packed_seq_params.cu_seqlens_q {row.cu_seqlens.tolist()} differs from ")
        assert f"cu_seqlens_q_padded {row.cu_seqlens_padded.tolist()}" in error and "mtp-packed-roll" in error
        fixed = rank["loss_mask/unpadded/on+roll"]
        assert fixed.error is None, fixed.error
        assert trained(fixed, real) == trained(reference)
        assert max_abs(fixed.mtp[0]["losses"][real], reference.mtp[0]["losses"]) <= TOLERANCE
        assert grad_delta(fixed, reference) <= TOLERANCE
