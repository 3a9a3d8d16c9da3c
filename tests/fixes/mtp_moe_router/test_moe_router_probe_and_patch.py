"""mtp-moe-router's probe and DEP-3 patches on real megatron-core releases and on copies edited the way upstream would.

The probe reads three files (``reading``), never importing them: the hybrid stack's MOE branch
(``HybridStack`` 0.18+, ``MambaStack`` 0.17), the router's MTP logging slot and the MTP layer's hybrid
branch. Its verdict (`verdict`, the same for every target) is read here from the files of real
releases and of copies edited the way upstream would (in this process: nothing imported); what the
runtime does with it (the state, the wrappers each target gets, ``patched``, strict mode) from a
fresh interpreter importing such a copy with the overlay on:

* 0.17.1 (MambaStack), 0.18.2, the pinned release: needed, the MOE branch lacks the flag; the hook
  wraps the MTP layer's ``__init__`` and the router's two logging functions;
* PR #6748's edit alone (Megatron-LM main's shape): needed for the slot (#7172), same wrappers;
* the router half of the patch alone: needed for the flag, only the MTP layer's hook (the router
  logs by depth itself);
* the fix's DEP-3 patch on disk (both halves): redundant, nothing wrapped, ``patched``; and the
  release's own stock path then trains like the hook (the reproducer says the bug does not show;
  ``"*E*E/*E"`` trains and logs exactly as the hook makes the pinned release do);
* code of other shapes: drifted, naming what changed; strict mode raises, the import survives.
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from moe_router_cases import FIX, facts_on, two_backbone_moe
from pins import MEGATRON_CORE

from mtp_overlay.fixes.mtp_moe_router import verdict
from mtp_overlay.fixes.mtp_moe_router.reading import MTP_FILE, ROUTER_FILE, STACKS
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.runtime.releases import installed_site, release_copy, release_site, run_json, run_with_release

# fresh interpreters on release copies: the full suite (the pin's probe: the contract and support-matrix tests)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
PATCHES = REPO / "patches" / FIX / "megatron-core"
HYBRID_BLOCK = "megatron/core/models/hybrid/hybrid_block.py"
ROUTER = "megatron/core/transformer/moe/router.py"
MTP = "megatron/core/transformer/multi_token_prediction.py"
WRAPPED = [["MultiTokenPredictionLayer", "__init__"], ["TopKRouter", "apply_z_loss"],
           ["TopKRouter", "attach_and_log_load_balancing_loss"]]

REPORT = """
import importlib, json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
from mtp_overlay import registry
from mtp_overlay.patching.survey import patched_on_disk
life = registry.lifecycle({fix!r})
for target in life.targets:
    try:
        importlib.import_module(target)
    except ModuleNotFoundError:
        pass
row = mtp_overlay.status(only=[{fix!r}], patched=patched_on_disk)[0]
(check,) = registry.check([{fix!r}])
wrapped = sorted([owner.__name__, attribute] for owner, attribute in life.wrapped())
out = dict(state=row.state, reason=row.reason, version=row.version, patched=row.patched, wrapped=wrapped,
           verdict=check.verdict, check=check.reason)
if {reproduce!r}:
    from mtp_overlay.bed.fixes import reproduce
    out["reproduced"] = reproduce({fix!r})
print(json.dumps(out))
"""


def report(site, reproduce=False):
    return run_json(site, REPORT.format(fix=FIX, reproduce=reproduce), env=dict(os.environ))


def copy_of(version, tmp_path):
    return release_copy("megatron-core", version, tmp_path / "site")


def files_of(version, tmp_path, family=None):
    """A folder holding only the files the probe reads, from ``version`` (the venv's or side by side),
    with the fix's ``family`` patch applied when given."""
    site = installed_site("megatron-core") if version == MEGATRON_CORE else release_site("megatron-core", version)
    root = tmp_path / f"files-{version}"
    for relative in (MTP_FILE, ROUTER_FILE) + tuple(file for file, _ in STACKS):
        if (site / relative).exists():
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_bytes((site / relative).read_bytes())
    if family is not None:
        apply_patch(root, family)
    return root


def edit(site, relative, *replacements):
    path = Path(site) / relative
    source = path.read_text()
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path.write_text(source)


def apply_patch(site, family):
    subprocess.run(["git", "apply", "-p1", str(PATCHES / f"{family}.patch")], cwd=site, check=True)


MOE_BRANCH = ("                        submodules.moe_layer,\n                        config=self.config,\n"
              "                        layer_number=layer_number,\n"
              "                        pg_collection=pg_collection,\n")
PR_6748 = (MOE_BRANCH, MOE_BRANCH + "                        is_mtp_layer=is_mtp_layer,\n")
SLOT = "layer_number = self.layer_number + self.config.num_layers"


def test_check_says_needed_on_the_pinned_release():
    """`mtp-overlay check` (the CLI, the CI question) on the venv's megatron-core."""
    code = "import sys\nfrom mtp_overlay.cli import main\nsys.exit(main(['check', '--only', %r, '--json']))" % FIX
    result = run_with_release("", code, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(result.stdout)
    assert row["version"] == MEGATRON_CORE and row["verdict"] == "needed"
    assert "the MOE branch of HybridStack.__init__ builds the MTP block's MoE layers without is_mtp_layer" \
        in row["reason"]


# ---------------------------------------------------------------- the verdict, read from the files


@pytest.mark.parametrize(("version", "stack"), [("0.17.1", "MambaStack"), ("0.18.2", "HybridStack"),
                                                (MEGATRON_CORE, "HybridStack")])
def test_stock_releases_lack_the_flag(version, stack, tmp_path):
    found = verdict(files_of(version, tmp_path))
    assert found.state == "needed", found.reason
    assert found.reason.startswith(f"the MOE branch of {stack}.__init__ builds the MTP block's MoE layers without "
                                   "is_mtp_layer")


def test_releases_without_a_hybrid_mtp_block_are_drift(tmp_path):
    """0.16.1 has MambaStack but builds no hybrid MTP block: nothing for the hook to follow."""
    found = verdict(files_of("0.16.1", tmp_path))
    assert found.state == "drifted" and "builds no MambaStack(..., is_mtp_layer=True)" in found.reason


def test_upstreams_flag_alone_still_needs_the_slot_half(tmp_path):
    """PR #6748's edit (as on Megatron-LM main @ d98e8a64): the router still logs by the place in the
    MTP pattern (#7172)."""
    root = files_of(MEGATRON_CORE, tmp_path)
    edit(root, HYBRID_BLOCK, PR_6748)
    found = verdict(root)
    assert found.state == "needed" and "passes is_mtp_layer (PR #6748)" in found.reason and "#7172" in found.reason


@pytest.mark.parametrize(("version", "family"), [("0.17.1", "0.17"), ("0.18.2", "0.18"), (MEGATRON_CORE, "0.19")])
def test_each_patch_carries_both_halves(version, family, tmp_path):
    found = verdict(files_of(version, tmp_path, family))
    assert found.state == "redundant", found.reason
    assert "passes is_mtp_layer and TopKRouter.attach_and_log_load_balancing_loss already calls mtp_depth" \
        in found.reason


@pytest.mark.parametrize(("relative", "replacements", "why"), [
    (HYBRID_BLOCK, (("submodules.moe_layer,", "submodules.moe_block,"),), "builds no submodules.moe_layer"),
    (ROUTER, ((f"\n            {SLOT}\n", "\n            layer_number = self.layer_number + num_layers - 1\n"),),
     "no longer logs an MTP layer at self.layer_number + self.config.num_layers"),
    (ROUTER, (("self.is_mtp_layer\n            and self.config.mtp_use_repeated_layer\n", "self.is_mtp_layer\n"),),
     "no longer divides a repeated MTP layer's loss"),
    (ROUTER, (("    def apply_z_loss(", "    def apply_router_z_loss("),), "TopKRouter has no apply_z_loss"),
    (MTP, (("                is_mtp_layer=True,\n                name=(name + \".mtp_model_layer\")",
            "                is_mtp_layer=False,\n                name=(name + \".mtp_model_layer\")"),),
     "builds no HybridStack(..., is_mtp_layer=True)"),
], ids=["moe-branch", "slot", "division", "z-loss", "mtp-branch"])
def test_code_of_another_shape_is_drift(relative, replacements, why, tmp_path):
    root = files_of(MEGATRON_CORE, tmp_path)
    edit(root, relative, *replacements)
    found = verdict(root)
    assert found.state == "drifted" and why in found.reason, found.reason


def test_half_a_patch_is_needed_or_drift(tmp_path):
    """The router half alone: needed (the flag is missing; the hook gives the depth). The stack and
    router halves without the MTP layer's: drift (the router would wait for a depth never given)."""
    patched, root = files_of(MEGATRON_CORE, tmp_path / "patched", "0.19"), files_of(MEGATRON_CORE, tmp_path)
    (root / ROUTER).write_bytes((patched / ROUTER).read_bytes())
    found = verdict(root)
    assert found.state == "needed" and "without is_mtp_layer" in found.reason
    (root / HYBRID_BLOCK).write_bytes((patched / HYBRID_BLOCK).read_bytes())
    found = verdict(root)
    assert found.state == "drifted" and "MultiTokenPredictionLayer.__init__ never sets it" in found.reason


# ---------------------------------------------------------------- the runtime, on imported copies


def test_the_pinned_release_gets_both_hooks():
    row = report("")
    assert row["version"] == MEGATRON_CORE and row["state"] == "installed" and row["verdict"] == "needed"
    assert row["wrapped"] == WRAPPED and row["patched"] is False


def test_a_router_logging_by_depth_gets_only_the_build_hook(tmp_path):
    """The patch's router.py alone on disk: the MTP layer's hook goes in, the router's logging wrappers
    do not (its own code logs by the depth the hook gives)."""
    site = copy_of(MEGATRON_CORE, tmp_path)
    patched = files_of(MEGATRON_CORE, tmp_path, "0.19")
    (Path(site) / ROUTER).write_bytes((patched / ROUTER).read_bytes())
    row = report(site)
    assert row["state"] == "installed" and row["wrapped"] == [["MultiTokenPredictionLayer", "__init__"]]


@pytest.mark.parametrize(("version", "family"), [("0.17.1", "0.17"), ("0.18.2", "0.18"), (MEGATRON_CORE, "0.19")])
def test_patched_release_stands_the_hook_down_and_its_stock_path_is_right(version, family, tmp_path):
    """The DEP-3 patch on disk: redundant, nothing wrapped, patched; the release's own MTP block, run
    stock (the reproducer), builds the router flagged, trains its aux loss once and logs it in the
    depth's slot."""
    site = copy_of(version, tmp_path)
    apply_patch(site, family)
    row = report(site, reproduce=True)
    assert row["state"] == "redundant" and row["verdict"] == "redundant" and row["wrapped"] == []
    assert row["patched"] is True
    shows, evidence = row["reproduced"]
    assert not shows and "is_mtp_layer=True" in evidence and "1.000x" in evidence and "slot [3] of 4" in evidence


ON_PATCHED = """
import json, sys
sys.path.insert(0, {tests!r})
from moe_router_cases import two_backbone_moe
from mtp_overlay.bed.runtime.launcher import run_ranks_checked

if __name__ == "__main__":
    import megatron.core

    facts = run_ranks_checked(two_backbone_moe, 1, args=(({fix!r},),), fixes=[], timeout=600)[0]
    facts["mtp"] = {{name: grad.tolist() for name, grad in facts["mtp"].items()}}
    print("FACTS " + json.dumps(dict(facts, file=megatron.core.__file__)))
"""


def test_patched_release_trains_like_the_hook(tmp_path):
    """``"*E*E/*E"`` through Megatron's step on the patched pinned release (the hook standing down)
    gives the gradients and slots the hook gives on the stock pinned release."""
    site = copy_of(MEGATRON_CORE, tmp_path)
    apply_patch(site, "0.19")
    patched = facts_on(site, ON_PATCHED, tmp_path / "on_patched.py")
    assert patched["file"].startswith(str(site)) and patched["error"] is None
    hooked = run_ranks_checked(two_backbone_moe, 1, args=((FIX,),), fixes=[], timeout=600)[0]
    assert {metric: tuple(slots) for metric, slots in patched["slots"].items()} == hooked["slots"]
    for name, grad in hooked["mtp"].items():
        assert np.array_equal(np.asarray(patched["mtp"][name], dtype=grad.dtype), grad), name


def test_drift_warns_and_strict_mode_raises_naming_the_fix(tmp_path):
    site = copy_of(MEGATRON_CORE, tmp_path)
    edit(site, HYBRID_BLOCK, ("submodules.moe_layer,", "submodules.moe_block,"))
    code = "import mtp_overlay, megatron.core.models.hybrid.hybrid_block"
    strict = run_with_release(site, code, env={**os.environ, "MTP_OVERLAY_STRICT": "1"})
    assert strict.returncode != 0 and "OverlayError" in strict.stderr and FIX in strict.stderr
    relaxed = run_with_release(site, code)
    assert relaxed.returncode == 0 and "OverlayWarning" in relaxed.stderr and FIX in relaxed.stderr
