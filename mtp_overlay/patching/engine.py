"""``apply`` / ``check`` / ``revert`` of source patches: survey every fix, work out every file's new
bytes, write them all or none (`transaction`), under each site folder's lock."""

import contextlib

from ..contract import State
from .gitapply import PatchError
from .locate import find_distribution
from .survey import sha256, survey, transform
from .transaction import Change, RollbackError, commit, locked, recover, stale_bytecode

TYPE_CHECKING = False
if TYPE_CHECKING:
    import os
    from collections.abc import Iterable, Sequence
    from pathlib import Path

    from ..contract import Declaration
    from .manifest import Manifest
    from .survey import Report

    # path -> (bytes on disk, bytes after the fixes so far, what they carry, root)
    Working = dict[Path, tuple["bytes | None", "bytes | None", "frozenset[str] | None", Path]]

COMMANDS = ("apply", "check", "revert")

# what apply / revert do to a fix in each state besides the one they act on
_NO_OP = {
    "apply": {State.APPLIED: "already applied", State.REDUNDANT: "skipped", State.ABSENT: "skipped",
              State.UNSUPPORTED: "skipped", State.MISMATCH: "refused"},
    "revert": {State.NEEDED: "not applied", State.REDUNDANT: "skipped", State.ABSENT: "skipped",
               State.UNSUPPORTED: "skipped", State.MISMATCH: "refused"},
}


def run(command: str, fixes: "Sequence[Declaration]", manifest: "Manifest",
        dirs: "Iterable[str | os.PathLike[str]] | None" = None, dry_run: bool = False) -> "list[Report]":
    """Run ``command`` on ``fixes`` (their Declarations) with ``manifest``: one Report each.

    apply/revert are all-or-nothing across every file of every fix: one mismatch or failure and
    nothing is written. ``dry_run`` decides and verifies everything, then writes nothing. A
    transaction an earlier run left unfinished (killed mid-write) is rolled back first.
    """
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {command!r}")
    roots = sorted({str(found.root) for found in (find_distribution(fix.distribution, dirs) for fix in fixes) if found})
    with contextlib.ExitStack() as stack:
        for root in roots:
            stack.enter_context(locked(root))
            if not dry_run:
                recover(root)
        reports = [survey(fix, manifest, dirs) for fix in fixes]
        if command != "check":
            _act(command, reports, dry_run)
    return reports


def _act(command: str, reports: "list[Report]", dry_run: bool) -> None:
    reverse = command == "revert"
    for report in reports:
        report.action = _NO_OP[command].get(report.state)
    todo = [report for report in reports if report.action is None]
    refused = [report.fix.name for report in reports if report.action == "refused"]
    working: "Working" = {}
    if not refused:
        for report in todo:
            try:
                _work(report, working, reverse)
            except PatchError as exc:
                report.action, report.reason = "failed", str(exc)
                refused.append(report.fix.name)
                break
    if refused:
        for report in todo:
            if report.action is None:
                report.action = "refused"
                report.reason += f"; not attempted: {', '.join(refused)} cannot be {command} (all-or-nothing)"
        return
    if dry_run:
        for report in todo:
            report.action = "would revert" if reverse else "would patch"
        return
    by_root: "dict[Path, list[Change]]" = {}
    for path, (old, new, _, root) in working.items():
        by_root.setdefault(root, []).append(Change(path, old, new))
        by_root[root].extend(Change(pyc, pyc.read_bytes(), None) for pyc in stale_bytecode(path))
    try:
        for root, changes in by_root.items():
            commit(root, changes)
    except Exception as exc:
        restored = "" if isinstance(exc, RollbackError) else "; every file put back"
        for report in todo:
            report.action, report.reason = "failed", f"{type(exc).__name__}: {exc}{restored}"
        return
    for report in todo:
        report.action, report.state = ("reverted", State.NEEDED) if reverse else ("patched", State.APPLIED)
        done = "back at their released sha256" if reverse else "at their patched sha256"
        report.reason = f"{report.patch.name}: {len(report.files)} file(s) written, {done}"
        assert report.installed is not None, "only a surveyed installation is acted on"
        for entry in report.files:
            path = report.installed.root / entry["path"]
            entry["found"], carries = sha256(path.read_bytes()), working[path][2]
            assert carries is not None, "every file worked on carries a known set of fixes"
            entry["carries"], entry["state"] = sorted(carries), "patched" if report.fix.name in carries else "unpatched"


def _work(report: "Report", working: "Working", reverse: bool) -> None:
    """Apply (revert) ``report``'s patch to the files as the fixes before it left them in ``working``."""
    assert report.installed is not None, "only a surveyed installation is worked on"
    root = report.installed.root
    paths = {file: root / file for file in report.current}
    for file, path in paths.items():
        if path not in working:
            working[path] = (report.current[file], report.current[file], report.carries.get(file), root)
    current = {file: working[path][1] for file, path in paths.items()}
    carries = {file: carried for file, path in paths.items() if (carried := working[path][2]) is not None}
    files, after = transform(report, current, carries, reverse)
    for file, path in paths.items():
        working[path] = (working[path][0], files[file], after[file], root)

