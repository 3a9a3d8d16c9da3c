"""mtp-cp-loss-scale's probe and source patch on real megatron-core releases.

Each probe case imports a real megatron-core (the venv's pinned release, a side-by-side release, or a copy
that the test patched or broke) in a fresh interpreter with the overlay on: needed on stock
(hooked), redundant where process_mtp_loss reduces the counts itself (the DEP-3 patch, which
carries Megatron-LM PR #7498's logic), drifted on a shape the hook does not know.
"""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from pins import MEGATRON_CORE

from mtp_overlay.patching import engine
from mtp_overlay.bed.runtime.releases import release_copy, run_json, run_with_release

# fresh interpreters on release copies: the full suite (the pin's probe: the contract and support-matrix tests)
pytestmark = pytest.mark.slow

FIX = "mtp-cp-loss-scale"
ROOT = Path(__file__).resolve().parents[3]
PATCH = ROOT / "patches" / FIX / "megatron-core" / "0.19.patch"
MODULE = "megatron/core/transformer/multi_token_prediction.py"

REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
import megatron.core.models.gpt.gpt_model as gpt
import megatron.core.models.hybrid.hybrid_model as hybrid
import megatron.core.transformer.multi_token_prediction as m
row = mtp_overlay.status(only=[%r])[0]
hooked = {
    "mtp.process_mtp_loss": vars(m)["process_mtp_loss"],
    "mtp.roll_tensor": vars(m)["roll_tensor"],
    "save_metrics_to_tracker": vars(m.MTPLossLoggingHelper).get("save_metrics_to_tracker"),
    "gpt_model.process_mtp_loss": vars(gpt).get("process_mtp_loss"),
    "hybrid_model.process_mtp_loss": vars(hybrid).get("process_mtp_loss"),
}
print(json.dumps({"state": row.state, "reason": row.reason, "version": row.version,
                  "wrapped": sorted(k for k, v in hooked.items() if type(v).__name__ == "FunctionWrapper")}))
""" % FIX
ALL_WRAPPED = sorted(["mtp.process_mtp_loss", "mtp.roll_tensor", "save_metrics_to_tracker",
                      "gpt_model.process_mtp_loss", "hybrid_model.process_mtp_loss"])


def environment(**extra):
    """mtp-packed-roll and mtp-logprob-skip off: they wrap roll_tensor and the model modules'
    process_mtp_loss too, and "wrapped" counts this fix's hooks only."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "MTP_OVERLAY_DISABLE": "mtp-packed-roll,mtp-logprob-skip", **extra}


def report(site, **env):
    return run_json(site, REPORT, env=environment(**env))


def site_of(version, tmp_path):
    return release_copy("megatron-core", version, tmp_path / "site")


def edit_source(site, old, new):
    path = Path(site) / MODULE
    source = path.read_text()
    assert source.count(old) == 1, old
    path.write_text(source.replace(old, new))


@pytest.mark.parametrize("version", ["0.19.0", MEGATRON_CORE])  # 0.19.1's file is 0.19.0's
def test_stock_0_19_needs_the_fix_and_gets_every_hook(version, tmp_path):
    row = report(site_of(version, tmp_path))
    assert row["version"] == version
    assert row["state"] == "installed" and "its own token counts" in row["reason"]
    assert row["wrapped"] == ALL_WRAPPED


def test_0_18_is_drift_naming_the_signature(tmp_path):
    row = report(site_of("0.18.2", tmp_path))
    assert row["state"] == "drifted" and "'input_ids'" in row["reason"] and "0.19" in row["reason"]
    assert row["wrapped"] == []


def test_patched_release_is_redundant_and_left_unwrapped(tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=site, check=True)
    row = report(site)
    assert row["state"] == "redundant" and "already calls all_reduce" in row["reason"]
    assert row["wrapped"] == []  # never reduce twice


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("    cp_group: Optional[torch.distributed.ProcessGroup] = None,\n    tp_group: Optional[torch.distributed.ProcessGroup] = None,\n    packed_seq_params",
         "    context_parallel_group=None,\n    tp_group: Optional[torch.distributed.ProcessGroup] = None,\n    packed_seq_params",
         "has no parameter(s) ['cp_group']"),
        ("def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None,",
         "def roll_tensor(tensor, dims=-1, shifts=-1, cp_group=None,", "does not start with"),
    ],
)
def test_unknown_shape_is_drift_and_the_import_survives(old, new, message, tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    edit_source(site, old, new)
    row = report(site)
    assert row["state"] == "drifted" and message in row["reason"], row["reason"]
    assert row["wrapped"] == []


def test_new_helper_is_drift_that_warns_and_strict_mode_fails_the_import(tmp_path):
    """process_mtp_loss calling a helper the hook does not know (it might reduce the counts itself):
    drift, never a second reduction."""
    site = site_of(MEGATRON_CORE, tmp_path)
    edit_source(site, "    original_num_tokens = loss_mask.sum()\n", "    original_num_tokens = _count(loss_mask)\n")
    edit_source(site, "def process_mtp_loss(", "def _count(mask):\n    return mask.sum()\n\n\ndef process_mtp_loss(")
    relaxed = run_with_release(site, REPORT.replace("warnings.simplefilter(\"ignore\")", ""), env=environment())
    assert relaxed.returncode == 0 and "OverlayWarning" in relaxed.stderr and FIX in relaxed.stderr
    row = json.loads(relaxed.stdout.strip().splitlines()[-1])
    assert row["state"] == "drifted" and "new names ['_count']" in row["reason"] and row["wrapped"] == []
    code = "import mtp_overlay, megatron.core.transformer.multi_token_prediction"
    strict = run_with_release(site, code, env=environment(MTP_OVERLAY_STRICT="1"))
    assert strict.returncode != 0 and "OverlayError" in strict.stderr and FIX in strict.stderr


# --- the DEP-3 source patch ------------------------------------------------------------------------
def test_patch_has_dep3_headers():
    header = PATCH.read_text().split("\n---\n", 1)[0]
    for field in ("Description:", "Origin:", "Bug:", "Forwarded:", "Applied-Upstream:", "Last-Update:"):
        assert f"\n{field}" in f"\n{header}", field


@pytest.mark.parametrize("version", ["0.19.0", "0.19.1", MEGATRON_CORE])
def test_patch_applies_and_reverts_byte_exactly_and_carries_the_marker(version, tmp_path):
    """On every 0.19 release (0.19.1 unmeasured: its family's hashes hold), through the patch engine
    with the shipped manifest; the patched file carries the runtime probe's redundancy marker."""
    from mtp_overlay import registry
    from mtp_overlay.patching.manifest import load
    from mtp_overlay.patching.survey import marker_on_disk

    fix = registry.get(FIX)
    site = site_of(version, tmp_path)
    released = (site / MODULE).read_bytes()
    [row] = engine.run("check", [fix], load(), [site])
    assert row.state == "needed", row.reason
    assert not marker_on_disk(fix, site)
    [row] = engine.run("apply", [fix], load(), [site])
    assert row.action == "patched" and hashlib.sha256((site / MODULE).read_bytes()).hexdigest() == row.files[0]["found"]
    assert marker_on_disk(fix, site)
    [row] = engine.run("revert", [fix], load(), [site])
    assert row.action == "reverted" and (site / MODULE).read_bytes() == released
