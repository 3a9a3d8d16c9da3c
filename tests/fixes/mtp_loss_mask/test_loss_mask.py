"""mtp-loss-mask on real megatron-core (the pinned release): the MTP head trains only on masked positions.

RL trainers call GPTModel.forward with labels=None; megatron-core 0.19 then derives the MTP labels
from input_ids and, without a loss_mask, trains the MTP head on every position: prompts, padding and
zero-weight samples. Every case runs the installed megatron-core on gloo ranks (``run_ranks``).
"""

import json
import os

import pytest
import torch
from pins import MEGATRON_CORE

from mtp_overlay.bed.runtime.cases import failure_of
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.runtime.releases import copy_installed, release_site, run_with_release
from mtp_overlay.bed.runtime.syncs import checks_mode

FIX = "mtp-loss-mask"
BATCH, SEQ = 4, 32
# per row: prompt length, sequence length (the rest is padding), sample weight (row 1 filtered out)
PROMPT, LENGTH, WEIGHT = (5, 9, 3, 12), (28, 32, 20, 30), (1.0, 0.0, 1.0, 1.0)
KEPT = [0, 2, 3]
VOCAB = 8  # small enough that an untrained MTP head guesses some tokens right: non-zero acceptance
MODEL = dict(vocab_size=VOCAB)


def token_mask(prompt=PROMPT, length=LENGTH):
    columns = torch.arange(SEQ)[None, :]
    return ((columns >= torch.tensor(prompt)[:, None]) & (columns < torch.tensor(length)[:, None])).float()


def roll_left(mask):
    """Label-aligned mask of the pretraining path: position i weights the label input_ids[i+1]."""
    return torch.nn.functional.pad(mask[:, 1:], (0, 1))


def mtp_positions(mask):
    """Positions the depth-1 MTP loss must count: i weighted by mask[i+2] (rolled twice)."""
    return float(mask[:, 2:].sum())



# --- workers (run on spawned gloo ranks) -----------------------------------------------------------
def tp1_worker():
    import mtp_overlay
    from mtp_overlay import mtp
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch, train_step

    model = build_tiny_gpt(**MODEL)
    batch = make_batch(batch_size=BATCH, seq_length=SEQ, vocab_size=VOCAB)
    mask = mtp.build_mtp_loss_mask(token_mask(), torch.tensor(WEIGHT), model)
    steps = {"explicit": train_step(model, batch, labels=None, loss_mask=mask)}
    with mtp.loss_mask_scope(mask):
        steps["scoped"] = train_step(model, batch, labels=None, loss_mask=None)
    steps["pretraining"] = train_step(model, batch, loss_mask=roll_left(mask))  # explicit labels
    kept = {key: value[KEPT] for key, value in batch.items()}
    steps["sample_removed"] = train_step(model, kept, labels=None, loss_mask=mask[KEPT])
    steps["no_mask"] = train_step(model, batch, labels=None, loss_mask=None)

    ids, positions = batch["input_ids"], batch["position_ids"]
    errors = {"short_mask": failure_of(lambda: model(ids, positions, None, loss_mask=mask[:, :-2]))}
    with mtp.loss_mask_scope(mask):
        errors["scope_with_labels"] = failure_of(lambda: model(ids, positions, None, labels=batch["labels"]))
    with mtp.loss_mask_scope(mask[:, :-2]):  # a wrong mask reaches only MTP models
        errors["scope_on_mtp_model"] = failure_of(lambda: model(ids, positions, None))
        errors["scope_on_plain_model"] = failure_of(lambda: build_tiny_gpt(mtp_num_layers=0, **MODEL)(ids, positions, None))
    with checks_mode("full"):
        errors.update(packed_errors(model, ids, mask))
    errors.update({f"{k}_default": v for k, v in packed_errors(model, ids, mask).items()})

    mtp_overlay.uninstall(only=[FIX])
    try:
        with mtp.loss_mask_scope(mask):
            steps["scoped_fix_off"] = train_step(model, batch, labels=None, loss_mask=None)
        errors["short_mask_fix_off"] = failure_of(lambda: model(ids, positions, None, loss_mask=mask[:, :-2]))
        errors.update({f"{k}_fix_off": v for k, v in packed_errors(model, ids, mask).items()})
    finally:
        mtp_overlay.install(only=[FIX])
    status = mtp_overlay.status(only=[FIX])[0]
    return steps, errors, (status.state, status.reason)


def packed_errors(model, ids, mask):
    """Packed (THD) calls: a mask shifted by one slot, and TE-style (real-length) boundaries."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mtp_overlay import mtp

    lengths = torch.tensor(LENGTH)
    packed = mtp.pack_sequences(ids, lengths, mask, pad_multiple=8)
    row = packed.input_ids
    positions = torch.arange(row.shape[1])[None, :]
    shifted = torch.roll(packed.loss_mask, 1, dims=1)  # off by one
    te_style = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                               cu_seqlens_q_padded=packed.cu_seqlens_padded, cu_seqlens_kv_padded=packed.cu_seqlens_padded,
                               max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen)
    return {
        "packed_shifted": failure_of(lambda: model(row, positions, None, loss_mask=shifted, packed_seq_params=te_style)),
        "packed_te_boundaries": failure_of(lambda: model(row, positions, None, loss_mask=packed.loss_mask, packed_seq_params=te_style)),
    }


def make_cp_slicing(model):
    """Turn a built GPTModel into one that slices CP itself (Bridge's NemotronOmni contract): it takes
    full rows, slices them with upstream's own get_batch_on_this_cp_rank, and returns
    ``(output, sliced_loss_mask)`` when given a loss_mask."""
    from megatron.core.models.gpt import GPTModel

    from mtp_overlay.bed.models.tiny_gpt import cp_slice

    class CPSlicingGPT(GPTModel):
        model_slices_context_parallel_inputs = True

        def forward(self, input_ids, position_ids, attention_mask, labels=None, loss_mask=None):
            local = cp_slice({"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask})
            output = super().forward(local["input_ids"], local["position_ids"], attention_mask, labels=labels,
                                     loss_mask=local["loss_mask"])
            return output if loss_mask is None else (output, local["loss_mask"])

    model.__class__ = CPSlicingGPT
    return model


class LogitsCaller(torch.nn.Module):
    """A trainer-side wrapper (like DDP: the model under ``.module``) that wants logits only."""

    def __init__(self, model):
        super().__init__()
        self.module, self.config = model, model.config
        self.compute_language_model_loss = model.compute_language_model_loss

    def forward(self, **inputs):
        from mtp_overlay import mtp

        return mtp.unwrap_output(self.module(**inputs))


def cp2_worker():
    from megatron.core import parallel_state

    from mtp_overlay import mtp
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, cp_slice, make_batch, train_step

    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    model = build_tiny_gpt(**MODEL)
    batch = make_batch(batch_size=BATCH, seq_length=SEQ, vocab_size=VOCAB)
    mask = mtp.build_mtp_loss_mask(token_mask(), torch.tensor(WEIGHT), model)
    local = mtp.shard_for_model(model, mask, cp, rank)
    same_as_upstream = torch.equal(local, cp_slice(mask))
    with mtp.loss_mask_scope(local):
        cp_local = train_step(model, batch, labels=None, loss_mask=None)

    caller = LogitsCaller(make_cp_slicing(model))
    full = mtp.shard_for_model(caller, mask, cp, rank)  # the model slices CP itself: full rows
    output = model(batch["input_ids"], batch["position_ids"], None, loss_mask=full)
    contract = isinstance(output, tuple) and torch.equal(output[1], cp_slice(mask))
    full_rows = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], loss_mask=full)
    slicing = train_step(caller, batch, labels=None, **full_rows)
    return cp_local, slicing, same_as_upstream, full is mask, contract


MASKS_BY_RANK = {  # DP ranks hold different samples
    0: dict(prompt=PROMPT, length=LENGTH, weight=WEIGHT),
    1: dict(prompt=(2, 4, 6, 8), length=(32, 16, 24, 31), weight=(1.0, 1.0, 0.0, 1.0)),
}


def rank_masks(rank):
    spec = MASKS_BY_RANK[rank]
    return token_mask(spec["prompt"], spec["length"]), torch.tensor(spec["weight"])


def dp2_worker():
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.schedules import _get_mtp_loss_scale
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from mtp_overlay import mtp
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch

    rank = dist.get_rank()
    model = build_tiny_gpt(mtp_num_layers=2, calculate_per_token_loss=True, **MODEL)
    batch = make_batch(batch_size=BATCH, seq_length=SEQ, vocab_size=VOCAB, seed=rank)
    tokens, weights = rank_masks(rank)
    mask = mtp.build_mtp_loss_mask(tokens, weights, model)
    facts = {"empty_before": mtp.mtp_metrics(1), "before": model.config.mtp_grad_scale_func}
    with mtp.mtp_grad_scale(model, tokens, weights) as valid_tokens:
        facts["valid_tokens"] = valid_tokens
        facts["scale"] = model.config.mtp_grad_scale_func()
        facts["upstream_scale"] = float(_get_mtp_loss_scale(model.config, torch.device("cpu")))
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        for rows in ([0, 1], [2, 3]):  # two microbatches of a real training step
            logits = model(batch["input_ids"][rows], batch["position_ids"][rows], None, loss_mask=mask[rows])
            logits.float().logsumexp(-1).mean().backward()
    facts["after"] = model.config.mtp_grad_scale_func
    facts["error_kept"] = failure_of(lambda: _raise_inside_scale(mtp, model, tokens, weights))
    facts["after_error"] = model.config.mtp_grad_scale_func
    tracker = MTPLossLoggingHelper.tracker
    facts["local"] = {key: tracker[key].tolist() for key in ("loss_values", "correct_values", "total_values")}
    facts["metrics"] = mtp.mtp_metrics(num_microbatches=2)
    facts["cleared"] = [tracker[key].tolist() for key in ("loss_values", "correct_values", "total_values")]
    facts["empty_after"] = mtp.mtp_metrics(2)
    return facts


def _raise_inside_scale(mtp, model, tokens, weights):
    with mtp.mtp_grad_scale(model, tokens, weights):
        raise KeyError("step failed")


# --- tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(tp1_worker, 1, fixes=[FIX])[0]


def assert_same_mtp(result, reference, rel=1e-5):
    assert result.mtp_tokens == reference.mtp_tokens
    assert result.mtp_losses == pytest.approx(reference.mtp_losses, rel=rel)
    assert result.mtp_acceptance == pytest.approx(reference.mtp_acceptance, rel=rel)


def test_mtp_loss_counts_exactly_the_masked_positions(tp1):
    steps, _, (state, reason) = tp1
    assert state == "installed" and "PR #3457" in reason
    mask = token_mask() * torch.tensor(WEIGHT)[:, None]
    explicit = steps["explicit"]
    assert explicit.mtp_tokens == (mtp_positions(mask),)
    # the RL path (labels derived from input_ids) equals the pretraining path (explicit labels,
    # label-aligned mask), gradients included
    assert_same_mtp(steps["pretraining"], explicit)
    assert steps["pretraining"].group_grad_norms["mtp"] == pytest.approx(explicit.group_grad_norms["mtp"], rel=1e-5)
    # a zero-weight sample counts exactly as much as no sample at all
    removed = steps["sample_removed"]
    assert_same_mtp(removed, explicit)
    assert removed.group_grad_norms["mtp"] == pytest.approx(explicit.group_grad_norms["mtp"], rel=1e-5)


def test_without_a_mask_prompts_and_filtered_samples_train_the_mtp_head(tp1):
    steps, _, _ = tp1
    bug, cured = steps["scoped_fix_off"], steps["scoped"]
    # fix off: the trainer's scoped mask never reaches the model, every position trains MTP
    assert bug.mtp_tokens == (float(BATCH * (SEQ - 2)),) == steps["no_mask"].mtp_tokens
    assert bug.mtp_losses != pytest.approx(cured.mtp_losses, rel=1e-3)
    assert bug.group_grad_norms["mtp"] != pytest.approx(cured.group_grad_norms["mtp"], rel=1e-3)
    # fix on: the scoped mask is routed in, exactly as if the trainer had passed it
    assert cured == steps["explicit"]
    assert bug.lm_loss == pytest.approx(cured.lm_loss, rel=1e-6)  # the LM loss never depended on it


def test_a_mask_out_of_the_tokens_layout_is_a_clear_value_error(tp1):
    _, errors, _ = tp1
    assert errors["short_mask"].startswith("ValueError: loss_mask has layout [4, 30] but input_ids has [4, 32]")
    assert errors["short_mask_fix_off"].startswith("RuntimeError")  # deep inside Megatron's MTP loss
    assert errors["scope_with_labels"].startswith("ValueError: loss_mask_scope holds an unshifted")
    assert errors["scope_on_mtp_model"].startswith("ValueError: loss_mask has layout [4, 30]")
    assert errors["scope_on_plain_model"] is None  # no MTP: no mask injected (NeMo-RL issue #2869)
    # packed input: a mask one slot off the tokens' layout reaches a padding slot
    # (each row's last trained token moves onto its sequence's first padding slot)
    assert errors["packed_shifted"].startswith("ValueError: loss_mask is nonzero in 3 padding slot(s)")
    assert "first at [28, 84, 118]" in errors["packed_shifted"]
    assert "cu_seqlens_q_padded=[0, 32, 64, 88, 120]" in errors["packed_shifted"]
    # real lengths in cu_seqlens_q: megatron-core would roll the MTP labels across the padding
    assert errors["packed_te_boundaries"].startswith("ValueError: packed_seq_params.cu_seqlens_q [0, 28, 60, 80, 110]")
    for key in ("packed_shifted", "packed_te_boundaries"):
        assert errors[f"{key}_fix_off"] is None  # stock runs the packed forward and trains the shifted positions
    # the default mode refuses the shifted mask on the device (no host read), the boundaries on the host
    assert errors["packed_shifted_default"].startswith("RuntimeError: mtp-overlay: loss_mask is nonzero in a padding slot")
    assert "MTP_OVERLAY_CHECKS=full" in errors["packed_shifted_default"]
    assert errors["packed_te_boundaries_default"] == errors["packed_te_boundaries"]


@pytest.mark.slow
def test_cp2_matches_tp1_for_cp_local_and_self_slicing_models(tp1):
    reference = tp1[0]["explicit"]
    # with mtp-cp-loss-scale: stock megatron-core normalises each CP rank's MTP loss by its own
    # token counts, which changes the gradient and the logged loss (Megatron-LM PR #7498)
    results = run_ranks_checked(cp2_worker, 2, cp=2, fixes=[FIX, "mtp-cp-loss-scale"])
    for cp_local, slicing, same_as_upstream, passed_full_row, contract in results:
        assert same_as_upstream and passed_full_row and contract
        for result in (cp_local, slicing):  # same positions, losses and gradients as TP1
            assert_same_mtp(result, reference)
            assert result.lm_loss == pytest.approx(reference.lm_loss, rel=1e-5)
            assert result.grad_norm == pytest.approx(reference.grad_norm, rel=1e-5)
        assert cp_local.group_grad_norms == pytest.approx(reference.group_grad_norms, rel=1e-5)
        assert cp_local.zero_grad_params == ()


@pytest.mark.slow
def test_grad_scale_is_scoped_to_the_step_and_metrics_read_the_real_tracker():
    ranks = run_ranks_checked(dp2_worker, 2, fixes=[FIX])
    expected_tokens = sum(float((t[:, 1:] * w[:, None]).sum()) for t, w in map(rank_masks, (0, 1)))
    losses = [rank["local"]["loss_values"] for rank in ranks]
    correct = [sum(values) for values in zip(*(rank["local"]["correct_values"] for rank in ranks))]
    total = [sum(values) for values in zip(*(rank["local"]["total_values"] for rank in ranks))]
    for rank, facts in enumerate(ranks):
        assert facts["empty_before"] == {} and facts["empty_after"] == {}
        assert facts["before"] is None and facts["after"] is None and facts["after_error"] is None
        assert facts["error_kept"] == "KeyError: 'step failed'"
        assert facts["valid_tokens"] == expected_tokens  # all-reduced over the two DP ranks
        assert facts["scale"] == 1 / expected_tokens
        assert facts["upstream_scale"] == pytest.approx(1 / expected_tokens, rel=1e-6)  # what Megatron's schedule reads
        tokens, weights = rank_masks(rank)
        mask = tokens * weights[:, None]
        # depth k (1-indexed) counts positions i weighted by mask[i+1+k]
        assert facts["local"]["total_values"] == [float(mask[:, 2:].sum()), float(mask[:, 3:].sum())]
        assert facts["cleared"] == [[0.0, 0.0]] * 3
        metrics = facts["metrics"]
        assert set(metrics) == {"mtp_1_loss", "mtp_1_acceptance_rate", "mtp_2_loss", "mtp_2_acceptance_rate"}
        for i in (1, 2):  # loss averaged over DP, scaled by 1/num_microbatches; counts summed
            assert metrics[f"mtp_{i}_loss"] == pytest.approx((losses[0][i - 1] + losses[1][i - 1]) / 2 / 2, rel=1e-6)
            assert metrics[f"mtp_{i}_acceptance_rate"] == pytest.approx(100 * correct[i - 1] / total[i - 1])
    from mtp_overlay import mtp

    assert mtp.with_prefix({"mtp_1_loss": 1.5}) == {"mtp/mtp_1_loss": 1.5}


# --- other releases ------------------------------------------------------------------------------
REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
import megatron.core.models.gpt.gpt_model as gpt
import megatron.core.models.hybrid.hybrid_model as hybrid
from megatron.core.transformer.transformer_config import TransformerConfig
from mtp_overlay import mtp
row = mtp_overlay.status(only=["mtp-loss-mask"])[0]
config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
try:
    mtp.apply_mtp_config(config, {"mtp_num_layers": 2, "mtp_detach_heads": True})
    config_error = None
except ValueError as exc:
    config_error = str(exc)
print(json.dumps({"state": row.state, "reason": row.reason, "version": row.version,
                  "wrapped": type(vars(gpt.GPTModel)["forward"]).__name__ == "FunctionWrapper",
                  "hybrid_wrapped": type(vars(hybrid.HybridModel)["forward"]).__name__ == "FunctionWrapper",
                  "config_error": config_error, "mtp_num_layers": config.mtp_num_layers}))
"""


def report(site):
    # "wrapped" is mtp-loss-mask's wrapper: mtp-logprob-skip, which wraps the same forwards, stays off
    result = run_with_release(site, REPORT, env={**os.environ, "MTP_OVERLAY_STRICT": "0",
                                                 "MTP_OVERLAY_DISABLE": "mtp-logprob-skip"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_on_0_18_no_labels_means_no_mtp_loss_so_the_hook_reports_drift_and_the_config_refuses():
    row = report(release_site("megatron-core", "0.18.2"))
    assert row["version"] == "0.18.2" and row["state"] == "drifted"
    assert not row["wrapped"] and not row["hybrid_wrapped"]
    assert "cannot derive MTP labels from input_ids" in row["reason"] and "no MTP loss is trained" in row["reason"]
    assert "megatron.core.models.hybrid.hybrid_model" in row["reason"]
    assert "mtp_config['mtp_detach_heads']" in row["config_error"] and "0.18.2" in row["config_error"]
    assert row["mtp_num_layers"] is None  # a refused config is left untouched


def test_forward_without_loss_mask_is_drift(tmp_path):
    site = copy_installed("megatron-core", tmp_path / "site")
    source = site / "megatron/core/models/gpt/gpt_model.py"
    text = source.read_text()
    signature = "        loss_mask: Optional[Tensor] = None,\n        padding_mask"
    assert signature in text
    source.write_text(text.replace(signature, "        padding_mask", 1))
    row = report(site)
    assert row["version"] == MEGATRON_CORE and row["state"] == "drifted" and not row["wrapped"]
    assert "GPTModel.forward has no parameter(s) ['loss_mask']" in row["reason"]
    assert row["hybrid_wrapped"]  # each target is probed on its own: HybridModel still fits
    assert row["config_error"] is None
