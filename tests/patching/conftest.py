"""Fixtures of the patching tests: a private copy of the pinned megatron-core, and test-only fixes with
measured test-only patches (several files, several fixes) registered for the duration of a test."""

import difflib
import json

import pytest
from test_patching import site_copy
from pins import MEGATRON_CORE

from mtp_overlay import declarations, table
from mtp_overlay.contract import Declaration, Provenance
from mtp_overlay.bed.engines.patch_images import measure, patches_for


def comment_fix(name):
    """The declaration of a test-only fix whose 0.19 patch inserts a comment line into each of its files."""
    return Declaration(name, summary="test-only", symptom="test-only", distribution="megatron-core",
                       targets={"mtp": "megatron.core.transformer.multi_token_prediction"},
                       families={"0.19": ">=0.19,<0.20"}, provenance=Provenance("tests"))


@pytest.fixture
def test_fixes(site_0_19, tmp_path, monkeypatch):
    """``make(name -> files)``: registered test-only fixes and a manifest measured for them; returns
    the manifest path (the CLI's ``--manifest``) and the fixes."""

    def make(files_of):
        folder = tmp_path / "test-manifest"
        fixes = []
        for index, (name, files) in enumerate(files_of.items()):
            diff, at = [], 3 + 40 * index  # hunks of fixes sharing a file never overlap
            for file in files:
                old = (site_0_19 / file).read_text().splitlines(keepends=True)
                new = old[:at] + [f"# {name} test patch\n"] + old[at:]
                diff += difflib.unified_diff(old, new, fromfile=f"a/{file}", tofile=f"b/{file}")
            patch_file = folder / name / "megatron-core" / "0.19.patch"
            patch_file.parent.mkdir(parents=True)
            patch_file.write_text("Description: test-only patch\n---\n" + "".join(diff))
            fix = comment_fix(name)
            monkeypatch.setattr(table, "FIXES", table.FIXES + ((name, fix.modules),))
            monkeypatch.setitem(declarations._loaded, name, fix)
            fixes.append(fix)
        patches = patches_for(fixes, "megatron-core", MEGATRON_CORE, folder)
        released = {file: (site_0_19 / file).read_bytes() for files in files_of.values() for file in files}
        images = {"megatron-core": {MEGATRON_CORE: measure(patches, released)}}
        (folder / "manifest.json").write_text(json.dumps({"format": 2, **images}))
        return folder / "manifest.json", fixes

    return make


@pytest.fixture
def site_0_19(tmp_path):
    return site_copy(MEGATRON_CORE, tmp_path)


