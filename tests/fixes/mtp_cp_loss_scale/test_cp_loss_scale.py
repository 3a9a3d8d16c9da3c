"""mtp-cp-loss-scale on real megatron-core (the pinned release), in Megatron's own training step.

Every case runs the same step twice on the same weights and batch: stock (fix off) and fixed (fix
on), at CP=1, CP=2 and TP2xCP2+SP (mtp_overlay.bed.fixes.mtp_cp_loss_scale.measure:
get_forward_backward_func -> DDP -> finalize_model_grads, every loss mode and mask). Stock
normalises each CP rank's MTP loss by its own token counts (Megatron-LM PR #7498): the MTP gradient
at CP>1 differs from CP=1's; fixed, it equals CP=1's.
"""

import os
import pickle
import subprocess
from pathlib import Path

import numpy
import pytest

from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.runtime.releases import copy_installed, run_with_release
from mtp_overlay.bed.fixes.mtp_cp_loss_scale import MASKS, MODES, measure

ROOT = Path(__file__).resolve().parents[3]
PATCH = ROOT / "patches" / "mtp-cp-loss-scale" / "megatron-core" / "0.19.patch"

EXACT = 1e-5  # relerr of float32 gradients summed in another order
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_token_dispatcher_type="allgather",
           add_bias_linear=False)
MOE_MODES = ("2-output", "3-output, per-token")
METRICS_MODES = ("3-output, per-token", "NeMo-RL, RL forward (labels=None)")


def all_reduces(sequence_parallel=False):
    """Worker: the element counts of every torch.distributed.all_reduce of one Megatron step (two MTP
    depths, two microbatches), fix off and on, with a per-token and a plain loss."""
    import torch

    import mtp_overlay
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.fixes.mtp_cp_loss_scale import microbatch
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt

    calls, original = [], torch.distributed.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    counts = {}
    for per_token, loss in ((False, "2-output"), (True, "3-output")):
        model = build_tiny_gpt(sequence_parallel=sequence_parallel, mtp_num_layers=2, calculate_per_token_loss=per_token)
        step = MegatronStep(model, optimizer=None)
        for variant in ("stock", "fixed"):
            (mtp_overlay.install if variant == "fixed" else mtp_overlay.uninstall)(only=["mtp-cp-loss-scale"])
            calls.clear()
            torch.distributed.all_reduce = counting
            try:
                step.step([microbatch("uneven"), microbatch("middle")], loss=loss, update=False)
            finally:
                torch.distributed.all_reduce = original
            counts[loss, variant] = list(calls)
    mtp_overlay.uninstall(only=["mtp-cp-loss-scale"])
    return counts


def everything(sequence_parallel=False):
    """Worker: the table (every mode and mask), the logged metrics with an 8-token vocabulary (non-zero
    acceptance), a MoE model with its aux loss: with the MTP loss, and with the MTP loss scaled
    to zero (the MTP block then learns from its MoE layer's aux loss only), and the all-reduces."""
    return dict(
        all_reduces=all_reduces(sequence_parallel),
        table=measure(sequence_parallel=sequence_parallel),
        metrics=measure(modes=METRICS_MODES, masks=["uneven"], sequence_parallel=sequence_parallel, vocab_size=8),
        moe=measure(modes=MOE_MODES, masks=["uneven"], sequence_parallel=sequence_parallel, **MOE),
        moe_aux_only=measure(modes=MOE_MODES, masks=["uneven"], sequence_parallel=sequence_parallel,
                             mtp_loss_scaling_factor=0.0, **MOE),
    )


@pytest.fixture(scope="module")
def cp1():
    return run_ranks_checked(everything, 1, fixes=[])[0]


@pytest.fixture(scope="module")
def cp2():
    return run_ranks_checked(everything, 2, cp=2, fixes=[])[0]


def rows(results):
    return [(key, row) for name, part in results.items() if name != "all_reduces" for key, row in part.items()]


def test_at_cp1_the_fix_stands_aside(cp1):
    for key, row in rows(cp1):
        for part in ("mtp", "lm"):
            assert numpy.array_equal(row["stock"].grads[part], row["fixed"].grads[part]), key
        assert row["stock"].mtp_losses == row["fixed"].mtp_losses, key


def test_fix_off_shows_the_defect_fix_on_gives_cp1_gradients(cp1, cp2):
    assert set(cp2["table"]) == {(mode, mask) for mode in MODES for mask in MASKS}
    for key, row in cp2["table"].items():
        reference = cp1["table"][key]["stock"]
        stock, fixed = row["stock"], row["fixed"]
        assert stock.relative_error(reference, "mtp") > 1e-2, key  # the defect: per-rank reweighting
        assert fixed.relative_error(reference, "mtp") < EXACT, key  # the cure
        # the main LM loss is not touched: its gradient is bit-identical with the fix on and off
        assert numpy.array_equal(stock.grads["lm"], fixed.grads["lm"]), key
        assert stock.lm_loss == fixed.lm_loss, key
        # logged mtp/mtp_1_loss: stock logs the mean of per-rank means, fixed the CP=1 value
        assert fixed.mtp_losses == pytest.approx(reference.mtp_losses, rel=1e-6), key
        assert stock.mtp_losses != pytest.approx(reference.mtp_losses, rel=1e-6), key
        assert stock.mtp_tokens == fixed.mtp_tokens == reference.mtp_tokens, key


def test_issue_table_numbers_reproduce(cp1, cp2):
    """The stock figures measured for Megatron-LM PR #7498's defect (2-output: rank token weights
    1.43 and 0.77; per-token: 1.14 and 0.92)."""
    def relerr(mode, mask):
        return cp2["table"][mode, mask]["stock"].relative_error(cp1["table"][mode, mask]["stock"], "mtp")

    assert relerr("2-output", "uneven") == pytest.approx(0.318, abs=1e-3)
    assert relerr("3-output, per-token", "uneven") == pytest.approx(0.106, abs=1e-3)
    assert relerr("3-output", "uneven") == pytest.approx(0.318, abs=1e-3)
    assert relerr("2-output", "all-ones") == pytest.approx(0.033, abs=1e-3)
    # 3-output without per-token loss also averages per-rank LM means: upstream's (Megatron-LM PR #7513)
    lm = cp2["table"]["3-output", "uneven"]["stock"].relative_error(cp1["table"]["3-output", "uneven"]["stock"], "lm")
    assert lm == pytest.approx(0.197, abs=1e-3)


def test_a_rank_without_lm_tokens_keeps_its_mtp_gradient(cp1, cp2):
    """'middle' mask: every LM token on CP rank 1, one MTP target on rank 0. Stock per-token loss
    multiplies rank 0's MTP loss by its original count, 0: its gradient is lost."""
    key = ("3-output, per-token", "middle")
    stock, fixed, reference = cp2["table"][key]["stock"], cp2["table"][key]["fixed"], cp1["table"][key]["stock"]
    assert stock.mtp_tokens == reference.mtp_tokens
    assert stock.relative_error(reference, "mtp") > 1e-2
    assert fixed.relative_error(reference, "mtp") < EXACT


def test_logged_metrics_equal_cp1(cp1, cp2):
    for key, row in cp2["metrics"].items():
        reference = cp1["metrics"][key]["stock"]
        assert 0 < reference.mtp_acceptance[0] < 100, key
        for variant in ("stock", "fixed"):  # acceptance sums correct/total counts: right on stock too
            assert row[variant].mtp_acceptance == pytest.approx(reference.mtp_acceptance, rel=1e-9), key
        assert row["fixed"].mtp_losses == pytest.approx(reference.mtp_losses, rel=1e-6), key
        assert row["stock"].mtp_losses != pytest.approx(reference.mtp_losses, rel=1e-6), key


def test_one_extra_all_reduce_of_two_scalars_per_mtp_depth_and_microbatch(cp1, cp2):
    for loss in ("2-output", "3-output"):
        stock, fixed = cp2["all_reduces"][loss, "stock"], cp2["all_reduces"][loss, "fixed"]
        assert sorted(fixed) == sorted(stock + [2] * 4), (loss, stock, fixed)  # 2 depths x 2 microbatches
        assert cp1["all_reduces"][loss, "fixed"] == cp1["all_reduces"][loss, "stock"]  # CP=1: none


def test_moe_aux_loss_is_untouched(cp1, cp2):
    for key, row in cp2["moe"].items():
        # decoder MoE layers: LM loss + aux loss, bit-identical with the fix on and off
        assert numpy.array_equal(row["stock"].grads["lm"], row["fixed"].grads["lm"]), key
        assert row["fixed"].relative_error(cp1["moe"][key]["stock"], "mtp") < EXACT, key
    for key, row in cp2["moe_aux_only"].items():
        # MTP loss scaled to zero: the MTP block learns from its MoE layer's aux loss alone, unchanged
        assert row["stock"].group_grad_norms["mtp"] > 0, key
        for part in ("mtp", "lm"):
            assert numpy.array_equal(row["stock"].grads[part], row["fixed"].grads[part]), key


PATCHED_RUN = """
import pickle
import megatron.core.transformer.multi_token_prediction as m
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.fixes.mtp_cp_loss_scale import measure
assert m.__file__.startswith(%r), m.__file__
results = run_ranks_checked(measure, 2, cp=2, fixes=[], kwargs=dict(variants=("stock",)))[0]
open(%r, "wb").write(pickle.dumps(results))
"""


@pytest.mark.slow
def test_source_patch_gives_the_hooks_gradients(cp2, tmp_path):
    """The DEP-3 patch (Megatron-LM PR #7498's logic in process_mtp_loss) applied to a copy of the
    installed megatron-core, fix off: every mode and mask gives what the hook gives on stock."""
    site = copy_installed("megatron-core", tmp_path / "site")
    subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=site, check=True)
    out = tmp_path / "patched.pickle"
    result = run_with_release(site, PATCHED_RUN % (str(site), str(out)), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    patched = pickle.loads(out.read_bytes())
    assert set(patched) == set(cp2["table"])
    for key, row in patched.items():
        hook = cp2["table"][key]["fixed"]
        assert row["stock"].relative_error(hook, "mtp") < 1e-6, key
        assert numpy.array_equal(row["stock"].grads["lm"], hook.grads["lm"]), key
        assert row["stock"].mtp_losses == pytest.approx(hook.mtp_losses, rel=1e-6), key


@pytest.mark.slow
def test_tp2_cp2_sequence_parallel(cp1):
    tp2cp2 = run_ranks_checked(everything, 4, tp=2, cp=2, fixes=[], kwargs=dict(sequence_parallel=True))[0]
    for part in ("table", "metrics", "moe"):
        for key, row in tp2cp2[part].items():
            reference = cp1[part][key]["stock"]
            assert row["stock"].relative_error(reference, "mtp") > 1e-2, key
            assert row["fixed"].relative_error(reference, "mtp") < EXACT, key
            assert numpy.array_equal(row["stock"].grads["lm"], row["fixed"].grads["lm"]), key
            assert row["fixed"].mtp_losses == pytest.approx(reference.mtp_losses, rel=1e-6), key
            assert row["fixed"].mtp_acceptance == pytest.approx(reference.mtp_acceptance, rel=1e-9), key
