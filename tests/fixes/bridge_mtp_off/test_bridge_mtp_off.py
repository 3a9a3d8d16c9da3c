"""bridge-mtp-off: ``mtp_num_layers=0`` on a repeated-layer NemotronH provider builds no MTP block and
trains through Bridge's own step; stock's first step raises. ``None`` keeps its one shared layer.

One TP1 rank run (shared pool; ~35 s here), fix off and on: Bridge's import of a tiny NemotronH with
one MTP layer (`bridge_step.mtp_off_cases`: finalized, built, one step of Bridge's ``forward_step``
with megatron-core's optimizer), the Omni provider's finalize (it calls ``super().finalize()``), and
tiny providers finalized from each way a pattern can arrive and each numeric zero a recipe can bring.
"""

import pytest

from mtp_overlay.bed.steps import bridge_step
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.fixes import reproduce

FIX = "bridge-mtp-off"
MAIN, MTP = "*-*-", "*-"  # bridge.tiny_hf_config's NemotronH patterns
WITH_MTP = f"{MAIN}/{MTP}"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)]
# provider fields -> (stock's, the fix's) finalized (hybrid_layer_pattern, mtp_num_layers)
PROVIDERS = {
    "repeated, 0": (dict(hybrid_layer_pattern=MAIN, mtp_hybrid_override_pattern=MTP, mtp_use_repeated_layer=True,
                         mtp_num_layers=0), (WITH_MTP, 0), (MAIN, 0)),
    "repeated, 0.0": (dict(hybrid_layer_pattern=MAIN, mtp_hybrid_override_pattern=MTP, mtp_use_repeated_layer=True,
                           mtp_num_layers=0.0), (WITH_MTP, 0), (MAIN, 0)),
    "repeated, False": (dict(hybrid_layer_pattern=MAIN, mtp_hybrid_override_pattern=MTP, mtp_use_repeated_layer=True,
                             mtp_num_layers=False), (WITH_MTP, 0), (MAIN, 0)),
    "repeated, None": (dict(hybrid_layer_pattern=MAIN, mtp_hybrid_override_pattern=MTP, mtp_use_repeated_layer=True,
                            mtp_num_layers=None), (WITH_MTP, 1), (WITH_MTP, 1)),
    "repeated, 2": (dict(hybrid_layer_pattern=MAIN, mtp_hybrid_override_pattern=MTP, mtp_use_repeated_layer=True,
                         mtp_num_layers=2), (f"{WITH_MTP}/{MTP}", 2), (f"{WITH_MTP}/{MTP}", 2)),
    "unified pattern, 0": (dict(hybrid_layer_pattern=WITH_MTP, mtp_num_layers=0), (WITH_MTP, 0), (MAIN, 0)),
    "deprecated field, 0": (dict(hybrid_override_pattern=MAIN, mtp_hybrid_override_pattern=MTP,
                                 mtp_use_repeated_layer=True, mtp_num_layers=0), (WITH_MTP, 0), (MAIN, 0)),
    "independent layers, 0": (dict(hybrid_layer_pattern=MAIN, mtp_hybrid_override_pattern=MTP, mtp_num_layers=0),
                              (f"{MAIN}/", 0), (MAIN, 0)),
}


def install_exactly(fixes):
    import mtp_overlay

    mtp_overlay.uninstall()
    if fixes:
        mtp_overlay.install(only=list(fixes))


def finalized(fields):
    """A tiny HybridModelProvider with ``fields``, finalized twice as a training run may (the test
    bed's settings without TE): (pattern, mtp_num_layers, mtp_hybrid_override_pattern) after each."""
    import torch
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    from mtp_overlay.bed.models.bridge import local_overrides

    provider = HybridModelProvider(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                   vocab_size=bridge_step.VOCAB_SIZE, **fields)
    seen = []
    for _ in range(2):
        provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=local_overrides(provider))
        seen.append((provider.hybrid_layer_pattern, provider.mtp_num_layers, provider.mtp_hybrid_override_pattern))
    return seen


def tp1_worker():
    from mtp_overlay.bed.models.bridge import import_bridge

    import_bridge()
    result = {}
    for fixes in ((), (FIX,)):
        install_exactly(fixes)
        result[fixes] = dict(off=bridge_step.mtp_off_cases((0, None)), omni=bridge_step.omni_finalize((0, None)),
                             providers={name: finalized(fields) for name, (fields, *_) in PROVIDERS.items()})
    return result


@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(tp1_worker, 1, fixes=[], timeout=900)[0]


def test_mtp_off_builds_no_mtp_block_and_trains_where_stock_raises(tp1):
    (stock_off, stock_none), (off, none) = tp1[()]["off"], tp1[(FIX,)]["off"]
    assert (stock_off.pattern, stock_off.mtp_num_layers, stock_off.mtp_block) == (WITH_MTP, 0, True)
    assert stock_off.error.startswith("AssertionError") and stock_off.error_at.startswith(
        "megatron/core/models/hybrid/hybrid_model.py:")
    assert (off.pattern, off.mtp_num_layers, off.mtp_block, off.error) == (MAIN, 0, False, None)
    assert off.step.mtp_losses == () and off.step.mtp_tokens == ()  # no MTP loss at all
    assert off.step.update_norm > 0 and off.step.zero_grad_params == ()  # every parameter trained
    assert not off.step.grad_names["mtp"] and list(off.step.grad_names["lm"]) == list(stock_none.step.grad_names["lm"])
    for case in (stock_none, none):  # None: one copy of the shared layer, as before
        assert (case.pattern, case.mtp_num_layers, case.mtp_block, case.error) == (WITH_MTP, 1, True, None)
        assert len(case.step.mtp_losses) == 1 and case.step.mtp_tokens[0] > 0
    assert none.step.grads["mtp"].tolist() == stock_none.step.grads["mtp"].tolist()  # untouched


def test_the_omni_provider_goes_through_the_same_finalize(tp1):
    assert tp1[()]["omni"] == {0: (WITH_MTP, 0), None: (WITH_MTP, 1)}
    assert tp1[(FIX,)]["omni"] == {0: (MAIN, 0), None: (WITH_MTP, 1)}


@pytest.mark.parametrize("name", list(PROVIDERS))
def test_every_way_a_pattern_arrives_finalizes_without_mtp_only_at_a_numeric_zero(tp1, name):
    fields, stock, fixed = PROVIDERS[name]
    mtp_field = fields.get("mtp_hybrid_override_pattern")
    assert tp1[()]["providers"][name] == [(*stock, mtp_field)] * 2
    assert tp1[(FIX,)]["providers"][name] == [(*fixed, mtp_field)] * 2  # the provider still names its MTP layer


def test_the_stock_path_shows_the_bug():
    shows, evidence = reproduce(FIX)
    assert shows, evidence
    assert f"finalized pattern {WITH_MTP!r}, MTP block built: True" in evidence and "AssertionError" in evidence
