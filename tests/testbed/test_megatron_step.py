"""Megatron's own training step in the test bed (mtp_overlay.bed.steps.megatron_step).

The tiny GPT with one MTP layer (``mtp_detach_heads``: the MTP block learns from the MTP loss only,
everything else from the LM loss only) goes through DistributedDataParallel, the no-pipelining
schedule, finalize_model_grads and megatron-core's optimizer, on gloo ranks. Parity across TP1,
TP2+SP, CP2 and TP2xCP2+SP is the proof that the step, the shims and the loss shapes are right; at
TP1 it must agree with the hand-written ``tiny_gpt.train_step``. Under CP the MTP gradient only
matches with mtp-cp-loss-scale on (stock megatron-core normalises each CP rank's MTP loss by its
own counts, Megatron-LM PR #7498; tests/fixes/mtp_cp_loss_scale shows both sides).
"""

import math

import numpy
import pytest
import torch

from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.steps.megatron_step import check_step_arguments, relative_error
from mtp_overlay.bed.oracles.packed_reference import packed_params

CP_FIX = "mtp-cp-loss-scale"
BATCH_SIZE, SEQ_LENGTH, PROMPT = 2, 32, 12
# name -> (calculate_per_token_loss, MegatronStep.step arguments)
CASES = {
    "2-output": (False, dict(loss="2-output")),
    "3-output": (False, dict(loss="3-output")),
    "3-output per-token": (True, dict(loss="3-output")),
    "nemo-rl": (True, dict(loss="nemo-rl", mtp_grad_scale="global-valid-tokens")),
    "rl 2-output": (False, dict(loss="2-output", labels=False)),
    "rl nemo-rl": (True, dict(loss="nemo-rl", labels=False, mtp_grad_scale="global-valid-tokens")),
    "2 microbatches per-token": (True, dict(loss="3-output")),
    "one 4-row microbatch per-token": (True, dict(loss="3-output")),
}


def batch(seed=0):
    """make_batch with a prompt: the loss mask is zero over the first PROMPT positions. For the RL
    forward the same mask is the input_ids-aligned MTP mask, the LM mask its label-aligned shift."""
    from mtp_overlay.bed.models.tiny_gpt import make_batch

    result = make_batch(batch_size=BATCH_SIZE, seq_length=SEQ_LENGTH, seed=seed)
    result["loss_mask"][:, :PROMPT] = 0
    return result


def rl_batch(seed=0):
    result = batch(seed)
    result["mtp_loss_mask"] = result["loss_mask"]
    result["loss_mask"] = torch.cat([result["mtp_loss_mask"][:, 1:], result["mtp_loss_mask"][:, -1:]], dim=1)
    return result


def microbatches(name):
    if name.startswith("rl "):
        return [rl_batch()]
    if name == "2 microbatches per-token":
        return [batch(0), batch(1)]
    if name == "one 4-row microbatch per-token":
        halves = [batch(0), batch(1)]
        return [{key: torch.cat([half[key] for half in halves]) for key in halves[0]}]
    return [batch()]


def train(sequence_parallel=False):
    """Worker: every case of CASES on a fresh tiny GPT through Megatron's step (gradients only), the
    hand-written train_step on the same batch, and two Adam steps through megatron-core's optimizer.

    Returns {"megatron": {case: result}, "old": {per_token: StepResult}, "adam": (first, second)}.
    """
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, train_step

    def model(per_token):
        return build_tiny_gpt(
            sequence_parallel=sequence_parallel, mtp_detach_heads=True, calculate_per_token_loss=per_token
        )

    megatron = {}
    for name, (per_token, arguments) in CASES.items():
        step = MegatronStep(model(per_token), optimizer=None)
        megatron[name] = step.step(microbatches(name), update=False, **arguments)
    old = {per_token: train_step(model(per_token), batch()) for per_token in (False, True)}
    adam = MegatronStep(model(False), optimizer="megatron", lr=1e-2)
    first = adam.step([batch()], loss="2-output")
    second = adam.step([batch()], loss="2-output", update=False)
    return {"megatron": megatron, "old": old, "adam": (first, second)}


def assert_same_step(result, reference, *, lm=True, rel=1e-5):
    assert result.lm_loss == pytest.approx(reference.lm_loss, rel=rel)
    assert result.mtp_losses == pytest.approx(reference.mtp_losses, rel=rel)
    assert result.mtp_tokens == reference.mtp_tokens
    assert result.zero_grad_params == ()
    assert result.relative_error(reference, "mtp") < rel
    if lm:
        assert result.relative_error(reference, "lm") < rel


def assert_matches_old_step(result, old, rel=1e-6):
    """Megatron's step against the hand-written one: losses, tokens and per-module gradient norms."""
    assert result.lm_loss == pytest.approx(old.lm_loss, rel=rel)
    assert result.mtp_tokens == old.mtp_tokens
    assert result.grad_norm == pytest.approx(old.grad_norm, rel=rel)
    assert result.group_grad_norms == pytest.approx(old.group_grad_norms, rel=rel)


@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(train, 1, fixes=[])[0]


def test_tp1_steps_train_and_agree_with_the_hand_written_step(tp1):
    megatron, old = tp1["megatron"], tp1["old"]
    for name, result in megatron.items():
        assert result.zero_grad_params == (), name
        assert math.isfinite(result.lm_loss) and len(result.mtp_losses) == 1, name
        assert result.grads["mtp"].size and result.grads["lm"].size, name
    # one microbatch at TP1: pretrain_gpt's shapes, old or new, in either mode, are one objective
    assert_matches_old_step(megatron["3-output"], old[False])
    assert_matches_old_step(megatron["3-output per-token"], old[True])
    assert_matches_old_step(megatron["2-output"], old[False])
    assert megatron["3-output"].mtp_losses == pytest.approx(old[False].mtp_losses, rel=1e-6)
    # depth 1 weights position i by the label-aligned mask[i+1] (the last position has none)
    assert megatron["2-output"].mtp_tokens == (float(batch()["loss_mask"][:, 1:].sum()),)
    # NeMo-RL's flow (loss over global valid tokens, mtp_grad_scale_func = 1 / those tokens) is the
    # per-token objective again
    for part in ("lm", "mtp"):
        assert megatron["nemo-rl"].relative_error(megatron["3-output per-token"], part) < 1e-6
    # RL forward: the input_ids-aligned MTP mask is rolled once more (labels derived from input_ids)
    assert megatron["rl 2-output"].mtp_tokens == (float(rl_batch()["mtp_loss_mask"][:, 2:].sum()),)
    assert megatron["rl nemo-rl"].mtp_tokens == megatron["rl 2-output"].mtp_tokens
    assert megatron["rl nemo-rl"].relative_error(megatron["rl 2-output"], "lm") < 1e-6


def test_tp1_microbatches_are_accumulated_like_one_batch(tp1):
    """Per-token loss: two microbatches give the LM gradient of one microbatch holding both."""
    two, one = tp1["megatron"]["2 microbatches per-token"], tp1["megatron"]["one 4-row microbatch per-token"]
    assert two.lm_loss == pytest.approx(one.lm_loss, rel=1e-6)
    assert two.relative_error(one, "lm") < 1e-6
    assert two.mtp_tokens == one.mtp_tokens  # the tracker sums over microbatches
    # MTP: per microbatch, Megatron weights by its own original/rolled count ratio; same here (equal rows)
    assert two.relative_error(one, "mtp") < 1e-6


def test_tp1_megatron_optimizer_steps_the_weights(tp1):
    first, second = tp1["adam"]
    assert first.update_norm > 0 and second.update_norm is None
    assert second.lm_loss < first.lm_loss and second.mtp_loss < first.mtp_loss


def test_tp2_sequence_parallel_matches_tp1(tp1):
    results = run_ranks_checked(train, 2, tp=2, fixes=[], kwargs=dict(sequence_parallel=True))
    check_layout(results[0], tp1)


def test_cp2_matches_tp1_with_cp_loss_scale(tp1):
    results = run_ranks_checked(train, 2, cp=2, fixes=[CP_FIX])
    check_layout(results[0], tp1, cp=True)


@pytest.mark.slow
def test_tp2_cp2_sequence_parallel_matches_tp1_with_cp_loss_scale(tp1):
    results = run_ranks_checked(train, 4, tp=2, cp=2, fixes=[CP_FIX], kwargs=dict(sequence_parallel=True))
    check_layout(results[0], tp1, cp=True)


@pytest.mark.gpu
def test_cuda_tp1_matches_cpu(tp1):
    result = run_ranks_checked(train, 1, fixes=[], device="cuda")[0]
    for name, step in result["megatron"].items():
        assert_same_step(step, tp1["megatron"][name], rel=1e-4)


def check_layout(result, tp1, cp=False):
    for name, step in result["megatron"].items():
        # 3-output without per-token loss: the schedule divides by each CP rank's own count and DDP
        # averages, so the LM gradient is a mean of per-rank means (Megatron-LM PR #7513), as in the
        # hand-written step
        lm_exact = not (cp and name == "3-output")
        assert_same_step(step, tp1["megatron"][name], lm=lm_exact)
        if not lm_exact:
            assert step.relative_error(tp1["megatron"][name], "lm") > 0.1
    assert_matches_old_step(result["megatron"]["3-output"], result["old"][False], rel=1e-5)
    assert_matches_old_step(result["megatron"]["3-output per-token"], result["old"][True], rel=1e-5)
    first, second = result["adam"]
    assert first.update_norm == pytest.approx(tp1["adam"][0].update_norm, rel=1e-4)
    assert second.lm_loss == pytest.approx(tp1["adam"][1].lm_loss, rel=1e-5)


def test_relative_error():
    reference = numpy.array([3.0, 4.0], dtype=numpy.float32)
    assert relative_error(reference, reference) == 0.0
    assert relative_error(numpy.array([3.0, 5.0]), reference) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="different shapes"):
        relative_error(numpy.zeros(3), reference)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(loss="4-output"), "loss must be one of"),
        (dict(loss="2-output", per_token=True), "needs calculate_per_token_loss=False"),
        (dict(loss="nemo-rl"), "needs calculate_per_token_loss=True"),
        (dict(mtp_grad_scale=-1.0), "mtp_grad_scale must be None, a positive number"),
        (dict(mtp_grad_scale="tokens"), "mtp_grad_scale must be None, a positive number"),
        (dict(update=True, optimizer=None), "update=True needs an optimizer"),
        (dict(microbatches=[]), "non-empty list"),
        (dict(microbatches=[{"input_ids": torch.zeros(2, 32)}]), "must be a dict with keys"),
        (dict(microbatches=[dict(batch(), position_ids=torch.zeros(2, 16))]), r"has shape \(2, 16\), expected \(2, 32\)"),
        (dict(microbatches=[rl_batch()]), "mtp_loss_mask .* but labels=True"),
        (dict(mtp_mask="implicit"), "mtp_mask must be one of"),
        (dict(mtp_mask="scoped"), "mtp_mask='scoped' needs labels=False"),
        (dict(microbatches=[dict(batch(), packed_seq_params="thd")]), "'packed_seq_params'] must be a PackedSeqParams"),
        (dict(microbatches=[dict(batch(), packed_seq_params=packed_params([20, 12]))]),
         r"one \[1, T\] row with T the last padded boundary \(32\), got input_ids of shape \(2, 32\)"),
        (dict(microbatches=[dict({k: v[:1] for k, v in batch().items()}, packed_seq_params=packed_params([8, 8]))]),
         r"last padded boundary \(16\), got input_ids of shape \(1, 32\)"),
    ],
)
def test_bad_step_arguments_are_refused_naming_the_argument(change, message):
    arguments = dict(microbatches=[batch()], loss="3-output", labels=True, mtp_grad_scale=None, per_token=False,
                     update=False, optimizer=None, mtp_mask="explicit")
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        check_step_arguments(**arguments)
