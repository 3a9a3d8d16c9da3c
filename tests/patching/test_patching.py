"""`mtp-overlay patch apply|check|revert` on real megatron-core installs.

Every case works on a private copy of a real release (the venv's pinned release, or 0.16.1 / 0.18.2 unpacked
from their wheels): the `megatron` package and its dist-info in a temporary site folder. Trees are
compared by the sha256 of every file.
"""

import hashlib
import json
import os
import py_compile
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from pins import MEGATRON_CORE

from mtp_overlay import registry
from mtp_overlay.cli import main
from mtp_overlay.contract import distribution_version
from mtp_overlay.patching import engine, transaction
from mtp_overlay.patching.manifest import DEFAULT_PATH, load, state_key, touched_files
from mtp_overlay.patching.survey import sha256
from mtp_overlay.bed.engines.patch_images import measure, patches_for, released_files
from mtp_overlay.bed.runtime.releases import copy_installed, installed_site, record_sha256, release_site, run_with_release

REPO = Path(__file__).resolve().parents[2]
SP_SCATTER = registry.get("mtp-sp-scatter")
WHEELS = REPO / ".cache" / "wheels"
SITES = REPO / ".cache" / "sites"
MODULE = "megatron/core/transformer/multi_token_prediction.py"
SECOND = "megatron/core/utils.py"  # the second file of the two-file test variant
VARIANT_OF = {"0.16.1": "0.16.patch", "0.18.2": "0.18.patch", MEGATRON_CORE: "0.19.patch"}
UPSTREAM_STYLE_FIX = (
    "        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)\n",
    (
        "        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)\n"
        "        if self.config.sequence_parallel and not getattr(embedding, 'scatter_to_sequence_parallel', True):\n"
        "            decoder_input = scatter_to_sequence_parallel_region(decoder_input, group=self.tp_group)\n"
    ),
)


# --- real releases in temporary site folders ------------------------------------------------------
def wheel(version):
    """The release's wheel from .cache/wheels, downloaded there when missing."""
    found = sorted(WHEELS.glob(f"megatron_core-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", str(WHEELS), f"megatron-core=={version}"],
            check=True,
        )
        found = sorted(WHEELS.glob(f"megatron_core-{version}-*.whl"))
    return found[0]


def unpacked(version):
    """A pristine site folder holding only megatron-core ``version`` (unpacked once, then reused)."""
    site = SITES / f"megatron-core-{version}"
    if not (site / ".complete").exists():
        shutil.rmtree(site, ignore_errors=True)
        with zipfile.ZipFile(wheel(version)) as archive:
            tops = ("megatron/", f"megatron_core-{version}.dist-info/")
            members = [name for name in archive.namelist() if name.startswith(tops)]
            archive.extractall(site, members)
        (site / ".complete").touch()
    return site


def site_copy(version, tmp_path):
    destination = tmp_path / f"site-{version}"
    if version == MEGATRON_CORE:  # the venv's own install
        return copy_installed("megatron-core", destination)
    return copy_installed("megatron-core", destination, site=unpacked(version))


def tree(root):
    """{relative path: sha256} of every file under ``root``."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(root).rglob("*"))
        if path.is_file()
    }


def sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def patch(capsys, *args):
    """Run `mtp-overlay patch ARGS --json` in process (mtp-sp-scatter's patch unless ``--only`` says
    otherwise): (exit code, the fix reports)."""
    capsys.readouterr()
    only = [] if "--only" in args else ["--only", "mtp-sp-scatter"]
    code = main(["patch", *args, *only, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else []


def git_apply_check(site, patch_file):
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(site).parent)}
    return subprocess.run(["git", "apply", "--check", str(patch_file)], cwd=site, env=env, capture_output=True)


def measured(version):
    """(patch file name, (released sha256, patched sha256)) of mtp-sp-scatter's file in ``version``."""
    states = load().images["megatron-core"][version][MODULE]
    return f"{SP_SCATTER.family_of(version)}.patch", (states[frozenset()], states[frozenset({SP_SCATTER.name})])


def leftovers(root):
    names = (".orig", ".rej", ".mtp-overlay-tmp", transaction.JOURNAL)
    return [p for p in Path(root).rglob("*") if p.name.endswith(names)]


# --- the manifest ---------------------------------------------------------------------------------
MEASURED = [(distribution, version) for distribution, releases in load().images.items() for version in releases]


@pytest.mark.parametrize(("distribution", "version"), MEASURED)
def test_manifest_is_the_released_files_and_every_combination_of_patches(distribution, version):
    """Every measured release: the files have the sha256 their wheel's RECORD ships, and applying every
    combination of the fixes' patches to them gives exactly the manifest's hashes (in any order)."""
    installed = distribution_version(distribution) == version
    site = installed_site(distribution) if installed else release_site(distribution, version)
    fixes = [registry.get(name) for name in registry.names()]
    patches = patches_for(fixes, distribution, version, DEFAULT_PATH.parent)
    released = released_files(site, patches)
    record = record_sha256(distribution, site)
    assert {file: sha256(data) for file, data in released.items()} == {file: record[file] for file in released}
    images = load().images[distribution][version]
    assert measure(patches, released) == {
        file: {state_key(applied): digest for applied, digest in states.items()} for file, states in images.items()
    }


def test_every_release_family_has_its_patch():
    for name in registry.names():
        fix = registry.get(name)
        for family in fix.families:
            assert load().patch_path(fix, family).is_file()
    assert registry.get("mtp-loss-mask").families == {}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw.update(format=1), "format must be 2"),
        (lambda raw: raw["megatron-core"][MEGATRON_CORE][MODULE].update(released="f00"), "must be a sha256"),
        (lambda raw: raw["megatron-core"][MEGATRON_CORE][MODULE].pop("released"), "has no 'released' sha256"),
        (lambda raw: raw["megatron-core"].update({"0.19": {}}), "non-empty object"),
        (lambda raw: raw["megatron-core"].update({"zero": raw["megatron-core"][MEGATRON_CORE]}), "is not a version"),
        (lambda raw: raw["megatron-core"][MEGATRON_CORE][MODULE].update({"b+a": "0" * 64}), "sorted, joined by '+'"),
    ],
)
def test_malformed_manifest_is_a_usage_error_naming_the_key(edit, message, tmp_path, capsys):
    raw = json.loads(DEFAULT_PATH.read_text())
    edit(raw)
    folder = tmp_path / "patches"
    shutil.copytree(DEFAULT_PATH.parent, folder)
    (folder / "manifest.json").write_text(json.dumps(raw))
    assert main(["patch", "check", "--manifest", str(folder / "manifest.json"), "--site-packages", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert message in error and str(folder / "manifest.json") in error


def test_missing_patch_of_a_declared_family_is_a_usage_error(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    folder = tmp_path / "patches"
    shutil.copytree(DEFAULT_PATH.parent, folder)
    (folder / "mtp-sp-scatter" / "megatron-core" / "0.19.patch").unlink()
    assert main(["patch", "check", "--manifest", str(folder / "manifest.json"), "--site-packages", str(site)]) == 2
    assert "declares release family '0.19'" in capsys.readouterr().err


# --- apply / check / revert on real releases -----------------------------------------------------
@pytest.mark.parametrize("version", [MEGATRON_CORE, "0.16.1", "0.18.2"])
def test_apply_check_revert_round_trip_is_byte_identical(version, tmp_path, capsys):
    site = site_copy(version, tmp_path)
    before = tree(site)
    variant, (pre, post) = measured(version)
    assert variant == VARIANT_OF[version] and before[MODULE] == pre

    code, [row] = patch(capsys, "check", "--site-packages", str(site))
    assert code == 0 and row["state"] == "needed" and row["version"] == version
    code, _ = patch(capsys, "check", "--site-packages", str(site), "--fail-on-needed")
    assert code == 1

    code, [row] = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and (row["action"], row["state"], row["variant"]) == ("patched", "applied", VARIANT_OF[version])
    patched = tree(site)
    assert patched[MODULE] == post
    assert {k for k in before if before[k] != patched.get(k)} == {MODULE} and patched.keys() == before.keys()
    assert "scatter_to_sequence_parallel_region(decoder_input" in (site / MODULE).read_text()

    code, [row] = patch(capsys, "apply", "--site-packages", str(site))  # second apply: a reported no-op
    assert code == 0 and (row["action"], row["state"]) == ("already applied", "applied")
    assert tree(site) == patched

    code, [row] = patch(capsys, "check", "--site-packages", str(site), "--fail-on-needed")
    assert code == 0 and row["state"] == "applied"

    code, [row] = patch(capsys, "revert", "--site-packages", str(site))
    assert code == 0 and (row["action"], row["state"]) == ("reverted", "needed")
    assert tree(site) == before
    code, [row] = patch(capsys, "revert", "--site-packages", str(site))
    assert code == 0 and row["action"] == "not applied" and tree(site) == before
    assert leftovers(site) == []


def test_variant_is_chosen_by_version_not_by_what_applies(tmp_path, capsys):
    """The 0.17 patch applies textually to 0.16.1 but names self.tp_group, which 0.16's layer lacks."""
    site = site_copy("0.16.1", tmp_path)
    assert git_apply_check(site, REPO / "patches/mtp-sp-scatter/megatron-core/0.17.patch").returncode == 0
    code, [row] = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and row["variant"] == "0.16.patch"
    source = (site / MODULE).read_text()
    assert "scatter_to_sequence_parallel_region(decoder_input)\n" in source and "self.tp_group" not in source


def test_dry_run_writes_nothing(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    before = tree(site)
    code, [row] = patch(capsys, "apply", "--site-packages", str(site), "--dry-run")
    assert code == 0 and (row["action"], row["state"]) == ("would patch", "needed")
    assert tree(site) == before


def test_apply_removes_stale_bytecode_of_touched_files_only(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    touched, other = site / MODULE, site / SECOND
    # an unchecked-hash pyc is never revalidated against its source: left behind, it would run the old code
    stale = py_compile.compile(str(touched), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    kept = py_compile.compile(str(other))
    code, [row] = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and row["action"] == "patched"
    assert not Path(stale).exists() and Path(kept).exists()


@pytest.mark.parametrize("version", [MEGATRON_CORE, "0.16.1", "0.18.2"])
def test_tampered_pre_image_is_refused_naming_file_and_hashes(version, tmp_path, capsys):
    site = site_copy(version, tmp_path)
    with open(site / MODULE, "a") as handle:
        handle.write("# a local edit\n")
    _, (pre, _) = measured(version)
    found = sha(site / MODULE)
    # the hunk still fits textually: only the hash check stands between this tree and a silent patch
    assert git_apply_check(site, REPO / "patches/mtp-sp-scatter/megatron-core" / VARIANT_OF[version]).returncode == 0
    before = tree(site)

    capsys.readouterr()
    assert main(["patch", "apply", "--site-packages", str(site)]) == 1
    text = capsys.readouterr().out
    assert f"{site / MODULE}: expected sha256 {pre}" in text and f"found {found}" in text and "refused" in text
    assert tree(site) == before
    code, [row] = patch(capsys, "check", "--site-packages", str(site))
    assert code == 1 and row["state"] == "mismatch"
    code, [row] = patch(capsys, "revert", "--site-packages", str(site))
    assert code == 1 and row["action"] == "refused" and tree(site) == before
    assert leftovers(site) == []


def test_patched_file_edited_afterwards_counts_as_applied_but_is_not_reverted_blindly(tmp_path, capsys):
    """Already applied = the reverse patch applies; reverting needs the manifest's post-image exactly."""
    site = site_copy(MEGATRON_CORE, tmp_path)
    assert patch(capsys, "apply", "--site-packages", str(site))[0] == 0
    with open(site / MODULE, "a") as handle:
        handle.write("# a local edit after patching\n")
    before = tree(site)
    code, [row] = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and (row["state"], row["action"]) == ("applied", "already applied")
    assert "reverse patch applies" in row["reason"]
    code, [row] = patch(capsys, "revert", "--site-packages", str(site))
    assert code == 1 and row["action"] == "failed" and "byte-exactly" in row["reason"]
    assert tree(site) == before


# --- redundancy ------------------------------------------------------------------------------------
def set_version(site, version):
    metadata = next(Path(site).glob("megatron_core-*.dist-info")) / "METADATA"
    text = metadata.read_text()
    metadata.write_text(text.replace(f"\nVersion: {MEGATRON_CORE}\n", f"\nVersion: {version}\n", 1))


def carry_upstream_fix(site):
    path = Path(site) / MODULE
    old, new = UPSTREAM_STYLE_FIX
    source = path.read_text()
    assert source.count(old) == 1
    path.write_text(source.replace(old, new))


def test_release_past_every_variant_with_the_behaviour_is_redundant_and_skipped(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    set_version(site, "0.20.0")
    carry_upstream_fix(site)
    before = tree(site)
    code, [row] = patch(capsys, "check", "--site-packages", str(site))
    assert code == 0 and row["state"] == "redundant"
    assert "already calls scatter_to_sequence_parallel_region" in row["reason"]
    code, [row] = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and row["action"] == "skipped" and tree(site) == before
    code, [row] = patch(capsys, "apply", "--site-packages", str(site), "--fail-on-redundant")
    assert code == 1 and row["state"] == "redundant" and tree(site) == before


def test_release_past_every_variant_without_the_behaviour_is_refused(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    set_version(site, "0.20.0")
    before = tree(site)
    code, [row] = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 1 and row["state"] == "mismatch" and "megatron-core 0.20.0 fits no release family" in row["reason"]
    assert tree(site) == before


def test_unmeasured_release_in_range_that_already_scatters_is_redundant(tmp_path, capsys):
    """A later 0.19.x (no hashes measured) carrying the upstream fix: its marker says redundant. In a
    measured release the same bytes are a local edit (tests/reliability)."""
    site = site_copy(MEGATRON_CORE, tmp_path)
    set_version(site, "0.19.9")
    carry_upstream_fix(site)
    before = tree(site)
    code, [row] = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0 and (row["state"], row["action"]) == ("redundant", "skipped") and tree(site) == before


# --- test-only patches: several files, several fixes, all-or-nothing ------------------------------
def only(fixes):
    return [option for fix in fixes for option in ("--only", fix.name)]


@pytest.mark.slow
def test_fault_at_every_file_boundary_leaves_the_tree_byte_identical(site_0_19, test_fixes, capsys, monkeypatch):
    site = site_0_19
    manifest, fixes = test_fixes({"two-files": (MODULE, SECOND)})
    pycs = [Path(py_compile.compile(str(site / file))) for file in (MODULE, SECOND)]
    before = tree(site)
    journal = site / transaction.JOURNAL
    writes = 5  # the journal, then two sources and each one's stale bytecode: MODULE, its pyc, SECOND, its pyc
    real_put = transaction._put

    for boundary in range(writes):
        for fault in ("raise", "torn write", "interrupt"):
            calls = []

            def faulty_put(path, data, boundary=boundary, fault=fault, calls=calls):
                calls.append(path)
                if len(calls) - 1 == boundary:
                    if fault == "raise":
                        raise OSError(28, "No space left on device (injected)")
                    if fault == "interrupt":
                        raise KeyboardInterrupt
                    return real_put(path, b"torn")
                return real_put(path, data)

            monkeypatch.setattr(transaction, "_put", faulty_put)
            if fault == "interrupt":
                with pytest.raises(KeyboardInterrupt):
                    engine.run("apply", fixes, load(manifest), [site])
            else:
                code, [row] = patch(capsys, "apply", "--site-packages", str(site), "--manifest", str(manifest),
                                    *only(fixes))
                assert code == 1 and row["action"] == "failed" and "every file put back" in row["reason"]
            assert len(calls) > boundary, (boundary, fault)
            assert tree(site) == before, (boundary, fault)
            assert leftovers(site) == []

    written = []
    monkeypatch.setattr(transaction, "_put", lambda path, data: (written.append(path), real_put(path, data)))
    code, [row] = patch(capsys, "apply", "--site-packages", str(site), "--manifest", str(manifest), *only(fixes))
    assert code == 0 and row["action"] == "patched" and not any(p.exists() for p in pycs)
    assert written == [journal, site / MODULE, pycs[0], site / SECOND, pycs[1]]  # the boundaries faulted above
    code, [row] = patch(capsys, "revert", "--site-packages", str(site), "--manifest", str(manifest), *only(fixes))
    assert code == 0 and tree(site) == {k: v for k, v in before.items() if site / k not in pycs}


def test_half_applied_tree_is_a_mismatch_and_left_alone(site_0_19, test_fixes, tmp_path, capsys):
    site = site_0_19
    manifest, fixes = test_fixes({"two-files": (MODULE, SECOND)})
    patched = tmp_path / "patched"
    shutil.copytree(site, patched)
    code, _ = patch(capsys, "apply", "--site-packages", str(patched), "--manifest", str(manifest), *only(fixes))
    assert code == 0
    shutil.copy(patched / MODULE, site / MODULE)  # what a non-atomic tool leaves after a crash
    before = tree(site)
    for action in ("check", "apply", "revert"):
        code, [row] = patch(capsys, action, "--site-packages", str(site), "--manifest", str(manifest), *only(fixes))
        assert code == 1 and row["state"] == "mismatch" and "half-applied" in row["reason"], action
        assert tree(site) == before


def test_one_refused_fix_blocks_every_fix(site_0_19, test_fixes, capsys):
    site = site_0_19
    manifest, fixes = test_fixes({"first": (MODULE,), "second": (SECOND,)})
    with open(site / SECOND, "a") as handle:
        handle.write("# a local edit\n")
    before = tree(site)
    code, rows = patch(capsys, "apply", "--site-packages", str(site), "--manifest", str(manifest), *only(fixes))
    assert code == 1
    assert {row["fix"]: (row["state"], row["action"]) for row in rows} == {
        "second": ("mismatch", "refused"),
        "first": ("needed", "refused"),
    }
    assert "all-or-nothing" in next(row["reason"] for row in rows if row["fix"] == "first")
    assert tree(site) == before


def test_fixes_sharing_a_file_apply_and_revert_in_any_order(site_0_19, test_fixes, capsys):
    """Two fixes patch one file: each applies alone or on top of the other, and each reverts alone."""
    site = site_0_19
    manifest, (first, second) = test_fixes({"first": (MODULE,), "second": (MODULE, SECOND)})
    before = tree(site)
    run = lambda action, *fixes: patch(capsys, action, "--site-packages", str(site), "--manifest", str(manifest),
                                       *only(fixes))
    code, [row] = run("apply", second)
    assert code == 0 and row["action"] == "patched"
    code, [row] = run("check", first)
    assert code == 0 and row["state"] == "needed"
    code, [row] = run("apply", first)
    assert code == 0 and row["action"] == "patched"
    both = tree(site)
    code, [row] = run("revert", second)
    assert code == 0 and row["action"] == "reverted"
    code, rows = run("check", first, second)
    assert [row["state"] for row in rows] == ["applied", "needed"]
    code, rows = run("apply", first, second)  # the other order, in one transaction
    assert code == 0 and tree(site) == both
    code, rows = run("revert", first, second)
    assert code == 0 and tree(site) == before


# --- finding the environment --------------------------------------------------------------------
def test_python_option_patches_that_interpreters_site_packages(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    shutil.rmtree(purelib)
    shutil.copytree(site, purelib)
    code, [row] = patch(capsys, "apply", "--python", str(venv / "bin" / "python"))
    assert code == 0 and row["action"] == "patched" and Path(row["site_packages"]) == Path(purelib).resolve()
    assert sha(Path(purelib) / MODULE) == measured(MEGATRON_CORE)[1][1]


def test_bad_arguments_are_usage_errors(tmp_path, capsys):
    assert main(["patch", "check", "--site-packages", str(tmp_path / "missing")]) == 2
    assert "--site-packages" in capsys.readouterr().err
    assert main(["patch", "check", "--python", str(tmp_path / "no-python")]) == 2
    assert "--python" in capsys.readouterr().err
    assert main(["patch", "check", "--only", "no-such-fix"]) == 2
    assert "mtp-sp-scatter" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["patch", "check", "--site-packages", str(tmp_path), "--python", sys.executable])
    assert exit_info.value.code == 2


def test_absent_distribution_is_reported_not_failed(tmp_path, capsys):
    code, [row] = patch(capsys, "apply", "--site-packages", str(tmp_path))
    assert code == 0 and (row["state"], row["action"]) == ("absent", "skipped")


# --- the patched release at run time ------------------------------------------------------------
REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
from mtp_overlay.patching.survey import patched_on_disk
import megatron.core.transformer.multi_token_prediction as m
row = mtp_overlay.status(only=["mtp-sp-scatter"], patched=patched_on_disk)[0]
method = vars(m.MultiTokenPredictionLayer)["_get_embeddings"]
print(json.dumps({"file": m.__file__, "state": row.state, "patched": row.patched,
                  "wrapped": type(method).__name__ == "FunctionWrapper",
                  "scatters": "scatter_to_sequence_parallel_region" in method.__code__.co_names}))
"""


def imported(site, **env):
    result = run_with_release(site, REPORT, env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_patched_release_imports_and_the_runtime_hook_stands_down(tmp_path, capsys):
    site = site_copy(MEGATRON_CORE, tmp_path)
    stock = imported(site)
    assert stock["file"].startswith(str(site)) and stock["state"] == "installed" and stock["wrapped"]
    assert stock["patched"] is False

    code, _ = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0
    off = imported(site, MTP_OVERLAY_DISABLE="mtp-sp-scatter")
    assert off["file"].startswith(str(site)) and off["state"] == "disabled"
    assert off["scatters"] and not off["wrapped"] and off["patched"] is True
    on = imported(site)
    assert on["state"] == "redundant" and not on["wrapped"] and on["patched"] is True  # never scatters twice


TP2_SP_FORWARD = """
import json
from mtp_overlay.bed.runtime.launcher import run_ranks


def forward():
    import megatron.core.transformer.multi_token_prediction as m
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt, make_batch, train_step

    model = build_tiny_gpt(sequence_parallel=True, scatter_embedding_sequence_parallel=False)
    return {"file": m.__file__, "mtp_loss": train_step(model, make_batch()).mtp_loss}


if __name__ == "__main__":
    results = run_ranks(forward, 2, tp=2, fixes=[], timeout=240)
    print(json.dumps([{"value": r.value, "error": r.error} for r in results]))
"""


@pytest.mark.slow
def test_patched_release_runs_tp2_sp_forward_with_the_hook_off(tmp_path, capsys):
    """Stock megatron-core (the pin) with scatter_embedding_sequence_parallel=False fails at TP2+SP; patched on disk it runs."""
    site = site_copy(MEGATRON_CORE, tmp_path)
    script = tmp_path / "tp2_sp_forward.py"
    script.write_text(TP2_SP_FORWARD)

    def ranks():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    stock = ranks()
    assert all(r["error"] and "Sizes of tensors must match" in r["error"] for r in stock), stock

    code, _ = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 0
    patched = ranks()
    assert all(r["error"] is None for r in patched), patched
    assert all(r["value"]["file"].startswith(str(site)) for r in patched)
    losses = [r["value"]["mtp_loss"] for r in patched]
    assert losses[0] == pytest.approx(losses[1]) and losses[0] > 0


@pytest.mark.slow
def test_container_build_script_patches_and_fails_the_build_on_a_mismatch(tmp_path):
    """scripts/container_build.sh in a fresh venv: the patch lands on disk; a misfit fails the build."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.run([python, "-c", ask], capture_output=True, text=True, check=True).stdout.strip())
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel(MEGATRON_CORE))], check=True)
    # the rest of the pinned stack is this venv's, seen through a .pth: the script's pip finds it satisfied
    (purelib / "pinned-stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _, (pre, _) = measured(MEGATRON_CORE)

    # pip builds mtp-overlay in its source tree: build from a copy, as a Dockerfile's COPY would
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(REPO, source, ignore=skip)

    def build():
        return subprocess.run(
            ["bash", str(source / "scripts" / "container_build.sh")],
            env={**os.environ, "PYTHON": str(python)}, capture_output=True, text=True, timeout=900,
        )

    first = build()
    assert first.returncode == 0, first.stdout + first.stderr
    manifest = load()
    every = frozenset(  # the megatron-core fixes whose patch for the pinned release edits MODULE
        name for name in registry.names()
        if (fix := registry.get(name)).distribution == "megatron-core" and (family := fix.family_of(MEGATRON_CORE))
        and MODULE in touched_files(manifest.patch_path(fix, family))
    )
    assert every >= {"mtp-sp-scatter", "mtp-packed-roll", "mtp-cp-loss-scale"}  # all of them share this file
    assert sha(purelib / MODULE) == manifest.images["megatron-core"][MEGATRON_CORE][MODULE][every]
    assert "patched -> applied" in first.stdout
    # the installed package carries the startup hook's .pth as package data
    hook = subprocess.run([python, "-m", "mtp_overlay.cli", "startup-hook", "install"], capture_output=True, text=True)
    assert hook.returncode == 0 and (purelib / "mtp_overlay_startup.pth").read_text() == (
        REPO / "hooks" / "mtp_overlay_startup.pth"
    ).read_text()

    with zipfile.ZipFile(wheel(MEGATRON_CORE)) as archive:
        (purelib / MODULE).write_bytes(archive.read(MODULE) + b"# a local edit\n")
    broken = build()
    assert broken.returncode == 1 and f"{purelib.resolve() / MODULE}: expected sha256 {pre}" in broken.stdout
