"""What is generated from the fixes' declarations is current: the table ``import mtp_overlay`` reads,
each fix README's fact block, the README's fix table, and every DEP-3 header of a shipped patch
against its fix's provenance; an edited declaration makes the check fail, the generator cures it,
and a declaration naming an unknown fix is refused."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_overlay import declarations, generated, table
from mtp_overlay.contract import Declaration, Provenance
from mtp_overlay.scaffold import PLACEHOLDER

ROOT = generated.ROOT


def copy_of_the_checkout(destination, parts=("mtp_overlay", "patches", "hooks", "scripts", "README.md")):
    """The parts of this checkout generation reads, copied to ``destination`` (links kept as links)."""
    skip = shutil.ignore_patterns("__pycache__", ".pytest_cache")
    for part in parts:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, destination / part, symlinks=True, ignore=skip)
        else:
            shutil.copy2(source, destination / part)
    return destination


def run_in(copy, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(copy)}
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_generated_files_are_current():
    assert generated.stale() == [], "run scripts/generate.py"


def test_every_dep3_header_agrees_with_its_provenance():
    assert generated.dep3_mismatches() == []


def test_the_table_is_the_declarations_in_install_order():
    found = generated.found_declarations()
    assert table.FIXES == tuple((d.name, d.modules) for d in found)
    assert declarations.every() == [declarations.load(d.name) for d in found]
    names = [d.name for d in found]
    assert names.index("mtp-packed-roll") < names.index("mtp-cp-loss-scale")  # cp-loss-scale's after=


def test_install_order_puts_a_fix_after_the_fixes_it_names_and_refuses_a_cycle():
    def declared(name, after=()):
        return Declaration(name, summary="s", symptom="s", distribution="d", targets={"m": f"m.{name.replace('-', '_')}"},
                           provenance=Provenance("tests"), after=after)

    order = generated.install_order([declared("c-fix"), declared("a-fix", after=("c-fix",)), declared("b-fix")])
    assert [d.name for d in order] == ["b-fix", "c-fix", "a-fix"]
    with pytest.raises(generated.GenerationError, match="form a cycle"):
        generated.install_order([declared("a-fix", after=("b-fix",)), declared("b-fix", after=("a-fix",))])


def test_the_collective_fixes_are_the_declared_ones_and_read_each_other():
    """``table.COLLECTIVE`` (what `fixes.peers` compares across ranks) is generated from ``collective=True``;
    a collective fix whose ``reads`` leave another out is refused (its peer_state would raise mid-run)."""
    assert table.COLLECTIVE == tuple(d.name for d in generated.found_declarations() if d.collective)
    assert set(table.COLLECTIVE) == {"mtp-loss-mask", "mtp-packed-roll", "mtp-cp-loss-scale"}

    def declared(name, reads=()):
        return Declaration(name, summary="s", symptom="s", distribution="d",
                           targets={"m": f"m.{name.replace('-', '_')}"}, provenance=Provenance("tests"), reads=reads,
                           collective=True)

    generated.checked_references([declared("a-fix", reads=("b-fix",)), declared("b-fix", reads=("a-fix",))])
    with pytest.raises(generated.GenerationError, match=r"'b-fix' is collective: its reads must name .*\['a-fix'\]"):
        generated.checked_references([declared("a-fix", reads=("b-fix",)), declared("b-fix")])


def test_no_committed_fix_carries_a_scaffold_placeholder():
    found = []
    for declaration in generated.found_declarations():
        folder = generated.fix_folder(declaration)
        for path in [*folder.glob("*.py"), folder / "README.md"]:
            if PLACEHOLDER in path.read_text():
                found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_an_edited_declaration_makes_the_check_fail_and_the_generator_cures_it(tmp_path):
    copy = copy_of_the_checkout(tmp_path)
    check = ["scripts/generate.py", "--check"]
    assert run_in(copy, *check).returncode == 0
    fixes = copy / "mtp_overlay" / "fixes"
    sp_scatter = fixes / "mtp_sp_scatter" / "declaration.py"
    sp_scatter.write_text(sp_scatter.read_text().replace('first_fixed_release="0.20.0"', 'first_fixed_release="0.21.0"'))
    ray = fixes / "hf_modules_cache" / "declaration.py"
    ray.write_text(ray.read_text().replace('targets={"ray": "ray"}', 'targets={"ray": "ray._private.worker"}'))

    stale = run_in(copy, *check)
    assert stale.returncode == 1, stale.stderr
    lines = stale.stdout.splitlines()
    for path in ("mtp_overlay/table.py", "README.md", "mtp_overlay/fixes/mtp_sp_scatter/README.md",
                 "mtp_overlay/fixes/hf_modules_cache/README.md"):
        assert f"stale: {path} (run scripts/generate.py)" in lines
    applied = [line for line in lines if "Applied-Upstream says '0.20.0'" in line]
    assert len(applied) == len(declarations.load("mtp-sp-scatter").families)  # every sp-scatter patch
    assert "'0.21.0'" in applied[0]

    assert run_in(copy, "scripts/generate.py").returncode == 0
    cured = run_in(copy, *check)
    assert cured.stdout.splitlines() == applied and cured.returncode == 1  # what is generated is current again
    assert '"ray._private.worker"' in (copy / "mtp_overlay" / "table.py").read_text()

    mask = fixes / "mtp_loss_mask" / "declaration.py"
    mask.write_text(mask.read_text().replace('reads=("mtp-packed-roll", ', 'reads=("mtp-packed-rol", '))
    refused = run_in(copy, *check)
    assert refused.returncode == 2
    assert "fix 'mtp-loss-mask': reads names unknown fix(es) ['mtp-packed-rol']" in refused.stderr
