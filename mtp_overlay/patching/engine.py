"""Survey, apply and revert source patches on an installed distribution, all-or-nothing.

Lessons from patch-package and quilt (SPEC section 3): a variant is picked by version range and the
pre-image's sha256, never by "it applies"; "already applied" means the post-image hash matches (or
the reverse patch applies); "redundant" means the behaviour is already in the pre-image; nothing is
written unless every file of every selected fix can be, and any failure puts every file back
byte-identical. ``git apply`` runs on a scratch copy outside any repository, so no .orig/.rej ever
lands in site-packages; stale bytecode of touched files is removed in the same transaction.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

from .locate import find_distribution
from .manifest import reaches

APPLIED, NEEDED, REDUNDANT, MISMATCH, ABSENT = "applied", "needed", "redundant", "mismatch", "absent"
COMMANDS = ("apply", "check", "revert")


class PatchError(RuntimeError):
    """A patch could not be applied or reverted; every file was left (or put back) as it was."""


class RollbackError(PatchError):
    """A failed write could not be undone: the files named may be half-patched."""


def sha256(data):
    return None if data is None else hashlib.sha256(data).hexdigest()


def _read(path):
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class Report:
    """One fix in one environment: state on disk (after the command), what was done, and why."""

    __slots__ = ("fix", "installed", "variant", "state", "action", "reason", "files", "images", "current")

    def __init__(self, fix, installed):
        self.fix, self.installed = fix, installed
        self.variant = self.images = None
        self.current = {}  # file -> bytes on disk (None: missing)
        self.state = self.action = self.reason = None
        self.files = []  # {"path", "found", "pre", "post"} per touched file

    def set(self, state, reason):
        self.state, self.reason = state, reason
        return self

    def as_dict(self):
        installed = self.installed
        return {
            "fix": self.fix.name,
            "distribution": self.fix.distribution,
            "version": installed.version if installed else None,
            "site_packages": str(installed.root) if installed else None,
            "variant": self.variant.patch.name if self.variant else None,
            "state": self.state,
            "action": self.action,
            "reason": self.reason,
            "files": self.files,
        }


def survey(fix, dirs=None):
    """The on-disk state of ``fix`` (a manifest FixPatches) in ``dirs``: a Report, nothing written."""
    installed = find_distribution(fix.distribution, dirs)
    report = Report(fix, installed)
    if installed is None:
        where = ", ".join(map(str, dirs)) if dirs is not None else "sys.path"
        return report.set(ABSENT, f"{fix.distribution} is not installed in {where}")
    name = f"{fix.distribution} {installed.version}"
    variant = fix.variant_for(installed.version)
    if variant is None:
        ranges = "; ".join(f"{v.patch.name} fits {v.versions}" for v in fix.variants)
        if marker_present(fix.marker, installed.root):
            return report.set(REDUNDANT, f"{name} fits no variant ({ranges}) and {fix.marker}: already upstream")
        return report.set(MISMATCH, f"{name} fits no variant ({ranges})")
    report.variant = variant
    report.current = {file: _read(installed.root / file) for file in variant.files}
    found = {file: sha256(data) for file, data in report.current.items()}
    candidates = variant.images(installed.version)
    report.files = [
        {
            "path": file,
            "found": found[file],
            "pre": sorted({pre for images in candidates for pre, _ in images[file]}),
            "post": sorted({post for images in candidates for _, post in images[file]}),
        }
        for file in variant.files
    ]
    report.images = _match(candidates, found, POST)
    if report.images is not None:
        return report.set(APPLIED, f"{variant.patch.name}: every file matches its patched sha256")
    report.images = _match(candidates, found, PRE)
    if report.images is not None:
        try:
            transform(report, reverse=False)  # proves "would apply cleanly" to the measured bytes
        except PatchError as exc:
            return report.set(MISMATCH, str(exc))
        return report.set(NEEDED, f"{variant.patch.name} fits {name}: pre-image sha256 matches, applies cleanly")
    if _git_apply(variant, report.current, reverse=True)[0] is not None:
        return report.set(APPLIED, f"{variant.patch.name}: the reverse patch applies (files differ from the manifest)")
    if marker_present(fix.marker, installed.root):
        return report.set(REDUNDANT, f"{name}: {fix.marker}: the behaviour is already in the pre-image")
    return report.set(MISMATCH, _mismatch(report))


def patched_on_disk(fix):
    """Whether the installed files of ``fix`` (a Fix) match a variant's patched sha256.

    None when the distribution is not importable here or no variant of ``fix.patches`` fits it.
    """
    from .manifest import ManifestError

    try:
        variants = fix.patches
    except ManifestError:  # an install without patches/: `mtp-overlay patch` reports it, status goes on
        return None
    installed = find_distribution(fix.distribution) if variants else None
    variant = next((v for v in variants if v.fits(installed.version)), None) if installed else None
    if variant is None:
        return None
    found = {file: sha256(_read(installed.root / file)) for file in variant.files}
    return _match(variant.images(installed.version), found, POST) is not None


PRE, POST = 0, 1


def _match(candidates, found, side):
    """{file: (pre, post)}: for the first candidate map where every file's ``found`` sha256 is the
    ``side`` (PRE or POST) of one of its measured pairs (alone, or on top of other fixes), that pair."""
    for images in candidates:
        chosen = {}
        for file, pairs in images.items():
            pair = next((pair for pair in pairs if pair[side] == found[file]), None)
            if pair is None:
                break
            chosen[file] = pair
        else:
            return chosen
    return None


def _mismatch(report):
    lines = []
    for entry in report.files:
        known = entry["pre"] + entry["post"]
        if entry["found"] in known:
            kind = "patched" if entry["found"] in entry["post"] else "unpatched"
            lines.append(f"{report.installed.root / entry['path']} is {kind} while other files are not (half-applied)")
        else:
            alone = sorted({images[entry["path"]][0][0] for images in report.variant.images(report.installed.version)})
            others = [sha for sha in entry["pre"] if sha not in alone]
            combined = f" or {' or '.join(others)} (with other fixes' patches on it)" if others else ""
            lines.append(
                f"{report.installed.root / entry['path']}: expected sha256 {' or '.join(alone)} "
                f"({report.fix.distribution} {report.installed.version} as released){combined}, "
                f"found {entry['found'] or 'no file'}"
            )
    return f"{report.variant.patch.name}: " + "; ".join(lines)


def marker_present(marker, root):
    """Whether ``marker.function`` in ``root / marker.file`` references ``marker.calls``, itself or
    through the file's functions it calls (read, not run)."""
    if marker is None:
        return False
    path = Path(root) / marker.file
    data = _read(path)
    if data is None:
        return False
    try:
        code = compile(data, str(path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return reaches(dict(_functions(code, "")), marker.function, marker.calls)


def _functions(code, prefix):
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            name = prefix + const.co_name
            yield name, const
            yield from _functions(const, name + ".")


def _git_apply(variant, current, reverse):
    """(files, "") that ``variant``'s patch makes of ``current`` in a scratch copy, or (None, git's error)."""
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-patch-") as scratch:
        tree = Path(scratch, "tree")
        tree.mkdir()
        for file, data in current.items():
            if data is not None:
                (tree / file).parent.mkdir(parents=True, exist_ok=True)
                (tree / file).write_bytes(data)
        command = ["git", "apply", "--whitespace=nowarn", *(["--reverse"] if reverse else []), str(variant.patch)]
        env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
        env["GIT_CEILING_DIRECTORIES"] = scratch  # never mistake an enclosing repository for the tree
        try:
            result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        except FileNotFoundError:
            raise PatchError("git not found on PATH: `mtp-overlay patch` applies patches with `git apply`") from None
        if result.returncode != 0:
            return None, result.stderr.strip()
        return {file: _read(tree / file) for file in current}, ""


def transform(report, reverse):
    """The new bytes of every file of ``report`` (patched, or reverted when ``reverse``), hash-checked."""
    if report.images is None:
        raise PatchError(
            f"{report.fix.name}: cannot {'revert' if reverse else 'apply'} byte-exactly: "
            f"{report.variant.patch.name}'s files do not match the manifest's sha256"
        )
    files, error = _git_apply(report.variant, report.current, reverse)
    verb = "git apply --reverse" if reverse else "git apply"
    if files is None:
        raise PatchError(f"{report.fix.name}: {verb} {report.variant.patch} failed: {error}")
    for file, (pre, post) in report.images.items():
        want, got = (pre if reverse else post), sha256(files[file])
        if got != want:
            raise PatchError(f"{report.fix.name}: {verb} made {file} with sha256 {got}, the manifest says {want}")
    return files


class Change:
    """One file's old and new bytes (None: absent), and its timestamps to put back on rollback."""

    __slots__ = ("path", "old", "new", "times")

    def __init__(self, path, old, new):
        self.path, self.old, self.new = path, old, new
        stat = path.stat() if old is not None else None
        self.times = (stat.st_atime_ns, stat.st_mtime_ns) if stat else None


def _put(path, data):
    """Make ``path`` hold ``data`` (None: no file); each file is swapped in whole by os.replace."""
    if data is None:
        path.unlink(missing_ok=True)
        return
    temporary = path.with_name(f".{path.name}.mtp-overlay-tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            shutil.copymode(path, temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def stale_bytecode(path):
    """Cached bytecode of source ``path`` (``__pycache__/<stem>.*.pyc``)."""
    return sorted((path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"))


def commit(changes):
    """Write every change or none: on any failure, interrupts included, every file gets its old bytes back."""
    try:
        for change in changes:
            _put(change.path, change.new)
        for change in changes:
            if _read(change.path) != change.new:
                raise PatchError(f"{change.path}: the bytes read back differ from those written")
    except BaseException:
        _rollback(changes)
        raise


def _rollback(changes):
    failed = []
    for change in changes:
        try:
            if _read(change.path) != change.old:
                _put(change.path, change.old)
                if change.times:
                    os.utime(change.path, ns=change.times)
        except OSError as exc:
            failed.append(f"{change.path}: {exc}")
    if failed:
        raise RollbackError("rollback failed, these files may be half-patched: " + "; ".join(failed))


# what apply / revert do to a fix in each state besides the one they act on
_NO_OP = {
    "apply": {APPLIED: "already applied", REDUNDANT: "skipped", ABSENT: "skipped", MISMATCH: "refused"},
    "revert": {NEEDED: "not applied", REDUNDANT: "skipped", ABSENT: "skipped", MISMATCH: "refused"},
}


def run(command, fixes, dirs=None, dry_run=False):
    """Run ``command`` (apply, check, revert) on ``fixes`` (manifest entries): one Report each.

    apply/revert are all-or-nothing across every file of every fix: one mismatch or failure and
    nothing is written. ``dry_run`` decides and verifies everything, then writes nothing.
    """
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {command!r}")
    reports = [survey(fix, dirs) for fix in fixes]
    if command == "check":
        return reports
    reverse = command == "revert"
    for report in reports:
        report.action = _NO_OP[command].get(report.state)
    todo = [report for report in reports if report.action is None]
    refused = [report.fix.name for report in reports if report.action == "refused"]
    changes = {}  # path -> Change: fixes sharing a file each change it in turn
    for report in todo:
        if refused:
            break
        try:
            _changes(report, reverse, changes)
        except PatchError as exc:
            report.action, report.reason = "failed", str(exc)
            refused.append(report.fix.name)
    if refused:
        for report in todo:
            if report.action is None:
                report.action = "refused"
                report.reason += f"; not attempted: {', '.join(refused)} cannot be {command} (all-or-nothing)"
        return reports
    if not dry_run:
        try:
            commit(list(changes.values()))
        except Exception as exc:
            restored = "" if isinstance(exc, RollbackError) else "; every file put back"
            for report in todo:
                report.action, report.reason = "failed", f"{type(exc).__name__}: {exc}{restored}"
            return reports
    for report in todo:
        if dry_run:
            report.action = "would revert" if reverse else "would patch"
            continue
        report.action, report.state = ("reverted", NEEDED) if reverse else ("patched", APPLIED)
        done = "back at their released sha256" if reverse else "at their patched sha256"
        report.reason = f"{report.variant.patch.name}: {len(report.files)} file(s) written, {done}"
        for entry in report.files:
            entry["found"] = sha256(_read(report.installed.root / entry["path"]))
    return reports


def _changes(report, reverse, changes):
    """Add to ``changes`` (path -> Change) what patching (or reverting) ``report``'s files takes,
    stale bytecode removal included. A file that an earlier fix of the same command already changed
    is taken as that fix left it, and must then match one of this variant's measured combinations."""
    paths = {file: report.installed.root / file for file in report.variant.files}
    if any(path in changes for path in paths.values()):
        report.current = {
            file: changes[path].new if path in changes else report.current[file] for file, path in paths.items()
        }
        found = {file: sha256(data) for file, data in report.current.items()}
        report.images = _match(report.variant.images(report.installed.version), found, POST if reverse else PRE)
        if report.images is None:
            raise PatchError(
                f"{report.fix.name}: after the other fixes' patches of this {'revert' if reverse else 'apply'}, "
                f"{report.variant.patch.name}'s files match no combination the manifest measured"
            )
    for file, new in transform(report, reverse).items():
        path = paths[file]
        if path in changes:
            changes[path].new = new
        else:
            changes[path] = Change(path, report.current[file], new)
        for pyc in stale_bytecode(path):
            changes.setdefault(pyc, Change(pyc, _read(pyc), None))
