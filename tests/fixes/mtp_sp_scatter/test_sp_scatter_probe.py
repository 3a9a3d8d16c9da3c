"""mtp-sp-scatter's probe on real megatron-core releases: needed, redundant, drifted.

Each case imports a real megatron-core (the venv's pinned release, a side-by-side release, or a copy of one
that the test patched or broke) in a fresh interpreter with the overlay on.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from pins import MEGATRON_CORE

from mtp_overlay.bed.runtime.releases import release_copy, run_json, run_with_release

# fresh interpreters on release copies: the full suite (the pin's probe: the contract and support-matrix tests)
pytestmark = pytest.mark.slow

PATCHES = Path(__file__).resolve().parents[3] / "patches" / "mtp-sp-scatter" / "megatron-core"
MODULE = "megatron/core/transformer/multi_token_prediction.py"

REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
import megatron.core.transformer.multi_token_prediction as m
row = mtp_overlay.status(only=["mtp-sp-scatter"])[0]
method = vars(m.MultiTokenPredictionLayer).get("_get_embeddings")
print(json.dumps({"state": row.state, "reason": row.reason, "version": row.version,
                  "wrapped": type(method).__name__ == "FunctionWrapper"}))
"""


def report(site, **env):
    return run_json(site, REPORT, env={**os.environ, **env})


def site_of(version, tmp_path):
    return release_copy("megatron-core", version, tmp_path / "site")


def apply_patch(site, patch):
    subprocess.run(["git", "apply", "-p1", str(patch)], cwd=site, check=True)


@pytest.mark.parametrize(
    ("version", "variant"), [("0.16.1", "0.16-0.17"), ("0.18.2", "0.18-0.19"), (MEGATRON_CORE, "0.18-0.19")]
)
def test_stock_release_needs_the_fix_and_gets_the_hook(version, variant, tmp_path):
    row = report(site_of(version, tmp_path))
    assert row["version"] == version
    assert row["state"] == "installed" and variant in row["reason"]
    assert row["wrapped"]


@pytest.mark.parametrize(("version", "patch"), [("0.16.1", "0.16"), ("0.18.2", "0.18"), (MEGATRON_CORE, "0.19")])
def test_release_carrying_the_fix_is_redundant_and_left_unwrapped(version, patch, tmp_path):
    site = site_of(version, tmp_path)
    apply_patch(site, PATCHES / f"{patch}.patch")
    row = report(site)
    assert row["state"] == "redundant" and "scatter_to_sequence_parallel_region" in row["reason"]
    assert not row["wrapped"]  # never scatter twice


def break_source(site, old, new):
    path = Path(site) / MODULE
    source = path.read_text()
    assert old in source
    path.write_text(source.replace(old, new))


def test_renamed_method_is_drift_and_import_survives(tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    break_source(site, "def _get_embeddings(", "def _get_embeds(")
    row = report(site)
    assert row["state"] == "drifted" and "has no _get_embeddings" in row["reason"]
    assert not row["wrapped"]


def test_unknown_signature_is_drift_naming_the_parameters(tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    break_source(site, "        padding_mask: Optional[torch.Tensor] = None,\n    ):",
                 "        padding_mask: Optional[torch.Tensor] = None,\n        extra=None,\n    ):")
    row = report(site)
    assert row["state"] == "drifted" and "'extra'" in row["reason"]


def test_drift_warns_by_default_and_strict_mode_fails_the_import(tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    break_source(site, "def _get_embeddings(", "def _get_embeds(")
    code = "import mtp_overlay, megatron.core.transformer.multi_token_prediction"
    relaxed = run_with_release(site, code)
    assert relaxed.returncode == 0 and "OverlayWarning" in relaxed.stderr
    strict = run_with_release(site, code, env={**os.environ, "MTP_OVERLAY_STRICT": "1"})
    assert strict.returncode != 0 and "OverlayError" in strict.stderr and "mtp-sp-scatter" in strict.stderr


def test_megatron_imported_before_the_overlay_is_patched_late(tmp_path):
    code = REPORT.replace("import mtp_overlay\nimport megatron.core.transformer.multi_token_prediction as m",
                          "import megatron.core.transformer.multi_token_prediction as m\nimport mtp_overlay")
    code = code.replace('"wrapped":', '"late": row.late, "wrapped":')
    result = run_with_release(site_of(MEGATRON_CORE, tmp_path), code)
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["state"] == "installed" and row["late"] and row["wrapped"]
