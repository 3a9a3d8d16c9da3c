"""Upstream tracking on real upstream copies: the committed support matrix is current for
the default pins, and a fix that upstream absorbed or that stopped fitting fails CI loudly."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_overlay import registry
from mtp_overlay.testing.releases import copy_installed, run_with_release

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "mtp-sp-scatter" / "megatron-core" / "0.19.patch"
ROW = re.compile(r"^\| (?P<name>[\w-]+) \| (?P<dist>[\w.-]+) \| (?P<version>[\w.]+) \| \*\*(?P<state>\w+)\*\* \|")


def committed_matrix():
    rows = (ROW.match(line) for line in (ROOT / "docs" / "SUPPORT.md").read_text().splitlines())
    return {(m["name"], m["version"]): m["state"] for m in rows if m}


def test_committed_support_matrix_is_current_for_the_default_pins():
    table = committed_matrix()
    for row in registry.check():
        if row.version is None:
            continue
        key = (row.name, row.version)
        assert key in table, f"docs/SUPPORT.md has no row for {key}: run scripts/upstream_matrix.sh"
        assert table[key] == row.verdict, (
            f"docs/SUPPORT.md says {row.name} is {table[key]} on {row.distribution} {row.version}, "
            f"the probe now says {row.verdict} ({row.reason}): run scripts/upstream_matrix.sh"
        )


@pytest.fixture(scope="module")
def fixed_upstream(tmp_path_factory):
    """A copy of the installed megatron-core carrying the upstream fix (our patch of PR #6256)."""
    site = copy_installed("megatron-core", tmp_path_factory.mktemp("fixed") / "site")
    subprocess.run(["git", "apply", "-p1", str(PATCH)], cwd=site, check=True)
    return site


def overlay(site, *args):
    return run_with_release(site, f"import sys; from mtp_overlay.cli import main; sys.exit(main({list(args)!r}))")


def test_check_fails_on_redundancy_only_when_asked(fixed_upstream):
    relaxed = overlay(fixed_upstream, "check", "--only", "mtp-sp-scatter")
    assert relaxed.returncode == 0 and "redundant" in relaxed.stdout
    strict = overlay(fixed_upstream, "check", "--only", "mtp-sp-scatter", "--fail-on-redundant")
    assert strict.returncode == 1


def test_check_fails_on_drift(tmp_path):
    site = copy_installed("megatron-core", tmp_path / "site")
    module = site / "megatron" / "core" / "transformer" / "multi_token_prediction.py"
    module.write_text(module.read_text().replace("def _get_embeddings(", "def _embed_for_mtp("))
    result = overlay(site, "check", "--only", "mtp-sp-scatter")
    assert result.returncode == 1 and "drifted" in result.stdout and "no _get_embeddings" in result.stdout


def test_tracking_test_names_the_absorbed_fix_and_what_to_do(fixed_upstream, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(fixed_upstream), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "mtp_overlay.upstream_tests", "-k", "mtp-sp-scatter",
         "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "mtp-sp-scatter is REDUNDANT on megatron-core 0.19.2" in result.stdout
    assert "Applied-Upstream" in result.stdout and "first_fixed_release" in result.stdout
