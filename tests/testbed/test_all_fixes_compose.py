"""All of the overlay's megatron-core fixes at once, through Megatron's own training step, on the real path.

HybridModel; one packed THD row of four sequences in NeMo-RL's unpadded flavour (real ``cu_seqlens_q``,
padded ``cu_seqlens_q_padded``: the ``model_slices_context_parallel_inputs`` path of NeMo-RL PR #3494)
built with ``mtp_overlay.mtp.pack_sequences`` / ``packed_seq_params(real_lengths=True)``; an RL forward
(``labels=None``) whose MTP mask of response tokens is scoped (``loss_mask_scope``) or passed
explicitly, or the full row handed to a model that slices CP itself; the per-token 3-output loss and
NeMo-RL's; one step of ``get_forward_backward_func`` -> DDP -> ``finalize_model_grads``
(``mtp_overlay.bed.engines.parity``). The reference: each sequence alone, unpacked, at TP1, through the
same step. Each path needs a known set of fixes (``parity.needed_fixes``): mtp-packed-roll (stock rolls
by the real boundaries, Megatron-LM #4494/#6205), mtp-loss-mask when the mask is scoped (NeMo-RL PR
#3494), mtp-cp-loss-scale under CP (Megatron-LM PR #7498), mtp-sp-scatter for a model that does not
scatter its embedding under SP (Megatron-LM PR #6256). With all of them on, the MTP block's and the
rest of the model's gradients equal the reference; with any one it needs missing (stock, each fix
alone, all but one) the step differs, is refused or crashes, as ``parity.expected_outcome`` predicts.
The zoo model with the MoE aux loss on (``parity.COMPOSED_MOE``: the Super recipe's MTP ``"*E"`` at 2
depths, BSHD, the mask passed) needs mtp-moe-router (and mtp-cp-loss-scale under CP) to equal its
reference, the TP1 step with its MTP block's MoE layers flagged by hand.
"""

import numpy as np
import pytest

from mtp_overlay.bed.engines import parity
from mtp_overlay.bed.models.packed import expected_mtp

EXACT = 1e-5  # float32 gradients summed in another order: relerr and max |dgrad|
DIFFERS = 0.05  # the smallest MTP-gradient relerr a missing fix leaves on HybridModel is 0.15
# on the zoo a missing mtp-moe-router moves only the MTP router's aux-loss gradient (x2) and what it
# reaches: the smallest MTP-block max |dgrad| it leaves is well above float noise (EXACT)
MOE_DIFFERS = 10 * EXACT
CRASH = "RuntimeError: Sizes of tensors must match except in dimension 2"
REFUSAL = "ValueError: packed_seq_params.cu_seqlens_q "
EVERYTHING = parity.megatron_core_fixes()


@pytest.fixture(scope="module")
def tp1_pool():
    """The references (each sequence alone, both losses; the zoo flagged by hand), the TP1 composition
    cases, and the padded flavour on stock at TP1 (upstream's own packed rolls are right there)."""
    padded = parity.Case("hybrid", "padded", pad_multiple=parity.PARALLELISMS["TP1"]["pad_multiple"])
    outcomes = parity.run_layout("TP1", parity.composition_references() + [padded] + parity.composition_cases("TP1"))
    count = len(parity.composition_references())
    references = {parity.composition_reference_key(outcome.case): outcome for outcome in outcomes[:count]}
    return references, outcomes[count], outcomes[count + 1 :]


@pytest.fixture(scope="module")
def references(tp1_pool):
    return tp1_pool[0]


def check_composition(outcomes, references, parallelism):
    """Every case gives what its missing fixes predict; returns {category: count}."""
    seen = {}
    for outcome in outcomes:
        case, name = outcome.case, parity.composition_name(outcome.case)
        expected = parity.expected_outcome(case, parallelism)
        seen[expected] = seen.get(expected, 0) + 1
        if expected == "refused":
            assert outcome.error is not None and outcome.error.startswith(REFUSAL), (name, outcome.error)
            assert "mtp-packed-roll" in outcome.error, name
            continue
        if expected == "crash":
            assert outcome.error is not None and outcome.error.startswith(CRASH), (name, outcome.error)
            continue
        assert outcome.error is None, (name, outcome.error)
        reference = references[parity.composition_reference_key(case)]
        max_mtp, max_rest, mtp, rest = outcome.compare(reference)
        if expected == "exact":
            assert max(mtp, rest, max_mtp, max_rest) <= EXACT, (name, mtp, rest, max_mtp, max_rest)
            assert outcome.step.lm_loss == pytest.approx(reference.step.lm_loss, rel=EXACT), name
            assert outcome.step.mtp_losses == pytest.approx(reference.step.mtp_losses, rel=EXACT), name
            assert outcome.step.mtp_tokens == reference.step.mtp_tokens, name
            assert outcome.step.zero_grad_params == (), name
        elif case.model == parity.COMPOSED_MOE:
            assert max_mtp > MOE_DIFFERS, (name, max_mtp)
        else:
            assert mtp > DIFFERS, (name, mtp)
            # the LM loss itself is exact on every path (attention and RoPE go by the padded boundaries)
            assert outcome.step.lm_loss == pytest.approx(reference.step.lm_loss, rel=EXACT), name
    return seen


def by_name(outcomes):
    return {parity.composition_name(outcome.case): outcome for outcome in outcomes}


def test_reference_is_each_sequence_alone(tp1_pool):
    """The reference trains exactly the response tokens' MTP targets; the padded flavour, which stock
    megatron-core rolls right at TP1 (cu_seqlens_q is the padded layout), trains the same."""
    references, padded, _ = tp1_pool
    row = parity.packed_row(1)
    weights, _ = expected_mtp(row, labels=False)
    for loss in parity.LOSSES:
        reference = references["hybrid", loss]
        assert reference.error is None, reference.error
        assert reference.step.mtp_tokens == (float(weights.sum()),) and weights.sum() > 0
        assert reference.step.zero_grad_params == ()
    nemo_rl, three_output = references["hybrid", "nemo-rl"], references["hybrid", "3-output"]
    assert nemo_rl.compare(three_output)[2:] == pytest.approx((0, 0), abs=1e-6)
    assert padded.error is None and max(padded.compare(references["hybrid", "3-output"])) <= EXACT
    zoo = references[parity.COMPOSED_MOE, "3-output"]
    assert zoo.error is None and zoo.case.mtp_moe_flag and zoo.step.zero_grad_params == ()


def test_tp1_needs_packed_roll_and_the_mask_route(tp1_pool):
    """Without CP the unpadded flavour needs mtp-packed-roll (and mtp-loss-mask for a scoped mask)."""
    references, _, outcomes = tp1_pool
    seen = check_composition(outcomes, references, "TP1")
    # HybridModel 10 / 11 / 2, the zoo 3 / 2 (stock and all but mtp-moe-router differ)
    assert seen == {"exact": 13, "differs": 13, "refused": 2}
    cases = by_name(outcomes)
    stock = cases["hybrid explicit 3-output: stock"]
    assert stock.step.mtp_tokens != references["hybrid", "3-output"].step.mtp_tokens  # shifted spans, padding trained


def test_cp2_all_fixes_compose_and_each_is_needed(references):
    """CP2 (2 ranks): every megatron-core fix on equals each sequence alone; stock, each fix alone and
    every leave-one-out that drops a needed fix differ or are refused (the table in the README)."""
    outcomes = parity.run_layout("CP2", parity.composition_cases("CP2"))
    seen = check_composition(outcomes, references, "CP2")
    # HybridModel 8 / 13 / 2, the zoo 1 / 4 (it needs mtp-moe-router and mtp-cp-loss-scale)
    assert seen == {"exact": 9, "differs": 17, "refused": 2}
    cases = by_name(outcomes)
    # mtp-packed-roll with the mask explicit trains the right tokens, yet under CP each rank still
    # normalises by its own counts: only mtp-cp-loss-scale on top makes it exact
    roll_only = cases["hybrid explicit 3-output: mtp-packed-roll"]
    assert roll_only.step.mtp_tokens == references["hybrid", "3-output"].step.mtp_tokens
    assert roll_only.compare(references["hybrid", "3-output"])[2] > DIFFERS
    # a scoped mask without the hook is dropped: MTP trains prompt tokens too
    no_hook = cases["hybrid scoped 3-output: all but mtp-loss-mask"]
    assert no_hook.step.mtp_tokens[0] > references["hybrid", "3-output"].step.mtp_tokens[0]
    # the zoo's MTP router: mtp-moe-router alone counts its aux loss once, yet under CP its MTP loss
    # still needs mtp-cp-loss-scale; the two together equal the flagged reference
    zoo = references[parity.COMPOSED_MOE, "3-output"]
    alone = cases[f"{parity.COMPOSED_MOE} explicit 3-output: mtp-moe-router"]
    assert alone.compare(zoo)[0] > MOE_DIFFERS
    assert max(cases[f"{parity.COMPOSED_MOE} explicit 3-output: all"].compare(zoo)) <= EXACT


@pytest.mark.slow
def test_tp2_cp2_sp_all_fixes_compose_and_each_is_needed(references):
    """TP2xCP2+SP (4 ranks), the scatter=False HybridModel too (Nemotron Omni's setting): stock crashes
    in the MTP concat until mtp-sp-scatter is on; with every fix both models equal each sequence
    alone, through a self-slicing model as well; the zoo equals its flagged reference."""
    outcomes = parity.run_layout("TP2xCP2+SP", parity.composition_cases("TP2xCP2+SP"))
    seen = check_composition(outcomes, references, "TP2xCP2+SP")
    # HybridModel 8 / 13 / - / 2, scatter=False 7 / 3 / 11 / 2, the zoo 1 / 4
    assert seen == {"exact": 16, "differs": 20, "crash": 11, "refused": 4}
    cases = by_name(outcomes)
    assert np.array_equal(cases["hybrid, scatter=False scoped 3-output: all"].step.grads["mtp"],
                          cases["hybrid scoped 3-output: all"].step.grads["mtp"])
