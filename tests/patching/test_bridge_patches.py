"""The three Megatron-Bridge fixes as DEP-3 source patches, through `mtp-overlay patch`, on private copies
of the Bridge releases that install here: 0.6.0 (side by side) and the venv's pin, both in the layout
``pip install --no-deps`` leaves (the ``megatron/`` tree, shared with megatron-core, and a
``megatron_bridge-<version>.dist-info`` at the site root). The copies are hard links but for the
touched files (`releases.link_installed`). The patched pin then imports in a fresh interpreter where
every runtime hook stands down (~30 s here, slow); the round trips take a few seconds.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest
from pins import MEGATRON_BRIDGE

from mtp_overlay import declarations
from mtp_overlay.cli import main
from mtp_overlay.patching.manifest import DEFAULT_PATH, load, touched_files
from mtp_overlay.patching.survey import marker_on_disk
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.releases import link_installed, release_site, run_json

ROOT = Path(__file__).resolve().parents[2]
FIXES = ("bridge-sft-mtp-mask", "bridge-mtp-export", "bridge-mtp-off")
VERSIONS = ("0.6.0", MEGATRON_BRIDGE)
DEP3 = ["Description:", "Origin:", "Bug:", "Forwarded:", "Applied-Upstream:", "Author:", "Last-Update:"]
pytestmark = pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)


def patch_files():
    return {name: DEFAULT_PATH.parent / name / "megatron-bridge" / "0.6.patch" for name in FIXES}


def files_of(name):
    return touched_files(patch_files()[name])


def bridge_copy(version, destination):
    """A private copy of megatron-bridge ``version``: hard links, real copies of the patched files."""
    site = None if version == MEGATRON_BRIDGE else release_site("megatron-bridge", version)
    copies = [file for name in FIXES for file in files_of(name)]
    return link_installed("megatron-bridge", destination, site=site, copies=copies)


def digests(site, files):
    return {file: hashlib.sha256((site / file).read_bytes()).hexdigest() for file in files}


def patch(capsys, *args):
    capsys.readouterr()
    code = main(["patch", *args, *[f"--only={name}" for name in FIXES], "--json"])
    return code, {row["fix"]: row for row in json.loads(capsys.readouterr().out)}


def test_each_patch_has_its_dep3_headers_and_one_file_of_its_own():
    touched = [file for name in FIXES for file in files_of(name)]
    assert len(touched) == len(set(touched)) == len(FIXES)  # no two Bridge fixes share a file
    for name, path in patch_files().items():
        header = path.read_text().split("\n---\n", 1)[0]
        fields = [line.split(":")[0] + ":" for line in header.splitlines() if line[:1].isalpha() and ":" in line]
        assert sorted(set(fields)) == sorted(DEP3), (name, fields)
        assert declarations.load(name).family_of(MEGATRON_BRIDGE) == "0.6"


@pytest.mark.parametrize("version", VERSIONS)
def test_check_apply_revert_round_trip_on_the_no_deps_layout(version, tmp_path, capsys):
    site = bridge_copy(version, tmp_path / "site")
    assert (site / f"megatron_bridge-{version}.dist-info").is_dir() and (site / "megatron" / "bridge").is_dir()
    files = [file for name in FIXES for file in files_of(name)]
    released = digests(site, files)
    images = load().images["megatron-bridge"][version]
    assert released == {file: images[file][frozenset()] for file in files}  # the manifest's, measured from it
    fixes = [declarations.load(name) for name in FIXES]
    assert [marker_on_disk(fix, site) for fix in fixes] == [False, False, False]

    code, rows = patch(capsys, "check", "--site-packages", str(site))
    assert code == 0 and {name: (row["state"], row["variant"], row["version"]) for name, row in rows.items()} == {
        name: ("needed", "0.6.patch", version) for name in FIXES}
    code, rows = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and {name: (row["action"], row["state"]) for name, row in rows.items()} == {
        name: ("patched", "applied") for name in FIXES}
    assert digests(site, files) == {file: images[file][frozenset({name})] for name in FIXES for file in files_of(name)}
    # the export's marker (it reads mtp_use_repeated_layer) is on disk; the other two declare none
    assert [marker_on_disk(fix, site) for fix in fixes] == [False, True, False]
    code, rows = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and {row["action"] for row in rows.values()} == {"already applied"}

    code, rows = patch(capsys, "revert", "--site-packages", str(site))
    assert code == 0 and {(row["action"], row["state"]) for row in rows.values()} == {("reverted", "needed")}
    assert digests(site, files) == released


def test_a_locally_edited_file_is_a_mismatch_and_nothing_is_written(tmp_path, capsys):
    site = bridge_copy(MEGATRON_BRIDGE, tmp_path / "site")
    [edited] = files_of("bridge-mtp-off")
    with open(site / edited, "a") as handle:
        handle.write("# local edit\n")
    files = [file for name in FIXES for file in files_of(name)]
    before = digests(site, files)
    code, rows = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 1 and rows["bridge-mtp-off"]["state"] == "mismatch"
    assert {row["action"] for row in rows.values()} == {"refused"}  # all or nothing
    assert digests(site, files) == before


REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
from mtp_overlay import registry
from mtp_overlay.bed.steps.bridge_step import import_step
step = import_step("deepseek_v4_step")
import megatron.bridge.models.hybrid.hybrid_provider as provider
import megatron.bridge.models.nemotronh.nemotron_h_bridge as export
import megatron.bridge.training.gpt_step as gpt_step
names = %r
hooked = {
    "gpt_step": vars(gpt_step)["_forward_step_common"], "deepseek_v4_step": vars(step)["_forward_step_common"],
    "export": vars(export.NemotronHBridge)["megatron_to_hf_config"], "finalize": vars(provider.HybridModelProvider)["finalize"],
}
print(json.dumps({
    "file": gpt_step.__file__,
    "status": {row.name: row.state for row in mtp_overlay.status(names)},
    "check": {row.name: row.verdict for row in registry.check(names)},
    "wrapped": sorted(name for name, value in hooked.items() if type(value).__name__ == "FunctionWrapper"),
}))
""" % (list(FIXES),)


@pytest.mark.slow
def test_the_patched_pin_imports_and_every_runtime_hook_stands_down(tmp_path, capsys):
    """The probes read the patched files as upstream carrying the fix: redundant, nothing wrapped."""
    site = bridge_copy(MEGATRON_BRIDGE, tmp_path / "site")
    code, _ = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0
    row = run_json(site, REPORT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    assert row["file"].startswith(str(site))
    assert row["status"] == dict.fromkeys(FIXES, "redundant")
    assert row["check"] == dict.fromkeys(FIXES, "redundant") and row["wrapped"] == []


SOURCE_CHECKS = """
import contextlib, io, json
from pathlib import Path
from mtp_overlay import registry
from mtp_overlay.cli import main

names, site, edits = %r, Path(%r), %r
seen = {}

def check(label):
    seen[label] = {row.name: [row.verdict, row.probed, row.reason] for row in registry.check(names)}

check("stock")
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["patch", "apply", "--site-packages", str(site), *["--only=" + name for name in names]]) == 0
check("patched")
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["patch", "revert", "--site-packages", str(site), *["--only=" + name for name in names]]) == 0
for file, text in edits.items():
    with open(site / file, "a") as handle:
        handle.write(text)
check("edited")
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_check_reads_the_source_of_a_bridge_that_cannot_import_here(tmp_path):
    """Without Transformer Engine Bridge's targets do not import: `check` answers from the installed
    files (~15 s here): as released, needed; patched on disk, redundant; a local edit the patch no longer
    fits, drifted; a file that does not parse, unsupported. Each row says it read the source, and why."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: Bridge's targets import, nothing is read from source")
    site = bridge_copy(MEGATRON_BRIDGE, tmp_path / "site")
    [edited] = files_of("bridge-mtp-off")
    [broken] = files_of("bridge-mtp-export")
    edits = {edited: "# a local edit\n", broken: "def (\n"}
    seen = run_json(site, SOURCE_CHECKS % (list(FIXES), str(site), edits), env={**os.environ, "PYTHONPATH": str(ROOT)},
                    timeout=900)
    assert {label: {name: row[:2] for name, row in rows.items()} for label, rows in seen.items()} == {
        "stock": dict.fromkeys(FIXES, ["needed", "source"]),
        "patched": dict.fromkeys(FIXES, ["redundant", "source"]),
        "edited": {"bridge-sft-mtp-mask": ["needed", "source"], "bridge-mtp-off": ["drifted", "source"],
                   "bridge-mtp-export": ["unsupported", "source"]},
    }
    for label, rows in seen.items():
        for name, (_, _, reason) in rows.items():
            assert "does not import here (ModuleNotFoundError: No module named '" in reason, (label, name, reason)
    assert "its source patch is on disk" in seen["patched"]["bridge-mtp-off"][2]
    assert f"{edited}: expected sha256" in seen["edited"]["bridge-mtp-off"][2]
    assert f"cannot read {site / broken}: SyntaxError" in seen["edited"]["bridge-mtp-export"][2]
