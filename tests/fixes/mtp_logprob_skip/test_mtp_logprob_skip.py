"""mtp-logprob-skip on real megatron-core (the pinned release, TP1 gloo rank): a forward that cannot
train the MTP head skips the MTP block, on the tiny GPTModel (2 MTP layers) and the zoo HybridModel
(Mamba, attention, MoE; the Super recipe's repeated MTP layer at 2 depths).

One rank runs every case, stock (fix uninstalled) and fixed, on the same weights and batch.
"""

import pytest

from mtp_overlay.bed.runtime.launcher import run_ranks_checked

FIX = "mtp-logprob-skip"
MODELS = ("gpt", "zoo")


def cases_worker():
    """Rank worker: per model, what each forward returned, recorded and ran, stock and fixed."""
    import torch

    import mtp_overlay
    from mtp_overlay import mtp
    from mtp_overlay.bed.fixes.mtp_logprob_skip import build, logprob_forward, stock_logprob_forward
    from mtp_overlay.bed.models.tiny_gpt import make_batch, train_step
    from mtp_overlay.bed.steps.moe import fresh_moe_tracker

    batch = make_batch()
    facts = {"status": {row.name: row.state for row in mtp_overlay.status()}[FIX]}
    mtp_overlay.uninstall(only=[FIX])
    facts["reproducer"] = stock_logprob_forward()  # what the support matrix's stock run measures
    for name in MODELS:
        model = build(name)
        fresh_moe_tracker()  # sized by the first model that records in this (shared) rank: by this one
        mtp_overlay.uninstall(only=[FIX])
        stock = {"no_grad": logprob_forward(model, batch), "train": train_step(model, batch, labels=None),
                 "grads": _grads(model), "spec": _speculative_step(model)}
        mtp_overlay.install(only=[FIX])
        fixed = {"no_grad": logprob_forward(model, batch), "train": train_step(model, batch, labels=None),
                 "grads": _grads(model), "spec": _speculative_step(model)}
        with mtp.mtp_block_scope(run=False):
            fixed["scoped_with_grad"] = logprob_forward(model, batch, grad=True)
        with mtp.mtp_block_scope(run=True):
            fixed["opt_out"] = logprob_forward(model, batch)
        facts[name] = {
            "stock": stock["no_grad"][1:], "fixed": fixed["no_grad"][1:],
            "logits_equal": torch.equal(stock["no_grad"][0], fixed["no_grad"][0]),
            "scoped_with_grad": fixed["scoped_with_grad"][1:],
            "scoped_logits_equal": torch.equal(stock["no_grad"][0], fixed["scoped_with_grad"][0]),
            "opt_out": fixed["opt_out"][1:],
            "train_equal": stock["train"] == fixed["train"],
            "train_mtp_losses": fixed["train"].mtp_losses,
            "grads_equal": stock["grads"].keys() == fixed["grads"].keys()
            and all(torch.equal(stock["grads"][k], fixed["grads"][k]) for k in stock["grads"]),
            "mtp_grads": sum(k.startswith("mtp.") for k in fixed["grads"]),
            "spec_equal": len(fixed["spec"]) == 2
            and all(torch.equal(a, b) for a, b in zip(stock["spec"], fixed["spec"])),
        }
    return facts


def _grads(model):
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def _speculative_step(model):
    """megatron-core's speculative decoding step: `compute_mtp_single_step` (what the dynamic engine's
    text generation controller calls after verification) under inference mode, on fixed inputs."""
    import torch
    from megatron.core.inference.utils import InferenceMode

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 1, model.config.hidden_size, generator=generator)
    tokens = torch.randint(0, model.vocab_size, (1, 3), generator=generator)
    with torch.inference_mode(), InferenceMode.active():
        return model.compute_mtp_single_step(hidden, tokens, torch.tensor([[5, 9, 17]]))


@pytest.fixture(scope="module")
def facts():
    return run_ranks_checked(cases_worker, 1, fixes=None)[0]  # every fix, as users run it


def test_fix_installs_and_the_reproducer_sees_the_stock_path(facts):
    assert facts["status"] == "installed"
    assert facts["reproducer"] == (True, 2)  # (MTP metric recorded, MTP layer calls)


@pytest.mark.parametrize("model", MODELS)
def test_no_grad_forward_skips_the_mtp_block_with_stock_logits(facts, model):
    found = facts[model]
    # (MTP metric recorded, MTP layer calls): stock runs each depth and logs it from a no-grad forward
    assert found["stock"] == (True, 2), found
    assert found["fixed"] == (False, 0), found
    assert found["logits_equal"]
    assert found["scoped_with_grad"] == (False, 0) and found["scoped_logits_equal"], found
    assert found["opt_out"] == found["stock"], found  # mtp_block_scope(run=True): stock's behaviour


@pytest.mark.parametrize("model", MODELS)
def test_training_forward_and_speculative_decoding_unchanged(facts, model):
    found = facts[model]
    assert found["train_equal"] and found["grads_equal"], found
    assert len(found["train_mtp_losses"]) == 2 and found["mtp_grads"] > 0, found  # MTP trained, both depths
    assert found["spec_equal"], found


def test_mtp_block_scope_takes_a_bool_and_restores_the_outer_word():
    from mtp_overlay.mtp import mtp_block_scope, scoped_mtp_block

    with pytest.raises(TypeError, match=r"mtp_block_scope\(run=\.\.\.\) must be a bool, got 0"):
        with mtp_block_scope(0):
            pass
    with mtp_block_scope(run=False):
        with mtp_block_scope(run=True):
            assert scoped_mtp_block() is True
        assert scoped_mtp_block() is False
    assert scoped_mtp_block() is None
