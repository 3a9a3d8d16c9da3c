"""The guarantees of the fix lifecycle, on a throwaway target module.

The machinery is exercised on a small module written to tmp_path so each guarantee is cheap to
check many times; the fixes themselves are proven against installed upstream code elsewhere.
"""

import importlib
import json
import subprocess
import sys
import threading
import time
import uuid
import warnings

import pytest
import wrapt
import wrapt.importer

from mtp_overlay import OverlayError, OverlayWarning, State, hooks, lifecycle, registry, table
from mtp_overlay.contract import Declaration, Provenance, drifted, needed
from mtp_overlay.fixes import Fix
from mtp_overlay.lifecycle import Lifecycle
from mtp_overlay.contract import HEAVY_IMPORTS

TARGET_SOURCE = """
import time
time.sleep({delay})

class Target:
    def compute(self, x):
        return x + 1
"""


class DoublingFix(Fix):
    """Doubles `Target.compute`; its probe can be told to fail or to report drift. Its targets' roles
    are t0, t1, ... in the order given."""

    def __init__(self, *targets, behaviour="needed", name="test-doubling", requires=(), reads=()):
        self.declaration = Declaration(
            name, summary="test fix", symptom="Target.compute adds one", distribution="pytest",
            targets={f"t{index}": target for index, target in enumerate(targets)}, provenance=Provenance("tests"),
            requires=requires, reads=reads)
        self.behaviour = behaviour

    def probe(self, module):
        if self.behaviour == "raise":
            raise RuntimeError("probe exploded")
        if self.behaviour == "drift":
            return drifted("Target.compute is gone")
        return needed()

    def wrappers(self, module):
        def doubled(wrapped, instance, args, kwargs):
            return 2 * wrapped(*args, **kwargs)

        yield module.Target, "compute", doubled


@pytest.fixture
def target(tmp_path, monkeypatch):
    """Name of a fresh, not yet imported module on sys.path."""

    def make(delay=0.0):
        name = f"overlay_target_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(TARGET_SOURCE.format(delay=delay))
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make


@pytest.fixture
def register(monkeypatch):
    """Put test fixes in the registry for the duration of a test."""
    added = []

    def add(fix):
        added.append(fix)
        modules = fix.declaration.modules
        monkeypatch.setattr(table, "FIXES", table.FIXES + ((fix.name, modules),))
        if fix.declaration.requires:
            monkeypatch.setattr(table, "REQUIRES", {**table.REQUIRES, fix.name: fix.declaration.requires})
        monkeypatch.setitem(lifecycle._lifecycles, fix.name, Lifecycle(fix.name, modules, fix))
        return fix

    yield add
    for fix in added:
        registry.uninstall(only=[fix.name])


def raw(module):
    return vars(module.Target)["compute"]


def wrappers_around(obj):
    return len(list(wrapt.wrapper_chain(obj))) - 1


def test_import_pulls_in_no_upstream_and_no_wrapt():
    code = (
        "import sys; before = set(sys.modules); import mtp_overlay; "
        f"heavy = {HEAVY_IMPORTS!r}; "
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in heavy or m in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_hook_waits_for_import_then_installs(target, register):
    name = target()
    fix = register(DoublingFix(name))
    registry.install(only=[fix.name])
    assert registry.status(only=[fix.name])[0].state == State.PENDING
    module = importlib.import_module(name)
    assert module.Target().compute(1) == 4
    row = registry.status(only=[fix.name])[0]
    assert (row.state, row.late) == (State.INSTALLED, False)


def test_exception_in_hook_never_breaks_the_import(target, register):
    fix = register(DoublingFix(target(), behaviour="raise"))
    registry.install(only=[fix.name], strict=False)
    with pytest.warns(OverlayWarning, match="probe exploded"):
        module = importlib.import_module(fix.target("t0"))
    assert module.Target().compute(1) == 2  # upstream untouched and usable
    row = registry.status(only=[fix.name])[0]
    assert row.state == State.FAILED and "probe exploded" in row.reason


def test_strict_mode_raises_on_hook_failure_and_drift(target, register):
    fix = register(DoublingFix(target(), behaviour="raise"))
    registry.install(only=[fix.name], strict=True)
    with pytest.raises(OverlayError, match="probe exploded"):
        importlib.import_module(fix.target("t0"))

    drifting = register(DoublingFix(target(), behaviour="drift", name="test-drifting"))
    registry.install(only=[drifting.name], strict=True)
    with pytest.raises(OverlayError, match="Target.compute is gone"):
        importlib.import_module(drifting.target("t0"))


def test_drift_warns_and_leaves_upstream_alone(target, register):
    fix = register(DoublingFix(target(), behaviour="drift"))
    registry.install(only=[fix.name], strict=False)
    with pytest.warns(OverlayWarning, match="Target.compute is gone"):
        module = importlib.import_module(fix.target("t0"))
    assert module.Target().compute(1) == 2
    assert registry.status(only=[fix.name])[0].state == State.DRIFTED


def test_strict_from_environment(target, register, monkeypatch):
    monkeypatch.setenv("MTP_OVERLAY_STRICT", "1")
    fix = register(DoublingFix(target(), behaviour="drift"))
    registry.install(only=[fix.name])
    with pytest.raises(OverlayError):
        importlib.import_module(fix.target("t0"))


def test_install_twice_never_stacks_and_uninstall_restores_identity(target, register):
    name = target()
    module = importlib.import_module(name)
    original = raw(module)
    fix = register(DoublingFix(name))
    registry.install(only=[fix.name])
    registry.install(only=[fix.name])
    registry.lifecycle(fix.name).install(module)
    assert module.Target().compute(1) == 4  # doubled once, not four times
    assert wrappers_around(raw(module)) == 1
    registry.uninstall(only=[fix.name])
    assert raw(module) is original
    assert registry.status(only=[fix.name])[0].state == State.DISABLED


def test_target_imported_before_the_overlay_is_patched_at_once_and_reported_late(target, register):
    name = target()
    module = importlib.import_module(name)
    fix = register(DoublingFix(name))
    registry.install(only=[fix.name])
    assert module.Target().compute(1) == 4
    row = registry.status(only=[fix.name])[0]
    assert (row.state, row.late) == (State.INSTALLED, True)


def test_concurrent_imports_end_with_exactly_one_wrapper(target, register):
    name = target(delay=0.05)
    fix = register(DoublingFix(name))
    registry.install(only=[fix.name])
    barrier = threading.Barrier(16)
    modules, errors = [], []

    def worker():
        try:
            barrier.wait()
            modules.append(importlib.import_module(name))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len({id(m) for m in modules}) == 1
    assert wrappers_around(raw(modules[0])) == 1
    assert modules[0].Target().compute(1) == 4


def test_thousand_install_uninstall_cycles_leave_no_residue(target, register):
    pending_name, loaded_name = target(), target()
    loaded = importlib.import_module(loaded_name)
    original = raw(loaded)
    pending_fix = register(DoublingFix(pending_name))
    loaded_fix = register(DoublingFix(loaded_name, name="test-loaded"))
    meta_path = list(sys.meta_path)
    registry.install(only=[pending_fix.name])  # arms the hook machinery once
    wrapt_hooks = {k: len(v) for k, v in wrapt.importer._post_import_hooks.items()}
    for _ in range(1000):
        registry.install(only=[pending_fix.name, loaded_fix.name])
        registry.uninstall(only=[pending_fix.name, loaded_fix.name])
    assert raw(loaded) is original
    assert registry.lifecycle(loaded_fix.name).wrapped() == registry.lifecycle(pending_fix.name).wrapped() == []
    assert pending_name not in hooks.waiting()
    assert len(sys.meta_path) <= len(meta_path) + 1  # at most the one lazy trigger or wrapt finder
    assert {k: len(v) for k, v in wrapt.importer._post_import_hooks.items()} == wrapt_hooks
    # and the pending hook still works after all that
    registry.install(only=[pending_fix.name])
    assert importlib.import_module(pending_name).Target().compute(1) == 4


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("MTP_OVERLAY_DISABLE", "mtp-sp-scatter")
    try:
        registry.install(only=["mtp-sp-scatter"])
        row = registry.status(only=["mtp-sp-scatter"])[0]
        assert row.state == State.DISABLED and "MTP_OVERLAY_DISABLE" in row.reason
    finally:
        monkeypatch.delenv("MTP_OVERLAY_DISABLE")
        registry.install(only=["mtp-sp-scatter"])
    monkeypatch.setenv("MTP_OVERLAY_DISABLE", "mtp-sp-scater")
    with pytest.warns(OverlayWarning, match="unknown fix 'mtp-sp-scater'.*mtp-sp-scatter"):
        registry.install(only=["mtp-sp-scatter"])  # a typo never breaks the import that reads it
    with pytest.raises(OverlayError, match="unknown fix 'mtp-sp-scater'"):
        registry.install(only=["mtp-sp-scatter"], strict=True)


def test_disabling_an_installed_fix_takes_its_wrappers_off(target, register, monkeypatch):
    module = importlib.import_module(target())
    fix = register(DoublingFix(module.__name__))
    registry.install(only=[fix.name])
    assert module.Target().compute(1) == 4
    registry.install(only=[fix.name], skip=[fix.name])
    assert module.Target().compute(1) == 2
    assert registry.status(only=[fix.name])[0].state == State.DISABLED


def test_reinstall_after_a_timely_install_is_not_late_and_does_not_probe_again(target, register):
    name = target()
    fix = register(DoublingFix(name))
    registry.install(only=[fix.name])
    module = importlib.import_module(name)
    probes = []
    fix.probe = lambda module: probes.append(module) or needed()
    registry.install(only=[fix.name])
    row = registry.status(only=[fix.name])[0]
    assert (row.state, row.late, probes) == (State.INSTALLED, False, [])
    assert module.Target().compute(1) == 4


def test_uninstall_takes_ours_out_from_under_a_wrapper_stacked_on_top(target, register):
    module = importlib.import_module(target())
    original = raw(module)
    fix = register(DoublingFix(module.__name__))
    registry.install(only=[fix.name])
    wrapt.wrap_function_wrapper(module.Target, "compute", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 100)
    outer = raw(module)
    assert module.Target().compute(1) == 104
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.uninstall(only=[fix.name])
    assert raw(module) is outer and outer.__wrapped__ is original  # the outer wrapper survives, ours is gone
    assert module.Target().compute(1) == 102


def test_two_fixes_on_one_method_uninstalled_inner_first_leave_the_original(target, register):
    """``mtp_overlay.uninstall()`` goes in table order: the fix installed first (the inner wrapper) is
    spliced out from under the second's, and the second's uninstall must not put it back."""
    module = importlib.import_module(target())
    original = raw(module)
    inner = register(DoublingFix(module.__name__, name="test-doubling-inner"))
    outer = register(DoublingFix(module.__name__, name="test-doubling-outer"))
    registry.install(only=[inner.name, outer.name])
    assert module.Target().compute(1) == 8  # (1 + 1) doubled twice
    registry.uninstall(only=[inner.name])
    assert module.Target().compute(1) == 4
    registry.uninstall(only=[outer.name])
    assert raw(module) is original and module.Target().compute(1) == 2
    registry.install(only=[inner.name, outer.name])  # and both go on again
    assert module.Target().compute(1) == 8


def test_uninstall_under_a_plain_decorator_leaves_ours_and_says_so(target, register):
    import functools

    module = importlib.import_module(target())
    fix = register(DoublingFix(module.__name__))
    registry.install(only=[fix.name])
    inner = raw(module)

    @functools.wraps(inner)
    def decorated(self, x):
        return inner(self, x) + 100

    module.Target.compute = decorated
    with pytest.warns(OverlayWarning, match="wrapped again after the overlay, not by wrapt"):
        registry.uninstall(only=[fix.name])
    assert module.Target().compute(1) == 104  # the outer decorator survives, ours inside it


def test_disable_all_in_a_fresh_interpreter():
    code = "import json, mtp_overlay; print(json.dumps([r.state for r in mtp_overlay.status()]))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, "MTP_OVERLAY_DISABLE": "all"},
    )
    assert set(json.loads(out.stdout)) == {State.DISABLED}


def test_status_cli_json_has_a_row_per_fix():
    out = subprocess.run(
        [sys.executable, "-m", "mtp_overlay.cli", "status", "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [row["name"] for row in rows] == registry.names()
    assert all(row["state"] in State.RUNTIME for row in rows)


def test_unknown_fix_name_is_refused():
    with pytest.raises(ValueError, match="unknown fix .nope.: expected one of .*mtp-sp-scatter"):
        registry.install(only=["nope"])


def test_warnings_escalated_to_errors_stop_the_import_and_the_state_stays_drift(target, register):
    fix = register(DoublingFix(target(), behaviour="drift"))
    registry.install(only=[fix.name], strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverlayWarning)
        with pytest.raises(OverlayWarning, match="Target.compute is gone"):
            importlib.import_module(fix.target("t0"))
    row = registry.status(only=[fix.name])[0]
    assert (row.state, row.reason) == (State.DRIFTED, f"{fix.target("t0")}: Target.compute is gone")  # said once


def test_the_command_line_way_to_escalate_overlay_warnings_works_in_the_default_install():
    """`-W error:mtp-overlay` matches every OverlayWarning by its message (a `-W` category must be
    importable before site-packages are: `mtp_overlay.OverlayWarning` is not)."""
    env = {**__import__("os").environ, "MTP_OVERLAY_DISABLE": "no-such-fix"}
    command = [sys.executable, "-c", "import mtp_overlay"]
    relaxed = subprocess.run(command, capture_output=True, text=True, env=env)
    assert relaxed.returncode == 0 and "OverlayWarning: mtp-overlay: MTP_OVERLAY_DISABLE names unknown fix" in relaxed.stderr
    strict = subprocess.run([sys.executable, "-W", "error:mtp-overlay", *command[1:]], capture_output=True, text=True, env=env)
    assert strict.returncode == 1 and "mtp_overlay.contract.OverlayWarning: mtp-overlay:" in strict.stderr
    assert "Invalid -W option" not in strict.stderr


@pytest.mark.parametrize("value", ["2", "enabled", "y"])
def test_an_unrecognised_strict_switch_warns_and_stays_off(target, register, monkeypatch, value):
    monkeypatch.setenv("MTP_OVERLAY_STRICT", value)
    fix = register(DoublingFix(target(), behaviour="drift"))
    with pytest.warns(OverlayWarning, match=f"MTP_OVERLAY_STRICT='{value}' is not one of"):
        registry.install(only=[fix.name])
    with pytest.warns(OverlayWarning, match="Target.compute is gone"):  # warned, not raised: off
        importlib.import_module(fix.target("t0"))


def test_install_takes_strict_as_a_bool_and_skip_as_none_too(target, register):
    fix = register(DoublingFix(target()))
    with pytest.raises(TypeError, match=r"install\(strict=...\) must be True, False or None .* got 'no'"):
        registry.install(only=[fix.name], strict="no")
    registry.install(only=[fix.name], skip=None)
    assert registry.status(only=[fix.name])[0].state == State.PENDING


def test_an_overlay_imported_while_another_thread_imports_the_target_installs_when_that_import_ends(target, register):
    """The module is in sys.modules but still running its body: probing it then would see it half
    built (drift); the fix installs once the other thread's import has finished."""
    name = target(delay=0.5)
    fix = register(DoublingFix(name))
    importer = threading.Thread(target=importlib.import_module, args=(name,))
    importer.start()
    while name not in sys.modules:
        time.sleep(0.01)
    assert sys.modules[name].__spec__._initializing
    registry.install(only=[fix.name])
    importer.join()
    deadline = time.monotonic() + 10
    while registry.status(only=[fix.name])[0].state == State.PENDING and time.monotonic() < deadline:
        time.sleep(0.01)
    row = registry.status(only=[fix.name])[0]
    assert (row.state, row.late) == (State.INSTALLED, True)
    assert sys.modules[name].Target().compute(1) == 4 and wrappers_around(raw(sys.modules[name])) == 1


WITHOUT_WRAPT = """
import sys, warnings
sys.modules["wrapt"] = None  # an environment without wrapt
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import mtp_overlay
    import ray  # must import all the same
row = mtp_overlay.status(only=["hf-modules-cache"])[0]
print(row.state, "|", row.reason, "|", sum("wrapt cannot be imported" in str(w.message) for w in caught))
"""


def test_without_wrapt_the_upstream_import_proceeds_and_the_fix_says_failed():
    result = subprocess.run([sys.executable, "-c", WITHOUT_WRAPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    state, reason, warned = result.stdout.strip().splitlines()[-1].split(" | ")
    assert state == "failed" and "wrapt cannot be imported" in reason and warned == "1"


def test_a_failing_target_takes_off_only_its_own_wrappers(target, register):
    good, bad = target(), target()

    class TwoTargets(DoublingFix):
        def probe(self, module):
            if module.__name__ == bad:
                raise RuntimeError("second target exploded")
            return needed()

    fix = register(TwoTargets(good, bad))
    registry.install(only=[fix.name])
    first = importlib.import_module(good)
    with pytest.warns(OverlayWarning, match="second target exploded"):
        second = importlib.import_module(bad)
    assert first.Target().compute(1) == 4  # still fixed
    assert second.Target().compute(1) == 2
    assert registry.status(only=[fix.name])[0].state == State.FAILED


class NeedsAMovedModule(DoublingFix):
    """Its probe of the second target imports the first, which upstream has moved away."""

    def probe(self, module):
        importlib.import_module(self.target("t0"))
        return needed()


def test_a_moved_target_gets_one_answer_from_the_runtime_and_from_check(target, register):
    moved, present = f"overlay_moved_{uuid.uuid4().hex[:8]}", target()
    fix = register(NeedsAMovedModule(moved, present))
    registry.install(only=[fix.name])
    with pytest.warns(OverlayWarning, match=f"target module {moved} does not exist"):
        importlib.import_module(present)
    runtime = registry.status(only=[fix.name])[0]
    checked = registry.check([fix.name])[0]
    assert runtime.state == checked.verdict == State.DRIFTED and checked.verdict in State.FAILING
    assert runtime.reason == checked.reason == f"{present}: target module {moved} does not exist in this release (moved?)"


def test_a_fix_whose_required_fix_is_disabled_fails_naming_it_until_that_fix_is_back(target, register):
    base = register(DoublingFix(target(), name="test-base"))
    dependent = register(DoublingFix(target(), name="test-dependent", requires=(base.name,)))
    with pytest.warns(OverlayWarning, match="requires fix 'test-base', which is disabled by install"):
        registry.install(only=[base.name, dependent.name], skip=[base.name])
    row = registry.status(only=[dependent.name])[0]
    assert row.state == State.FAILED and row.reason == "requires fix 'test-base', which is disabled by install(skip=...)"
    module = importlib.import_module(dependent.target("t0"))
    assert module.Target().compute(1) == 2  # not installed
    registry.install(only=[base.name, dependent.name])
    assert registry.status(only=[dependent.name])[0].state == State.INSTALLED and module.Target().compute(1) == 4
    registry.uninstall(only=[base.name])
    with pytest.raises(OverlayError, match="requires fix 'test-base', which is uninstalled"):
        registry.install(only=[dependent.name], strict=True)
    assert module.Target().compute(1) == 2 and registry.status(only=[dependent.name])[0].state == State.FAILED


def test_a_fix_reads_the_state_of_a_fix_it_declares_and_of_no_other(target, register):
    base = register(DoublingFix(target(), name="test-base"))
    reader = register(DoublingFix(target(), name="test-reader", reads=(base.name,)))
    registry.install(only=[base.name])
    assert reader.peer_state(base.name) == (State.PENDING, f"waiting for import of {base.target('t0')}")
    registry.uninstall(only=[base.name])
    assert reader.peer_state(base.name) == (State.DISABLED, "uninstalled")
    with pytest.raises(ValueError, match="fix 'test-base' reads the state of 'test-reader' but does not declare it"):
        base.peer_state(reader.name)


def test_check_with_a_stock_run_says_where_the_probe_and_the_run_disagree(target, register):
    """`check(stock_run=...)` is the one place a probe verdict and a stock run become `disagrees`."""
    needed_fix = register(DoublingFix(target(), name="test-needed"))
    drifting = register(DoublingFix(target(), behaviour="drift", name="test-drifting"))
    ran = []

    def stock_run(shows, evidence):
        def run(name):
            ran.append(name)
            return shows, evidence

        return run

    def cannot_run(name):
        raise RuntimeError("could not run the stock path on pytest 0: no GPU; the test bed needs updating")

    agree = registry.check([needed_fix.name], stock_run=stock_run(True, "the bug shows"))[0]
    assert (agree.verdict, agree.reason, str(agree.run)) == (State.NEEDED, needed_fix.target("t0"), "needed: the bug shows")
    differ = registry.check([needed_fix.name], stock_run=stock_run(False, "no bug"))[0]
    assert differ.verdict == State.DISAGREES and differ.verdict in State.FAILING
    assert differ.reason == f"the probe says needed ({needed_fix.target('t0')}) but the stock run says redundant: no bug"
    assert differ.as_dict()["run"] == {"outcome": State.REDUNDANT, "evidence": "no bug"}
    not_run = registry.check([needed_fix.name], stock_run=cannot_run)[0]
    assert (not_run.verdict, not_run.run.outcome) == (State.NEEDED, None)
    assert str(not_run.run) == "could not run the stock path on pytest 0: no GPU; the test bed needs updating"
    ran.clear()
    drift = registry.check([drifting.name], stock_run=stock_run(True, "never asked"))[0]
    assert (drift.verdict, str(drift.run), ran) == (State.DRIFTED, "not run: the probe says drifted", [])
    assert registry.check([needed_fix.name])[0].run is None


def test_check_gives_one_reason_per_fix_and_each_target_module_in_targets(target, register):
    first, second = target(), target()
    fix = register(DoublingFix(first, second, name="test-two-targets"))
    row = registry.check([fix.name])[0]
    assert (row.verdict, row.probed) == (State.NEEDED, "imported")
    assert row.reason == f"{first} (and 1 other target module)"
    assert row.targets == [{"module": module, "verdict": State.NEEDED, "probed": "imported", "reason": ""}
                           for module in (first, second)]


HALF_INITIALISING = """
from pathlib import Path

tried = Path(__file__).with_name("tried")
if not tried.exists():  # the first import fails and leaves state outside sys.modules behind, as
    tried.touch()       # megatron-core 0.15.3's torch extension build does; the second one "succeeds"
    raise IndexError("list index out of range")
"""


@pytest.fixture
def half_initialising(tmp_path, monkeypatch):
    """``make()``: a fresh package whose module ``flaky`` fails its first import only, and whose modules
    ``a`` and ``b`` each import it; returns the package's name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make():
        name = f"overlay_half_{uuid.uuid4().hex[:12]}"
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "flaky.py").write_text(HALF_INITIALISING)
        for module in ("a", "b"):
            (package / f"{module}.py").write_text(TARGET_SOURCE.format(delay=0) + "from . import flaky\n")
        return name

    yield make


def test_the_stand_in_half_initialises_as_a_second_import_of_the_release_does(half_initialising):
    package = half_initialising()
    with pytest.raises(IndexError):
        importlib.import_module(f"{package}.a")
    assert importlib.import_module(f"{package}.b").Target().compute(1) == 2  # "succeeds" the second time


def test_check_verdicts_do_not_depend_on_which_fixes_are_checked_together(half_initialising, register):
    """A module whose import failed once is unsupported for the whole check, whatever imports it later."""
    alone, together = half_initialising(), half_initialising()
    fixes = {(package, module): register(DoublingFix(f"{package}.{module}", name=f"test-{package[-12:]}-{module}"))
             for package in (alone, together) for module in ("a", "b")}
    [only_b] = registry.check([fixes[alone, "b"].name])
    both = registry.check([fixes[together, "a"].name, fixes[together, "b"].name])
    for row in (only_b, *both):
        assert (row.verdict, row.probed) == (State.UNSUPPORTED, "import failed"), row
        assert "import failed: IndexError: list index out of range" in row.reason
    assert importlib.import_module(f"{together}.b").Target().compute(1) == 2  # only check replays the failure
