"""bridge-mtp-export: Bridge's NemotronH export of a repeated-layer MTP model builds the pinned vLLM's real
``NemotronHMTP`` drafter with the fix on; stock's config is refused.

The provider is Bridge's own import of vLLM's tiny NemotronH target (one MTP layer, pattern "*") with
the Super recipe's ``mtp_num_layers=2`` (the shared layer applied twice), exported by
``NemotronHBridge.megatron_to_hf_config`` and conformed as ``AutoBridge.from_auto_config`` does
(`bridge_step.export_case`), finalized and not, fix off and on, in one TP1 rank run (shared pool,
~25 s here); the drafters are built in this process. The probe on a copy of Bridge whose export
carries only PR #5948's depth runs in a fresh interpreter (~25 s). The rules on plain dicts are fast.
"""

import os
from pathlib import Path

import pytest

from mtp_overlay.fixes.bridge_mtp_export import exported
from mtp_overlay.bed.steps import bridge_step
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.runtime.releases import link_installed, run_json
from mtp_overlay.bed.fixes import reproduce

FIX = "bridge-mtp-export"
ROOT = Path(__file__).resolve().parents[3]
MODULE = "megatron/bridge/models/nemotronh/nemotron_h_bridge.py"
needs_bridge = pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)
# Bridge PR #5948's rule alone (the depth), as main has it after the fix: the pattern is still dropped
DEPTH_ONLY = (
    '        hf_cfg["num_nextn_predict_layers"] = hf_cfg.get("num_nextn_predict_layers") or 0\n',
    '        hf_cfg["num_nextn_predict_layers"] = hf_cfg.get("num_nextn_predict_layers") or 0\n'
    '        if getattr(provider, "mtp_use_repeated_layer", False) and hf_cfg["num_nextn_predict_layers"]:\n'
    '            hf_cfg["num_nextn_predict_layers"] = 1\n',
)


def provider(**fields):
    import types

    return types.SimpleNamespace(**fields)


# --- the rules, on plain dicts (no Bridge) ---------------------------------------------------------
@pytest.mark.parametrize(("fields", "config", "depth", "pattern"), [
    (dict(mtp_use_repeated_layer=True), {"num_nextn_predict_layers": 2, "mtp_hybrid_override_pattern": "*E"}, 1, "*E"),
    (dict(mtp_use_repeated_layer=True), {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}, 1, "*E"),
    (dict(mtp_use_repeated_layer=True), {"num_nextn_predict_layers": 0}, 0, None),  # MTP off stays off
    (dict(mtp_use_repeated_layer=False), {"num_nextn_predict_layers": 2, "mtp_hybrid_override_pattern": "*E"}, 2, "*E"),
    (dict(mtp_use_repeated_layer=True, mtp_hybrid_override_pattern="*-"), {"num_nextn_predict_layers": 2}, 1, "*-"),
    (dict(mtp_hybrid_override_pattern="*-"), {"num_nextn_predict_layers": 0}, 0, None),  # no MTP layers: no pattern
    # the finalized pattern's section is what the weights are: a field changed since does not override it
    (dict(mtp_hybrid_override_pattern="*-"), {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}, 1, "*E"),
])
def test_the_depth_is_the_layers_built_and_a_missing_pattern_is_the_providers(fields, config, depth, pattern):
    out = exported(provider(**fields), dict(config))
    assert out["num_nextn_predict_layers"] == depth and out.get("mtp_hybrid_override_pattern") == pattern


def test_a_pattern_with_unknown_layer_symbols_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"provider.mtp_hybrid_override_pattern '\*X' has unknown layer symbols \['X'\]"):
        exported(provider(mtp_hybrid_override_pattern="*X"), {"num_nextn_predict_layers": 1})


# --- the real export, fix off and on -----------------------------------------------------------------
def install_exactly(fixes):
    import mtp_overlay

    mtp_overlay.uninstall()
    if fixes:
        mtp_overlay.install(only=list(fixes))


def tp1_worker():
    """Rank worker: `export_case` finalized and not, and Bridge issue #5946's namespace provider,
    stock and with the fix."""
    from mtp_overlay.bed.models.bridge import import_bridge

    import_bridge()
    from megatron.bridge.models.nemotronh.nemotron_h_bridge import NemotronHBridge

    result = {}
    for fixes in ((), (FIX,)):
        install_exactly(fixes)
        issue = NemotronHBridge.megatron_to_hf_config(provider(hybrid_layer_pattern="MEME/*E/*E", mtp_num_layers=2,
                                                               mtp_use_repeated_layer=True))
        result[fixes] = dict(cases={finalize: bridge_step.export_case(finalize=finalize) for finalize in (True, False)},
                             issue=(issue["num_nextn_predict_layers"], issue.get("mtp_hybrid_override_pattern")))
    return result


@pytest.fixture(scope="module")
def exports():
    return run_ranks_checked(tp1_worker, 1, fixes=[], timeout=900)[0]


@pytest.mark.slow
@needs_bridge
def test_the_fixed_export_builds_vllms_drafter_and_stocks_is_refused(exports):
    pytest.importorskip("vllm")
    from transformers import NemotronHConfig

    stock, fixed = exports[()]["cases"][True], exports[(FIX,)]["cases"][True]
    reference = NemotronHConfig.from_dict(stock.reference)
    mtp = reference.mtp_hybrid_override_pattern
    assert stock.provider == fixed.provider == dict(
        mtp_num_layers=bridge_step.MTP_REPEATS, mtp_use_repeated_layer=True,
        hybrid_layer_pattern=reference.hybrid_override_pattern + f"/{mtp}" * bridge_step.MTP_REPEATS,
        mtp_hybrid_override_pattern=mtp)
    assert stock.config["num_nextn_predict_layers"] == bridge_step.MTP_REPEATS
    assert fixed.config["num_nextn_predict_layers"] == reference.num_nextn_predict_layers == 1
    assert {k: v for k, v in fixed.config.items() if k != "num_nextn_predict_layers"} == {
        k: v for k, v in stock.config.items() if k != "num_nextn_predict_layers"}  # nothing else changes
    refused, built, unfinalized = bridge_step.exported_drafters(
        [stock.config, fixed.config, exports[(FIX,)]["cases"][False].config])
    assert refused.error == "AssertionError: Only one MTP layer is supported for NemotronH-MTP"
    assert refused.error_at.startswith("vllm/model_executor/models/nemotron_h_mtp.py:")
    for drafter in (built, unfinalized):
        assert drafter.error is None and (drafter.num_mtp_layers, drafter.pattern) == (1, mtp)
        assert drafter.layers == ("NemotronHMTPAttentionDecoderLayer",) * len(mtp)


@pytest.mark.slow
@needs_bridge
def test_an_unfinalized_export_keeps_the_providers_mtp_pattern(exports):
    """Stock drops it (a config built from the dict alone reads transformers' default); with the fix
    the dict carries the provider's pattern, and the issue's repeated provider exports one layer."""
    from transformers import NemotronHConfig

    stock, fixed = exports[()]["cases"][False], exports[(FIX,)]["cases"][False]
    mtp = stock.provider["mtp_hybrid_override_pattern"]
    assert "mtp_hybrid_override_pattern" not in stock.exported
    assert NemotronHConfig(**stock.exported).mtp_hybrid_override_pattern == NemotronHConfig().mtp_hybrid_override_pattern != mtp
    assert fixed.exported["mtp_hybrid_override_pattern"] == mtp and fixed.exported["num_nextn_predict_layers"] == 1
    assert NemotronHConfig(**fixed.exported).mtp_hybrid_override_pattern == mtp
    assert exports[()]["issue"] == (2, "*E") and exports[(FIX,)]["issue"] == (1, "*E")


REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
from mtp_overlay.bed.steps.bridge_step import import_gpt_step
import_gpt_step()
import megatron.bridge.models.nemotronh.nemotron_h_bridge as module
row = mtp_overlay.status(only=["bridge-mtp-export"])[0]
print(json.dumps({"state": row.state, "reason": row.reason,
                  "wrapped": type(vars(module.NemotronHBridge)["megatron_to_hf_config"]).__name__}))
"""


@pytest.mark.slow
@needs_bridge
def test_an_export_with_pr_5948s_depth_alone_still_needs_the_pattern(tmp_path):
    """A copy of the installed Bridge whose export carries PR #5948's depth rule (what Bridge main has
    after it): the probe still finds the pattern dropped, so the fix goes in, for the pattern."""
    site = link_installed("megatron-bridge", tmp_path / "site", copies=[MODULE])
    path = site / MODULE
    source = path.read_text()
    assert source.count(DEPTH_ONLY[0]) == 1
    path.write_text(source.replace(*DEPTH_ONLY))
    row = run_json(site, REPORT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert row["state"] == "installed" and row["wrapped"] == "FunctionWrapper"
    assert row["reason"] == ("megatron.bridge.models.nemotronh.nemotron_h_bridge: a provider not finalized exports "
                             "no mtp_hybrid_override_pattern")


@pytest.mark.slow
@needs_bridge
def test_the_stock_path_shows_the_bug():
    pytest.importorskip("vllm")
    shows, evidence = reproduce(FIX)
    assert shows, evidence
    assert "exports num_nextn_predict_layers=2" in evidence and "AssertionError" in evidence
    assert "mtp_hybrid_override_pattern dropped" in evidence

