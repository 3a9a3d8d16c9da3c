"""mtp-packed-roll's DEP-3 patches, and two fixes patching one file (with mtp-sp-scatter).

Both fixes patch megatron-core's ``transformer/multi_token_prediction.py`` in hunks that do not
overlap. Each patch must apply whether or not the other is on disk, in either order, revert alone,
and every state of the file must be one the manifest measured (its ``with`` combinations).
"""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from mtp_overlay.cli import main
from mtp_overlay.patching import engine
from mtp_overlay.patching.manifest import DEFAULT_PATH, ManifestError, load
from mtp_overlay.testing.releases import copy_installed, release_site

MODULE = "megatron/core/transformer/multi_token_prediction.py"
FIX, OTHER = "mtp-packed-roll", "mtp-sp-scatter"


def released(version):
    """The release's own file, byte for byte (0.19.2: the venv's install)."""
    if version == "0.19.2":
        from importlib import metadata

        return Path(metadata.distribution("megatron-core").locate_file(MODULE)).read_bytes()
    return (release_site("megatron-core", version) / MODULE).read_bytes()


def sha(data):
    return hashlib.sha256(data).hexdigest()


def apply(variant, data):
    files, error = engine._git_apply(variant, {MODULE: data}, reverse=False)
    assert error == "", error
    return files[MODULE]


MEASURED = [(variant.patch.name, version) for variant in load().fixes[FIX].variants for version in variant.measured]


@pytest.mark.parametrize(("patch_name", "version"), MEASURED)
def test_measured_hashes_hold_alone_and_in_both_orders_with_sp_scatter(patch_name, version):
    manifest = load()
    mine, other = manifest.fixes[FIX].variant_for(version), manifest.fixes[OTHER].variant_for(version)
    assert mine.patch.name == patch_name
    original = released(version)
    pre, post = mine.measured[version][MODULE]
    assert sha(original) == pre and sha(apply(mine, original)) == post

    mine_first = apply(other, apply(mine, original))
    other_first = apply(mine, apply(other, original))
    assert mine_first == other_first  # disjoint hunks: the order does not matter
    with_other = mine.combined[version][MODULE][frozenset({OTHER})]
    assert with_other == (sha(apply(other, original)), sha(other_first))
    assert other.combined[version][MODULE][frozenset({FIX})] == (post, sha(mine_first))


def patch(capsys, *args):
    capsys.readouterr()
    code = main(["patch", *args, "--json"])
    return code, {row["fix"]: row for row in json.loads(capsys.readouterr().out or "[]")}


def tree(root):
    return {str(p.relative_to(root)): sha(p.read_bytes()) for p in sorted(Path(root).rglob("*")) if p.is_file()}


def site_copy(version, tmp_path):
    if version == "0.19.2":
        return copy_installed("megatron-core", tmp_path / "site")
    return copy_installed("megatron-core", tmp_path / "site", site=release_site("megatron-core", version))


@pytest.mark.parametrize("version", ["0.19.2", pytest.param("0.16.1", marks=pytest.mark.slow)])
def test_both_fixes_apply_check_and_revert_together_byte_identically(version, tmp_path, capsys):
    site = site_copy(version, tmp_path)
    before = tree(site)
    where = ("--site-packages", str(site), "--only", FIX, "--only", OTHER)
    code, rows = patch(capsys, "check", *where)
    assert code == 0 and {rows[FIX]["state"], rows[OTHER]["state"]} == {"needed"}

    code, rows = patch(capsys, "apply", *where)
    assert code == 0 and {name: row["action"] for name, row in rows.items()} == {FIX: "patched", OTHER: "patched"}
    variant = load().fixes[FIX].variant_for(version)
    both = variant.combined[version][MODULE][frozenset({OTHER})][1]
    assert tree(site)[MODULE] == both
    source = (site / MODULE).read_text()
    assert "scatter_to_sequence_parallel_region(decoder_input" in source and "cu_seqlens_q_padded" in source
    assert patch(capsys, "check", *where, "--fail-on-needed")[0] == 0

    code, rows = patch(capsys, "revert", *where)
    assert code == 0 and {row["action"] for row in rows.values()} == {"reverted"}
    assert tree(site) == before


def test_each_fix_applies_and_reverts_alone_whatever_the_other_did(tmp_path, capsys):
    site = site_copy("0.19.2", tmp_path)
    before = tree(site)
    at = ("--site-packages", str(site))
    variant = load().fixes[FIX].variant_for("0.19.2")
    pre, post = variant.measured["0.19.2"][MODULE]
    other_only, both = variant.combined["0.19.2"][MODULE][frozenset({OTHER})]

    assert patch(capsys, "apply", *at, "--only", FIX)[1][FIX]["action"] == "patched"
    assert tree(site)[MODULE] == post
    code, rows = patch(capsys, "apply", *at, "--only", OTHER)  # on top of mtp-packed-roll's patch
    assert code == 0 and rows[OTHER]["action"] == "patched" and tree(site)[MODULE] == both
    code, rows = patch(capsys, "check", *at, "--only", FIX, "--only", OTHER)
    assert {row["state"] for row in rows.values()} == {"applied"}

    code, rows = patch(capsys, "revert", *at, "--only", FIX)  # leaves mtp-sp-scatter's hunk in place
    assert code == 0 and rows[FIX]["action"] == "reverted" and tree(site)[MODULE] == other_only
    code, rows = patch(capsys, "check", *at, "--only", FIX, "--only", OTHER)
    assert (rows[FIX]["state"], rows[OTHER]["state"]) == ("needed", "applied")

    assert patch(capsys, "revert", *at, "--only", OTHER)[1][OTHER]["action"] == "reverted"
    assert tree(site) == before


def test_a_tampered_shared_file_is_refused_naming_every_measured_image(tmp_path, capsys):
    site = site_copy("0.19.2", tmp_path)
    with open(site / MODULE, "a") as handle:
        handle.write("# a local edit\n")
    before = tree(site)
    capsys.readouterr()
    assert main(["patch", "apply", "--site-packages", str(site), "--only", FIX]) == 1
    text = capsys.readouterr().out
    pre, _ = load().fixes[FIX].variant_for("0.19.2").measured["0.19.2"][MODULE]
    other_only, _ = load().fixes[FIX].variant_for("0.19.2").combined["0.19.2"][MODULE][frozenset({OTHER})]
    assert f"expected sha256 {pre} (megatron-core 0.19.2 as released) or {other_only} (with other fixes' patches on it)" in text
    assert tree(site) == before


def test_manifest_refuses_a_shared_file_without_the_combination_measured(tmp_path):
    raw = json.loads(DEFAULT_PATH.read_text())
    variant = next(v for v in raw["fixes"][FIX]["variants"] if "0.19.2" in v["measured"])
    del variant["measured"]["0.19.2"][MODULE]["with"]
    for entry in raw["fixes"].values():
        for item in entry["variants"]:
            item["patch"] = str(DEFAULT_PATH.parent / item["patch"])
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=rf"{FIX} and {OTHER} both patch megatron-core's {MODULE}: .*0\.19\.2 with '{OTHER}'"):
        load(path)


def test_manifest_marker_is_the_runtime_probes_redundancy_signal():
    from mtp_overlay import registry

    marker = load().fixes[FIX].marker
    assert {"file": marker.file, "function": marker.function, "calls": marker.calls} == registry.get(FIX).marker


def test_patched_file_is_redundant_to_the_engine_past_every_variant(tmp_path, capsys):
    """A later release carrying the padded roll (here: our patch under a version no variant fits)."""
    site = site_copy("0.19.2", tmp_path)
    subprocess.run(["git", "apply", str(load().fixes[FIX].variant_for("0.19.2").patch)], cwd=site, check=True)
    metadata = next(site.glob("megatron_core-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("\nVersion: 0.19.2\n", "\nVersion: 0.20.0\n", 1))
    code, rows = patch(capsys, "check", "--site-packages", str(site), "--only", FIX)
    assert code == 0 and rows[FIX]["state"] == "redundant" and "roll_tensor already calls cu_seqlens_q_padded" in rows[FIX]["reason"]
