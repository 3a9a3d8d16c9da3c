"""mtp-packed-roll's DEP-3 patches on real releases, sharing a file with mtp-sp-scatter's.

Both fixes patch megatron-core's ``transformer/multi_token_prediction.py`` in hunks that do not
overlap: each applies whether or not the other is on disk, in either order, and reverts alone; every
state of the file is one the manifest measured (that the hashes are the wheels' is
tests/patching/test_patching.py's).
"""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from pins import MEGATRON_CORE

from mtp_overlay.cli import main
from mtp_overlay.patching.manifest import DEFAULT_PATH, load
from mtp_overlay.bed.runtime.releases import copy_installed, release_site

MODULE = "megatron/core/transformer/multi_token_prediction.py"
FIX, OTHER = "mtp-packed-roll", "mtp-sp-scatter"


def sha(data):
    return hashlib.sha256(data).hexdigest()


def image(*applied, version=MEGATRON_CORE):
    """The manifest's sha256 of the file carrying the patches of the fixes ``applied``."""
    return load().images["megatron-core"][version][MODULE][frozenset(applied)]


def patch(capsys, *args):
    capsys.readouterr()
    code = main(["patch", *args, "--json"])
    return code, {row["fix"]: row for row in json.loads(capsys.readouterr().out or "[]")}


def tree(root):
    return {str(p.relative_to(root)): sha(p.read_bytes()) for p in sorted(Path(root).rglob("*")) if p.is_file()}


def site_copy(version, tmp_path):
    if version == MEGATRON_CORE:
        return copy_installed("megatron-core", tmp_path / "site")
    return copy_installed("megatron-core", tmp_path / "site", site=release_site("megatron-core", version))


@pytest.mark.parametrize("version", [MEGATRON_CORE, pytest.param("0.16.1", marks=pytest.mark.slow)])
def test_both_fixes_apply_check_and_revert_together_byte_identically(version, tmp_path, capsys):
    site = site_copy(version, tmp_path)
    before = tree(site)
    where = ("--site-packages", str(site), "--only", FIX, "--only", OTHER)
    code, rows = patch(capsys, "check", *where)
    assert code == 0 and {rows[FIX]["state"], rows[OTHER]["state"]} == {"needed"}

    code, rows = patch(capsys, "apply", *where)
    assert code == 0 and {name: row["action"] for name, row in rows.items()} == {FIX: "patched", OTHER: "patched"}
    assert tree(site)[MODULE] == image(FIX, OTHER, version=version)
    source = (site / MODULE).read_text()
    assert "scatter_to_sequence_parallel_region(decoder_input" in source and "cu_seqlens_q_padded" in source
    assert patch(capsys, "check", *where, "--fail-on-needed")[0] == 0

    code, rows = patch(capsys, "revert", *where)
    assert code == 0 and {row["action"] for row in rows.values()} == {"reverted"}
    assert tree(site) == before


def test_each_fix_applies_and_reverts_alone_whatever_the_other_did(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    before = tree(site)
    at = ("--site-packages", str(site))
    post, other_only, both = image(FIX), image(OTHER), image(FIX, OTHER)

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
    site = site_copy(MEGATRON_CORE, tmp_path)
    with open(site / MODULE, "a") as handle:
        handle.write("# a local edit\n")
    before = tree(site)
    capsys.readouterr()
    assert main(["patch", "apply", "--site-packages", str(site), "--only", FIX]) == 1
    text = capsys.readouterr().out
    assert f"expected sha256 {image()} (megatron-core {MEGATRON_CORE} as released, or with other fixes' patches)" in text
    assert tree(site) == before


def test_patched_file_is_redundant_to_the_engine_past_every_variant(tmp_path, capsys):
    """A later release carrying the padded roll (here: our patch under a version no variant fits)."""
    site = site_copy(MEGATRON_CORE, tmp_path)
    subprocess.run(["git", "apply", str(DEFAULT_PATH.parent / FIX / "megatron-core" / "0.17-0.19.patch")], cwd=site, check=True)
    metadata = next(site.glob("megatron_core-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace(f"\nVersion: {MEGATRON_CORE}\n", "\nVersion: 0.20.0\n", 1))
    code, rows = patch(capsys, "check", "--site-packages", str(site), "--only", FIX)
    assert code == 0 and rows[FIX]["state"] == "redundant" and "roll_tensor already calls cu_seqlens_q_padded" in rows[FIX]["reason"]
