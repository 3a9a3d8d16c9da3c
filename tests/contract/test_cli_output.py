"""The real `mtp-overlay` command line in a subprocess, read by a reader that leaves early.

`mtp-overlay status --json | true` (or `| head`): the pipe closes before the command writes. Exit 1 is the
code for what a command finds (drift, a mismatch), so a reader that leaves is no failure: exit 0, no
traceback, no "Exception ignored" at interpreter exit. Both ways the bytes meet the closed pipe: at the
final flush (stdout block-buffered, the default on a pipe) and at the first write (``PYTHONUNBUFFERED``).
"""

import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "mtp_overlay.cli"]
COMMANDS = {  # name -> (arguments, exit code); check of the fix with the lightest target (ray's, 1 s)
    "status": (["status", "--json"], 0),
    "status table": (["status"], 0),
    "check": (["check", "--json", "--only", "hf-modules-cache"], 0),
    "patch check": (["patch", "check", "--json"], 0),
    # what the command finds still decides: the venv's releases are unpatched, needed
    "patch check --fail-on-needed": (["patch", "check", "--fail-on-needed"], 1),
}


@pytest.mark.parametrize("buffering", ["buffered", "unbuffered"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_reader_that_leaves_early_is_no_failure(command, buffering):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    if buffering == "unbuffered":
        env["PYTHONUNBUFFERED"] = "1"
    arguments, code = COMMANDS[command]
    full = subprocess.run(CLI + arguments, capture_output=True, text=True, env=env, timeout=300)
    assert full.returncode == code and full.stdout, full.stderr[-2000:]  # what the reader would have got
    reader = subprocess.Popen(CLI + arguments, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    reader.stdout.close()  # the reader leaves before the first byte
    _, err = reader.communicate(timeout=300)
    err = err.decode()
    assert reader.returncode == code, err[-2000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err[-2000:]




def test_check_prints_the_table_alone_on_stdout_and_each_target_module_under_its_fix_with_v():
    """stdout is the table alone (upstream's import noise goes to stderr): one line per fix, its reason
    once; ``-v`` adds one line per target module under it."""
    result = subprocess.run(CLI + ["check", "-v", "--only", "hf-modules-cache"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    header, row, module = result.stdout.splitlines()
    assert header.split() == ["NAME", "DISTRIBUTION", "VERSION", "VERDICT", "PROBED", "PATCHED", "REASON"]
    assert row.split()[:2] + row.split()[3:5] == ["hf-modules-cache", "ray", "needed", "imported"]
    assert module == f"    ray: needed (imported): {row.split('ray: ', 1)[1]}"
