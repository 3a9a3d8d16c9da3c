"""`mtp-overlay patch` in a hostile environment: it never reports a state that is not on disk.

Parallel image builds on one site-packages, a build killed between two writes, a relative manifest,
no git, a file edited after patching, a wrong --site-packages, a symlinked module, a closed pipe.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_patching import MODULE, SECOND, leftovers, measured, only, patch, sha, site_copy, tree
from pins import MEGATRON_CORE, VLLM

from mtp_overlay.patching import transaction
from mtp_overlay.patching.manifest import load
from mtp_overlay.bed.runtime.releases import installed_site, link_installed

CLI = [sys.executable, "-m", "mtp_overlay.cli"]


def test_parallel_applies_on_one_site_serialize_and_every_process_reports_the_truth(tmp_path):
    """Four builds apply at once, three rounds: the file ends patched, exactly one process patched it,
    the others say it was already applied, none exits 0 over a file left at its pre-image."""
    site = site_copy(MEGATRON_CORE, tmp_path)
    _, (pre, post) = measured(MEGATRON_CORE)
    command = CLI + ["patch", "apply", "--site-packages", str(site), "--only", "mtp-sp-scatter", "--json"]
    for _ in range(3):
        runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
        rows = []
        for run in runs:
            out, err = run.communicate(timeout=300)
            assert run.returncode == 0, err
            rows += json.loads(out)
        assert sha(site / MODULE) == post
        assert sorted(row["action"] for row in rows) == ["already applied"] * 3 + ["patched"]
        assert leftovers(site) == []
        assert subprocess.run(CLI + ["patch", "revert", "--site-packages", str(site), "--only", "mtp-sp-scatter"],
                              capture_output=True).returncode == 0
        assert sha(site / MODULE) == pre


KILLED_BETWEEN_WRITES = """
import os, sys
from mtp_overlay.contract import Declaration, Provenance
from mtp_overlay.patching import engine, transaction
from mtp_overlay.patching.manifest import load

fix = Declaration("two-files", summary="test-only", symptom="test-only", distribution="megatron-core",
                  targets={"mtp": "megatron.core.transformer.multi_token_prediction"},
                  families={"0.19": ">=0.19,<0.20"}, provenance=Provenance("tests"))
real_put, calls = transaction._put, []

def put_then_die(path, data):
    real_put(path, data)
    calls.append(path)
    if len(calls) == 2:  # the journal, then the first file: the process dies before the second
        os._exit(9)

transaction._put = put_then_die
engine.run("apply", [fix], load(sys.argv[1]), [sys.argv[2]])
"""


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_build_killed_between_two_writes_is_recovered_by_the_next_run(site_0_19, test_fixes, capsys, command):
    manifest, fixes = test_fixes({"two-files": (MODULE, SECOND)})
    before = tree(site_0_19)
    killed = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_WRITES, str(manifest), str(site_0_19)],
                            capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr
    assert (site_0_19 / transaction.JOURNAL).exists() and sha(site_0_19 / MODULE) != before[MODULE]  # half-applied
    code, [row] = patch(capsys, command, "--site-packages", str(site_0_19), "--manifest", str(manifest), *only(fixes))
    assert code == 0, row
    if command == "revert":  # the interrupted write is undone, nothing to revert
        assert row["action"] == "not applied" and tree(site_0_19) == before
    else:
        assert row["action"] == "patched" and row["state"] == "applied"
    assert not (site_0_19 / transaction.JOURNAL).exists()


def test_a_relative_manifest_path_works(site_0_19, tmp_path):
    relative = os.path.relpath(Path(__file__).resolve().parents[2] / "patches" / "manifest.json", tmp_path)
    result = subprocess.run(CLI + ["patch", "check", "--site-packages", str(site_0_19), "--only", "mtp-sp-scatter",
                                   "--manifest", relative], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "needed" in result.stdout, result.stdout + result.stderr


def test_no_git_is_said_as_such_not_as_a_mismatch(site_0_19, tmp_path):
    bare = tmp_path / "bin"  # a PATH with python but no git
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bare)}
    result = subprocess.run(CLI + ["patch", "check", "--site-packages", str(site_0_19), "--only", "mtp-sp-scatter"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "git not found on PATH" in result.stderr
    assert "mismatch" not in result.stdout


def test_revert_after_an_edit_inside_the_patched_hunk_is_a_mismatch_not_redundant(site_0_19, capsys):
    assert patch(capsys, "apply", "--site-packages", str(site_0_19))[0] == 0
    path = site_0_19 / MODULE
    source = path.read_text()
    assert source.count("scatter_to_sequence_parallel_region(decoder_input") == 1
    path.write_text(source.replace("scatter_to_sequence_parallel_region(decoder_input",
                                   "scatter_to_sequence_parallel_region(  decoder_input"))
    before = tree(site_0_19)
    code, [row] = patch(capsys, "revert", "--site-packages", str(site_0_19))
    assert code == 1 and row["state"] == "mismatch" and "edited since" in row["reason"]
    assert tree(site_0_19) == before


def test_fail_on_needed_fails_where_no_patched_distribution_is_installed(tmp_path, capsys):
    code, rows = patch(capsys, "check", "--site-packages", str(tmp_path), "--fail-on-needed")
    assert code == 1 and {row["state"] for row in rows} == {"absent"}


def test_a_symlinked_module_stays_a_symlink_and_gets_its_bytes_back(site_0_19, tmp_path, capsys):
    real = tmp_path / "elsewhere" / "multi_token_prediction.py"
    real.parent.mkdir()
    link = site_0_19 / MODULE
    real.write_bytes(link.read_bytes())
    link.unlink()
    link.symlink_to(real)
    _, (pre, post) = measured(MEGATRON_CORE)
    assert patch(capsys, "apply", "--site-packages", str(site_0_19))[0] == 0
    assert link.is_symlink() and sha(real) == post
    assert patch(capsys, "revert", "--site-packages", str(site_0_19))[0] == 0
    assert link.is_symlink() and sha(real) == pre
    assert leftovers(site_0_19) == [] and leftovers(real.parent) == []


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`mtp-overlay status | head`: the pipe closes before the CLI writes."""
    reader = subprocess.Popen(CLI + ["status"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.close()
    _, err = reader.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()


@pytest.mark.slow
def test_an_edit_inside_one_hunk_of_a_seven_file_patch_names_that_file_and_the_rest_as_patched(tmp_path, capsys):
    """vllm-chat-template's patch (7 files) applied to a private vLLM, then one line inside one applied
    hunk edited: check, revert and apply each name that file as edited (with the patched sha256 it
    should have) and the other six as patched, never "half-applied", and write nothing; undo the edit
    and revert is byte-exact again."""
    fix = "vllm-chat-template"
    site = link_installed("vllm", tmp_path / "site")
    assert patch(capsys, "apply", "--site-packages", str(site), "--only", fix)[0] == 0
    edited = "vllm/entrypoints/serve/tokenize/serving.py"
    source = (site / edited).read_text()
    assert source.count("SERVER_CHAT_TEMPLATES.commit(\n") == 1  # a line the patch added
    (site / edited).unlink()  # a new file: the link to the venv's copy is never written through
    (site / edited).write_text(source.replace("SERVER_CHAT_TEMPLATES.commit(\n", "SERVER_CHAT_TEMPLATES.commit(  # local\n"))
    before = tree(site)
    images = load().images["vllm"][VLLM]  # {file: {applied fix ids: sha256}}
    for action in ("check", "revert", "apply"):
        code, [row] = patch(capsys, action, "--site-packages", str(site), "--only", fix)
        assert code == 1 and row["state"] == "mismatch", (action, row)
        assert row["action"] == (None if action == "check" else "refused"), action
        states = {entry["path"]: entry["state"] for entry in row["files"]}
        assert states.pop(edited) == "edited" and set(states.values()) == {"patched"} and len(states) == 6
        assert "half-applied" not in row["reason"]
        assert (f"{site / edited}: expected sha256 {images[edited][frozenset({fix})]} (vllm {row['version']} with this "
                f"patch, as the other files carry it), found {sha(site / edited)} (edited since the patch)") in row["reason"]
        assert "the other 6 file(s) carry the patch, as measured" in row["reason"]
        assert tree(site) == before, action
    (site / edited).write_text(source)  # the edit undone
    code, [row] = patch(capsys, "revert", "--site-packages", str(site), "--only", fix)
    assert (code, row["action"], row["state"]) == (0, "reverted", "needed")
    assert {entry["state"] for entry in row["files"]} == {"unpatched"}
    venv = installed_site("vllm")
    assert all(sha(site / entry["path"]) == sha(venv / entry["path"]) == images[entry["path"]][frozenset()]
               for entry in row["files"])

