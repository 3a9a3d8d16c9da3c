"""`mtp-overlay check --json` rows say what `status --json` says of the same fix on the same path.

check takes the hooks off before it probes the stock code; its rows still carry the state the process
had before (not the "disabled" of its own uninstall) and ``patched`` read from disk, as status does.
Real CLI (`mtp_overlay.cli.main`) in a child interpreter whose path starts with a private copy of the
pinned megatron-core, before and after `mtp-overlay patch apply`.
"""

import json
import os

from pins import MEGATRON_CORE
from test_patching import patch, site_copy

from mtp_overlay.testing.releases import run_with_release

FIX = "mtp-sp-scatter"
CLI = "import sys\nfrom mtp_overlay.cli import main\nsys.exit(main({argv!r}))\n"


def cli_rows(site, *argv, env=None):
    """The JSON rows of `mtp-overlay ARGV --json`, run with ``site`` first on the path: (exit code, rows)."""
    result = run_with_release(site, CLI.format(argv=[*argv, "--json"]), env=env)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    return result.returncode, {row["name"]: row for row in json.loads(result.stdout)}


def test_check_rows_carry_the_state_and_the_patch_on_disk_that_status_reports(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    seen = {}
    for label in ("stock", "patched", "patched, disabled"):
        if label == "patched":
            assert patch(capsys, "apply", "--site-packages", str(site))[0] == 0
        env = {**os.environ, "MTP_OVERLAY_DISABLE": FIX} if label.endswith("disabled") else None
        _, status = cli_rows(site, "status", env=env)
        code, check = cli_rows(site, "check", "--only", FIX, env=env)
        seen[label] = (status[FIX], check[FIX], code)
    for label, (status, check, code) in seen.items():
        assert code == 0, label
        assert (check["state"], check["patched"]) == (status["state"], status["patched"]), (label, check, status)
    assert [seen[label][1]["patched"] for label in seen] == [False, True, True]
    assert [seen[label][1]["state"] for label in seen] == ["pending", "pending", "disabled"]
    assert [seen[label][1]["verdict"] for label in seen] == ["needed", "redundant", "redundant"]
