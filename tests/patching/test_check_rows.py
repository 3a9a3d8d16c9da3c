"""`mtp-overlay check --json` rows say what `status --json` says of the same fix on the same path.

check takes the hooks off before it probes the stock code; its rows still carry the state the process
had before (not the "disabled" of its own uninstall) and ``patched`` read from disk, as status does.
Real CLI (`mtp_overlay.cli.main`, status then check, as a user runs them) in a child interpreter whose
path starts with a private copy of the pinned megatron-core, before and after `mtp-overlay patch apply`.
"""

import json
import os
import sys

import pytest

from pins import MEGATRON_CORE
from test_patching import patch, site_copy

from mtp_overlay.bed.runtime.releases import run_with_release

FIX = "mtp-sp-scatter"
STATUS_THEN_CHECK = """
import contextlib, io, json
from mtp_overlay.cli import main

seen = {}
for argv in (["status", "--json"], ["check", "--only", FIX, "--json"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    seen[argv[0]] = [code, {row["name"]: row for row in json.loads(out.getvalue())}]
print(json.dumps(seen))
"""


def status_then_check(site, env=None):
    """`mtp-overlay status --json`, then `mtp-overlay check --only FIX --json`, in one interpreter with
    ``site`` first on the path: {command: (exit code, {fix: row})}."""
    result = run_with_release(site, STATUS_THEN_CHECK.replace("FIX", repr(FIX)), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_check_rows_carry_the_state_and_the_patch_on_disk_that_status_reports(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    seen = {}
    for label in ("stock", "patched", "patched, disabled"):
        if label == "patched":
            assert patch(capsys, "apply", "--site-packages", str(site))[0] == 0
        env = {**os.environ, "MTP_OVERLAY_DISABLE": FIX} if label.endswith("disabled") else None
        ran = status_then_check(site, env=env)
        seen[label] = (ran["status"][1][FIX], ran["check"][1][FIX], ran["check"][0])
    for label, (status, check, code) in seen.items():
        assert code == 0, label
        assert (check["state"], check["patched"]) == (status["state"], status["patched"]), (label, check, status)
    assert [seen[label][1]["patched"] for label in seen] == [False, True, True]
    assert [seen[label][1]["state"] for label in seen] == ["pending", "pending", "disabled"]
    assert [seen[label][1]["verdict"] for label in seen] == ["needed", "redundant", "redundant"]


def test_status_and_check_say_unknown_where_no_git_can_read_an_edited_file(tmp_path):
    """A locally edited module decides nothing by its hash; telling "patched, then edited" from
    "edited" takes `git apply --reverse`. Without git both commands still answer, patched null."""
    site = site_copy(MEGATRON_CORE, tmp_path)
    module = site / "megatron" / "core" / "transformer" / "multi_token_prediction.py"
    module.write_text(module.read_text() + "# a local edit\n")
    bare = tmp_path / "bin"  # a PATH with python but no git
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bare)}
    ran = status_then_check(site, env=env)
    (_, status), (code, check) = ran["status"], ran["check"]
    assert code == 0 and status[FIX]["patched"] is None and check[FIX]["patched"] is None
    assert check[FIX]["verdict"] == "needed" and check[FIX]["state"] == status[FIX]["state"] == "pending"
