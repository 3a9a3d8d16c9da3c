"""Upstream tracking on real upstream copies: the committed support matrix is current for
the default pins, a fix that upstream absorbed or that stopped fitting fails CI loudly, and a stock
path the test bed cannot run is its own one-line outcome."""

import re
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version
from pins import MEGATRON_CORE

from mtp_overlay import declarations, registry
from mtp_overlay.contract import distribution_version
from mtp_overlay.bed.models.bridge import import_stand_ins
from mtp_overlay.bed.runtime.releases import (
    bridge_main_site,
    copy_installed,
    megatron_main_site,
    run_with_release,
    snapshot_of,
)

ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "mtp-sp-scatter" / "megatron-core" / "0.19.patch"
ROW = re.compile(r"^\| (?P<name>[\w-]+) \| (?P<dist>[\w.-]+) \| (?P<version>[\w.]+) \| \*\*(?P<state>\w+)\*\* \|")
MAIN_ROW = re.compile(r"^\| [\w-]+ \| megatron-core \| Megatron-LM main @ [0-9a-f]{7,40} \(\d{4}-\d\d-\d\d\) \| \*\*\w+\*\* \|")


def committed_matrix():
    rows = (ROW.match(line) for line in (ROOT / "docs" / "SUPPORT.md").read_text().splitlines())
    return {(m["name"], m["version"]): m["state"] for m in rows if m}


def test_committed_support_matrix_is_current_for_the_default_pins():
    table = committed_matrix()
    with import_stand_ins():  # as scripts/support_matrix.py measures: Bridge's targets through the test bed
        rows = registry.check()
    for row in rows:
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


@pytest.mark.slow
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


def tracking_tests(site, cwd, fix):
    """``pytest --pyargs mtp_overlay.upstream_tests`` for ``fix`` with ``site`` first on the path."""
    arguments = ["--pyargs", "mtp_overlay.upstream_tests", "-k", fix, "-q", "-p", "no:cacheprovider"]
    return run_with_release(site, f"import sys, pytest; sys.exit(pytest.main({arguments!r}))", cwd=cwd, timeout=900)


@pytest.mark.slow
def test_tracking_test_names_the_absorbed_fix_and_what_to_do(fixed_upstream, tmp_path):
    result = tracking_tests(fixed_upstream, tmp_path, "mtp-sp-scatter")
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"mtp-sp-scatter is REDUNDANT on megatron-core {MEGATRON_CORE}" in result.stdout
    assert "Applied-Upstream" in result.stdout and "first_fixed_release" in result.stdout


@pytest.mark.slow
def test_tracking_test_says_when_the_test_bed_cannot_run_the_stock_path(tmp_path):
    """Megatron-LM main (d98e8a64) without Transformer Engine: building an MTP layer runs an isinstance
    against a MagicMock (`cpu_shims._is_inference_column_parallel_linear`). The same failure, put into
    a copy of the installed release, must read as the test bed's problem: one line, no traceback."""
    site = copy_installed("megatron-core", tmp_path / "site")
    module = site / "megatron" / "core" / "transformer" / "multi_token_prediction.py"
    text = module.read_text()
    anchor = "        self.eh_proj = build_module("
    assert text.count(anchor) == 1
    line = text[: text.index(anchor)].count("\n") + 1
    module.write_text(text.replace(anchor, '        isinstance(self, __import__("unittest.mock").mock.MagicMock())\n' + anchor))
    result = tracking_tests(site, tmp_path, "mtp-sp-scatter")
    assert result.returncode == 1, result.stdout[-3000:]
    expected = (
        f"mtp-sp-scatter: could not run the stock path on megatron-core {MEGATRON_CORE}: TypeError: isinstance() arg 2 must "
        "be a type, a tuple of types, or a union when instantiating MultiTokenPredictionLayer "
        f"(at megatron/core/transformer/multi_token_prediction.py:{line}); the test bed needs updating"
    )
    report = result.stdout.split("= FAILURES =", 1)[-1].split("short test summary", 1)[0]
    assert expected in report, result.stdout[-3000:]
    for noise in ("Traceback", "During handling", "RanksFailed", "rank 0", "rank 1"):
        assert noise not in report, f"{noise!r} in the report:\n{report}"


def make_source_repository(root, package, minor, pre_release=""):
    """A one-commit git repository holding ``package`` (a folder path under ``root``) with a
    package_info.py of version 0.<minor>.0<pre_release>, and a README outside it."""
    folder = root / package
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("from .package_info import __version__\n")
    (folder / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\nPRE_RELEASE = '{pre_release}'\n"
                                            f"__version__ = '0.{minor}.0{pre_release}'\n")
    (root / "README.md").write_text("not part of the package\n")

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "snapshot")
    return root / ".git", git("rev-parse", "HEAD")


def make_megatron_lm(root):
    """A git repository shaped like Megatron-LM: megatron/core at 0.99.0rc0."""
    return make_source_repository(root, "megatron/core", 99, "rc0")


def test_megatron_main_snapshot_imports_with_a_version_no_release_can_have(tmp_path):
    git_dir, commit = make_megatron_lm(tmp_path / "Megatron-LM")
    site = megatron_main_site(git_dir, tmp_path / "snapshots")
    facts = snapshot_of(site)
    assert facts["commit"] == commit and commit.startswith(facts["short"]) and site.name == facts["short"]
    assert facts["version"] == f"0.99.0rc0+{facts['short']}"
    assert not (site / "README.md").exists() and megatron_main_site(git_dir, tmp_path / "snapshots") == site
    code = ("import importlib.metadata as m, megatron.core as c; "
            "print(m.version('megatron-core'), c.__version__, c.__file__)")
    version, package_version, where = run_with_release(site, code).stdout.split()
    assert version == facts["version"] and package_version == "0.99.0rc0" and where.startswith(str(site))
    assert Version(version).local == facts["short"]  # a local version: never on an index, never a pin
    with pytest.raises(ValueError, match="git_dir: .* has no commit 'nope'"):
        megatron_main_site(git_dir, tmp_path / "snapshots", commit="nope")


def test_megatron_main_rows_are_never_read_as_rows_of_a_pinned_release():
    lines = (ROOT / "docs" / "SUPPORT.md").read_text().splitlines()
    main_rows = [line for line in lines if "Megatron-LM main @" in line and line.startswith("| ")]
    assert all(MAIN_ROW.match(line) and not ROW.match(line) for line in main_rows), main_rows


@pytest.fixture
def support_matrix(monkeypatch, tmp_path):
    """scripts/support_matrix.py writing to a copy of docs/SUPPORT.md, its releases measured by ``measured``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("support_matrix", ROOT / "scripts" / "support_matrix.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    support = tmp_path / "SUPPORT.md"
    support.write_text((ROOT / "docs" / "SUPPORT.md").read_text())
    monkeypatch.setattr(script, "SUPPORT", support)
    monkeypatch.setattr(script, "RELEASES", {"megatron-core": [MEGATRON_CORE]})
    monkeypatch.setattr(script, "fixes_by_distribution", lambda: {"megatron-core": ["mtp-sp-scatter", "mtp-loss-mask"]})
    monkeypatch.setattr(script, "release_site", lambda distribution, version: f"site-{version}")
    return script


def measured(version, reason="r"):
    def measure(distribution, site, names=None):
        return [dict(name=name, distribution="megatron-core", version=version(site), verdict="needed",
                     reason=reason, run="needed: e") for name in names or ("mtp-sp-scatter", "mtp-loss-mask")]
    return measure


def test_support_matrix_adds_main_rows_from_a_snapshot_and_keeps_them_without_one(support_matrix, monkeypatch, tmp_path):
    git_dir, _ = make_megatron_lm(tmp_path / "Megatron-LM")
    site = megatron_main_site(git_dir, tmp_path / "snapshots")
    facts = snapshot_of(site)
    monkeypatch.setattr(support_matrix, "measure", measured(lambda s: facts["version"] if s == site else MEGATRON_CORE))
    support_matrix.main(["--megatron-main", str(site)])
    label = f"Megatron-LM main @ {facts['short']} ({facts['date']})"
    rows = [line for line in support_matrix.SUPPORT.read_text().splitlines() if line.startswith("| mtp-")]
    assert [line.split(" | ")[2] for line in rows] == [MEGATRON_CORE, label, MEGATRON_CORE, label]
    assert all(MAIN_ROW.match(line) for line in rows[1::2]) and not any(ROW.match(line) for line in rows[1::2])

    monkeypatch.setattr(support_matrix, "measure", measured(lambda s: MEGATRON_CORE))
    support_matrix.main([])  # no snapshot: the main rows stay, each after its fix's releases
    assert [line for line in support_matrix.SUPPORT.read_text().splitlines() if line.startswith("| mtp-")] == rows

    with pytest.raises(SystemExit, match="--megatron-main: .* is neither a Megatron-LM git directory nor a snapshot"):
        support_matrix.main(["--megatron-main", str(tmp_path)])


def test_support_matrix_measures_only_the_fixes_asked_for_and_keeps_the_rest(support_matrix, monkeypatch):
    monkeypatch.setattr(support_matrix, "measure", measured(lambda s: MEGATRON_CORE))
    support_matrix.main([])
    before = support_matrix.SUPPORT.read_text().splitlines()
    monkeypatch.setattr(support_matrix, "measure", measured(lambda s: MEGATRON_CORE, reason="again"))
    support_matrix.main(["--only", "mtp-loss-mask"])
    after = support_matrix.SUPPORT.read_text().splitlines()
    rows = [line for line in after if line.startswith("| mtp-")]
    assert [line for line in rows if line.startswith("| mtp-sp-scatter ")] == [
        line for line in before if line.startswith("| mtp-sp-scatter ")]  # kept byte for byte
    remeasured = [line for line in rows if line.startswith("| mtp-loss-mask ") and not MAIN_ROW.match(line)]
    assert remeasured and all(" | again | " in line for line in remeasured)  # its main row kept: no snapshot
    names = [line.split(" | ")[0][2:] for line in rows]
    assert names == sorted(names, key=declarations.names().index)  # every fix's rows, in the declarations' order


def make_megatron_bridge(root):
    """A git repository shaped like Megatron-Bridge: src/megatron/bridge at 0.98.0."""
    return make_source_repository(root, "src/megatron/bridge", 98)


def test_bridge_main_snapshot_imports_as_megatron_bridge_with_a_local_version(tmp_path):
    git_dir, commit = make_megatron_bridge(tmp_path / "Megatron-Bridge")
    site = bridge_main_site(git_dir, tmp_path / "snapshots")
    facts = snapshot_of(site)
    assert facts["commit"] == commit and facts["version"] == f"0.98.0+{facts['short']}"
    assert sorted(path.name for path in site.iterdir()) == [
        "SNAPSHOT.json", "megatron", f"megatron_bridge-{facts['version']}.dist-info"]
    code = ("import importlib.metadata as m, megatron.bridge as b, megatron.core as c; "
            "print(m.version('megatron-bridge'), b.__version__, b.__file__, c.__file__)")
    version, package_version, where, core = run_with_release(site, code).stdout.split()
    assert version == facts["version"] and package_version == "0.98.0" and where.startswith(str(site))
    assert not core.startswith(str(site))  # megatron-core stays the venv's


def test_support_matrix_measures_one_distribution_and_keeps_every_other_row(support_matrix, monkeypatch, tmp_path):
    """--distribution megatron-bridge --bridge-main: the Bridge rows (releases, then main, labelled with the
    megatron-core it ran on) are measured; every other row of the file stays byte for byte."""
    git_dir, _ = make_megatron_bridge(tmp_path / "Megatron-Bridge")
    site = bridge_main_site(git_dir, tmp_path / "snapshots")
    facts = snapshot_of(site)
    monkeypatch.setattr(support_matrix, "RELEASES", {"megatron-bridge": ["0.6.0"]})
    monkeypatch.setattr(support_matrix, "fixes_by_distribution", lambda: {
        "megatron-core": ["mtp-sp-scatter", "mtp-loss-mask"], "megatron-bridge": ["bridge-mtp-off"]})
    sites = []

    def measure(distribution, where, names=None):
        sites.append((distribution, where))
        version = facts["version"] if where == str(site) else "0.6.0"
        return [dict(name="bridge-mtp-off", distribution=distribution, version=version, verdict="needed", reason="r",
                     run="needed: e")]

    monkeypatch.setattr(support_matrix, "measure", measure)
    before = [line for line in support_matrix.SUPPORT.read_text().splitlines() if line.startswith("| mtp-")]
    support_matrix.main(["--distribution", "megatron-bridge", "--bridge-main", str(site)])
    assert sites == [("megatron-bridge", "site-0.6.0"), ("megatron-bridge", str(site))]
    lines = support_matrix.SUPPORT.read_text().splitlines()
    assert [line for line in lines if line.startswith("| mtp-")] == before
    core = distribution_version("megatron-core")
    label = f"Megatron-Bridge main @ {facts['short']} ({facts['date']}) on megatron-core {core}"
    assert [line.split(" | ")[2] for line in lines if line.startswith("| bridge-")] == ["0.6.0", label]
    with pytest.raises(SystemExit, match=r"--distribution: no fix targets \['ray'\]"):
        support_matrix.main(["--distribution", "ray"])


BRIDGE_FIXES = ("bridge-sft-mtp-mask", "bridge-mtp-export", "bridge-mtp-off")


@pytest.mark.slow
def test_check_lists_the_bridge_fixes_as_needed_on_the_pinned_bridge():
    """`mtp-overlay check` in a fresh interpreter. On a machine without Transformer Engine
    ``import megatron.bridge`` fails (peft/lora_layers.py imports it unguarded): plain ``check`` reads
    the installed source instead, says so in each row, finds each needed and exits 0 (stdout is the
    JSON alone: upstream's import noise goes to stderr); ``check --run`` imports the targets as the
    test bed's stock runs do (its scoped stand-ins for Bridge's missing optional packages) and finds
    each needed, the stock run agreeing."""
    import importlib.util
    import json

    from pins import MEGATRON_BRIDGE

    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    only = [argument for name in BRIDGE_FIXES for argument in ("--only", name)]

    def check(*extra):
        result = overlay("", "check", "--json", *only, *extra)
        return result.returncode, {row["name"]: row for row in json.loads(result.stdout)}

    code, rows = check()
    assert {row["version"] for row in rows.values()} == {MEGATRON_BRIDGE}
    assert code == 0 and {row["verdict"] for row in rows.values()} == {"needed"}
    if importlib.util.find_spec("transformer_engine") is None:
        assert {row["probed"] for row in rows.values()} == {"source"}
        for row in rows.values():
            assert re.search(r"does not import here \(ModuleNotFoundError: No module named '(transformer_engine|"
                             r"modelopt)'\); read from source: the files are megatron-bridge [\d.]+ as released",
                             row["reason"])
    else:
        assert {row["probed"] for row in rows.values()} == {"imported"}
    code, rows = check("--run")
    assert code == 0 and {name: row["verdict"] for name, row in rows.items()} == dict.fromkeys(BRIDGE_FIXES, "needed")
    assert {name: row["run"]["outcome"] for name, row in rows.items()} == dict.fromkeys(BRIDGE_FIXES, "needed")
