"""bridge-sft-mtp-mask through Bridge's own SFT step (``gpt_step.forward_step``, Megatron's schedule)
on Bridge-built Qwen3 (GPTModel) and NemotronH (HybridModel), fix off and on in the same rank run.

The SFT batch of the test bed (2x32 tokens, 12 prompt labels masked per row, 8 padding in row 1):
its mask allows 32 MTP positions of 62, counted from the batch alone (`bridge_step.mtp_positions`);
the reference is a direct forward of a same-seed model given ``labels=`` and ``loss_mask=``. One TP1
run (stock; the fix; the fix with mtp-loss-mask; DeepSeek-V4's step; a live RL scope; the probe on
edited copies of the real gpt_step) and one CP2 run (stock; the fix; the fix with mtp-cp-loss-scale),
each in the shared rank pool. Measured (2 shared cores, loaded): TP1 run ~70 s, CP2 run ~60 s.
"""

import pytest

from mtp_overlay.bed.steps import bridge_step
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.cases import failure_of
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.fixes import reproduce

FIX, LOSS_MASK_FIX, CP_FIX = "bridge-sft-mtp-mask", "mtp-loss-mask", "mtp-cp-loss-scale"
KINDS = ("qwen3", "nemotron_h")
BUILT = {"qwen3": "GPTModelProvider -> GPTModel", "nemotron_h": "HybridModelProvider -> HybridModel"}
TIGHT = 1e-6
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)]

# edits of gpt_step's source, as upstream might write the fix or change the function
GPT_STEP_EDITS = {
    "stock": (),
    "PR #6105's loss_mask key": (('        "labels": labels,\n    }\n',
                                  '        "labels": labels,\n        "loss_mask": loss_mask,\n    }\n'),),
    "loss_mask set after the dict": (('    # Add packed sequence support\n',
                                      '    forward_args["loss_mask"] = loss_mask\n    # Add packed sequence support\n'),),
    "no forward_args dict": (('    forward_args = {\n        "input_ids": tokens,',
                              '    forward_args = dict(\n        input_ids=tokens,'),
                             ('        "position_ids": position_ids,\n        "attention_mask": attention_mask,\n'
                              '        "labels": labels,\n    }\n',
                              '        position_ids=position_ids,\n        attention_mask=attention_mask,\n'
                              '        labels=labels,\n    )\n')),
    "no _get_batch_fn": (('    *,\n    _get_batch_fn=None,\n) -> tuple[torch.Tensor, torch.Tensor]:',
                          ') -> tuple[torch.Tensor, torch.Tensor]:\n    _get_batch_fn = None'),),
    "the mask renamed in the unpacking": (('            labels,\n            loss_mask,\n            attention_mask,',
                                           '            labels,\n            batch_mask,\n            attention_mask,'),
                                          ('    return output_tensor, loss_mask\n',
                                           '    return output_tensor, batch_mask\n')),
}


def install_exactly(fixes):
    """In a rank: exactly ``fixes`` installed (the modules are imported already: late installs)."""
    import mtp_overlay

    mtp_overlay.uninstall()
    if fixes:
        mtp_overlay.install(only=list(fixes))



def checked_masks():
    """Record what mtp-loss-mask's layout check is handed (`mtp.assert_loss_mask_layout` on the device
    by default, `mtp.check_loss_mask_layout` on the host with MTP_OVERLAY_CHECKS=full): per call,
    whether the mask it checks is the SFT batch's label-aligned one. Returns (records, undo)."""
    from mtp_overlay import mtp

    names, records = ("check_loss_mask_layout", "assert_loss_mask_layout"), []
    checkers = {name: getattr(mtp, name) for name in names}
    batch_mask = bridge_step.sft_batch()["loss_mask"].tolist()

    def recording(checker):
        def record(input_ids, loss_mask, *args, **kwargs):
            records.append(loss_mask.tolist() == batch_mask and tuple(input_ids.shape) == tuple(loss_mask.shape))
            return checker(input_ids, loss_mask, *args, **kwargs)

        return record

    for name, checker in checkers.items():
        setattr(mtp, name, recording(checker))
    return records, lambda: [setattr(mtp, name, checker) for name, checker in checkers.items()]


def edited_copy(module, edits, name):
    """A copy of the installed ``module`` built from its own source with ``(old, new)`` edits (not in
    sys.modules), its code named ``<name>`` in linecache so that reading a function's source (what
    the probe does) reads the edited text; imports through the test bed's stand-ins."""
    import linecache
    import types
    from pathlib import Path

    from mtp_overlay.bed.models.bridge import import_stand_ins

    source = Path(module.__file__).read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    filename = f"<{module.__name__} edited: {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    copy = types.ModuleType(module.__name__)
    copy.__file__ = module.__file__
    with import_stand_ins():
        exec(compile(source, filename, "exec"), copy.__dict__)
    return copy


def probe_of_edited_gpt_step():
    """{edit: (state, reason)} of the fix's probe on copies of the installed gpt_step edited with
    `GPT_STEP_EDITS`."""
    from mtp_overlay.fixes.bridge_sft_mtp_mask import FIX as fix

    gpt_step = bridge_step.import_gpt_step()
    verdicts = {}
    for name, edits in GPT_STEP_EDITS.items():
        verdict = fix.probe(edited_copy(gpt_step, edits, name))
        verdicts[name] = (verdict.state, verdict.reason)
    return verdicts


def tp1_worker():
    """Rank worker (TP1): the SFT cases under each set of fixes, DeepSeek-V4's step, a live RL scope,
    and the probe on edited copies of gpt_step."""
    import sys

    import torch
    import wrapt

    from mtp_overlay import mtp

    result = {"cases": {}, "checked": {}, "scoped": {}}
    for fixes in ((), (FIX,), (FIX, LOSS_MASK_FIX)):
        install_exactly(fixes)
        records, undo = checked_masks()
        try:
            result["cases"][fixes] = bridge_step.sft_mtp_cases(KINDS)
        finally:
            undo()
        result["checked"][fixes] = records
    install_exactly((FIX,))
    result["deepseek"] = bridge_step.sft_mtp_cases(("nemotron_h",), step="deepseek_v4_step")[0]
    result["bound"] = {step: isinstance(vars(sys.modules[module])["_forward_step_common"], wrapt.FunctionWrapper)
                       for step, module in bridge_step.STEPS.items()}
    rl_mask = torch.ones(bridge_step.BATCH_SIZE, bridge_step.SEQ_LENGTH)  # an input-aligned RL mask
    for fixes in ((FIX,), (FIX, LOSS_MASK_FIX), (LOSS_MASK_FIX,)):
        install_exactly(fixes)
        with mtp.loss_mask_scope(rl_mask):
            found = []
            error = failure_of(lambda: found.append(bridge_step.sft_mtp_case("nemotron_h")))
        result["scoped"][fixes] = error or found[0]
    install_exactly(())
    result["probe"] = probe_of_edited_gpt_step()
    return result


@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(tp1_worker, 1, fixes=[], timeout=1200)[0]


def cp2_worker():
    """Rank worker (CP2): the SFT cases stock, with the fix, and with the fix and mtp-cp-loss-scale."""
    cases = {}
    for fixes in ((), (FIX,), (FIX, CP_FIX)):
        install_exactly(fixes)
        cases[fixes] = bridge_step.sft_mtp_cases(KINDS)
    return cases


@pytest.fixture(scope="module")
def cp2():
    ranks = run_ranks_checked(cp2_worker, 2, cp=2, fixes=[], timeout=1200)

    def seen(cases):
        return {fixes: [(c.trained, c.bridge.mtp_losses, c.bridge.lm_loss) for c in rows] for fixes, rows in cases.items()}

    assert seen(ranks[1]) == seen(ranks[0])  # every CP rank saw the same (gathered) step
    return ranks[0]


def assert_masked_like_the_direct_forward(case, layout):
    allowed, every = bridge_step.mtp_positions(bridge_step.sft_batch()["loss_mask"])
    assert (case.layout, case.built, case.allowed, case.every) == (layout, BUILT[case.kind], allowed, every)
    assert len(allowed) == 32 and len(every) == 62
    assert case.trained == case.direct_trained == allowed
    assert case.bridge.mtp_tokens == case.direct.mtp_tokens == (len(allowed),)
    lm_grad_relerr = case.bridge.relative_error(case.direct, "lm")  # the decoder also learns from the MTP loss
    assert max(case.lm_loss_relerr, case.mtp_loss_relerr, case.mtp_grad_relerr, lm_grad_relerr) <= TIGHT, (
        case.kind, case.lm_loss_relerr, case.mtp_loss_relerr, case.mtp_grad_relerr, lm_grad_relerr)


def assert_stock_trains_every_position(case):
    assert case.trained == case.every != case.allowed and case.bridge.mtp_tokens == (62,)
    assert case.lm_loss_relerr <= TIGHT  # the LM loss always had the mask
    assert case.mtp_grad_relerr > 0.1, case.mtp_grad_relerr


def test_tp1_stock_trains_62_positions_the_fix_exactly_the_32_the_mask_allows(tp1):
    stock, fixed = tp1["cases"][()], tp1["cases"][(FIX,)]
    assert [case.kind for case in stock] == [case.kind for case in fixed] == list(KINDS)
    for off, on in zip(stock, fixed):
        assert_stock_trains_every_position(off)
        assert_masked_like_the_direct_forward(on, "TP1")
        assert on.direct.grads["mtp"].tolist() == off.direct.grads["mtp"].tolist()  # the reference is untouched


def test_with_mtp_loss_mask_the_label_mask_goes_through_its_layout_check(tp1):
    """The two fixes compose on GPTModel/HybridModel.forward: this fix hands the batch's label-aligned
    mask to the model call, mtp-loss-mask's forward wrapper checks that very mask (two calls per kind:
    Bridge's step and the direct one) and does not replace it; the result is the fix's alone."""
    assert tp1["checked"][()] == tp1["checked"][(FIX,)] == []  # mtp-loss-mask not installed: no check
    assert tp1["checked"][(FIX, LOSS_MASK_FIX)] == [True] * 2 * len(KINDS)
    for alone, composed in zip(tp1["cases"][(FIX,)], tp1["cases"][(FIX, LOSS_MASK_FIX)]):
        assert_masked_like_the_direct_forward(composed, "TP1")
        assert composed.bridge.grads["mtp"].tolist() == alone.bridge.grads["mtp"].tolist()


def test_a_live_rl_scope_is_refused_as_mtp_loss_mask_refuses_it_never_merged(tp1):
    """An input-aligned RL mask scoped by the trainer (mtp.loss_mask_scope) around Bridge's SFT step:
    without this fix mtp-loss-mask refuses the labelled call; with both, this fix refuses it in the
    same words of intent instead of letting either mask win; with mtp-loss-mask off the scope routes
    nothing and the batch's mask trains."""
    scoped = tp1["scoped"]
    assert scoped[(LOSS_MASK_FIX,)].startswith("ValueError: loss_mask_scope holds an unshifted"), scoped[(LOSS_MASK_FIX,)]
    assert scoped[(FIX, LOSS_MASK_FIX)].startswith("ValueError: Bridge's _forward_step_common passes labels and its "
                                                   "batch's label-aligned loss_mask"), scoped[(FIX, LOSS_MASK_FIX)]
    assert "mtp_overlay.mtp.loss_mask_scope holds an input-aligned RL mask for fix mtp-loss-mask" in scoped[(FIX, LOSS_MASK_FIX)]
    assert_masked_like_the_direct_forward(scoped[(FIX,)], "TP1")


def test_deepseek_v4_step_binds_the_function_by_name_and_is_fixed_too(tp1):
    assert tp1["bound"] == {"gpt_step": True, "deepseek_v4_step": True}
    case = tp1["deepseek"]
    assert case.step == "deepseek_v4_step"
    assert_masked_like_the_direct_forward(case, "TP1")


def test_probe_reads_the_real_function_needed_redundant_or_drifted(tp1):
    probe = tp1["probe"]
    assert probe["stock"][0] == "needed" and "without the batch's loss_mask" in probe["stock"][1]
    assert probe["PR #6105's loss_mask key"] == ("redundant", "_forward_step_common passes 'loss_mask' in forward_args")
    assert probe["loss_mask set after the dict"] == ("redundant", "_forward_step_common sets forward_args['loss_mask']")
    assert probe["no forward_args dict"] == ("drifted", "_forward_step_common builds no forward_args dict literal")
    assert probe["no _get_batch_fn"] == ("drifted", "_forward_step_common takes no keyword-only _get_batch_fn")
    assert probe["the mask renamed in the unpacking"] == (
        "drifted", "_forward_step_common unpacks no labels and loss_mask from (_get_batch_fn or get_batch)(...)")


def test_cp2_the_fix_trains_the_32_positions_and_with_the_cp_fix_matches_tp1(cp2, tp1):
    """CP2: with this fix alone Bridge's step equals the direct forward of the same layout (both carry
    megatron-core's per-CP-rank MTP normalisation); with mtp-cp-loss-scale too, it equals the TP1
    direct forward as well (MTP loss and gradient), which this fix alone does not (that defect is
    mtp-cp-loss-scale's). The rest of the model's gradient is CP2's own direct forward's, not TP1's:
    Bridge's 3-output LM loss is averaged per CP rank upstream (Megatron-LM PR #7513), fix or no fix."""
    reference = {case.kind: case.direct for case in tp1["cases"][(FIX,)]}  # TP1, with the mask
    for stock, fixed, both in zip(cp2[()], cp2[(FIX,)], cp2[(FIX, CP_FIX)]):
        assert_stock_trains_every_position(stock)
        for case in (fixed, both):
            assert_masked_like_the_direct_forward(case, "CP2")
        tp1_direct = reference[both.kind]
        assert both.bridge.relative_error(tp1_direct, "mtp") <= TIGHT
        assert abs(both.bridge.mtp_loss - tp1_direct.mtp_loss) / tp1_direct.mtp_loss <= TIGHT
        assert fixed.bridge.relative_error(tp1_direct, "mtp") > 1e-3  # CP2 without mtp-cp-loss-scale


def test_the_stock_path_shows_the_bug():
    shows, evidence = reproduce(FIX)
    assert shows, evidence
    assert "MTP trained 62 positions, the mask allows 32" in evidence
