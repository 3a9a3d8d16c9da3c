"""What a fix's source patch finds on disk, decided by hashes, never by "it applies".

Lessons from patch-package and quilt: the patch is picked by the release's family (the fix's
declaration), the files by their measured sha256 (the manifest), "already applied" means the
patched hash (or, for a file edited since, a reverse patch that applies), "redundant" means the
fix's marker is in the pre-image, and a file matching nothing is a mismatch that nothing writes to.
"""

import hashlib

from ..contract import State
from .gitapply import GitMissing, PatchError, git_apply
from .locate import find_distribution
from .manifest import ManifestError, state_key, touched_files

TYPE_CHECKING = False
if TYPE_CHECKING:
    import os
    from collections.abc import Iterable, Mapping
    from pathlib import Path
    from typing import Any

    from ..contract import Declaration, Verdict
    from .gitapply import Files
    from .locate import Installed
    from .manifest import Manifest, States


# what one touched file is: carries this fix's patch as measured, is at a measured state without it
# (as released, or with other fixes' patches), has bytes no measured state has, or is not there
FILE_STATES = ("patched", "unpatched", "edited", "missing")


def sha256(data: "bytes | None") -> "str | None":
    return None if data is None else hashlib.sha256(data).hexdigest()


class Report:
    """One fix in one environment: state on disk (after the command), what was done, and why.

    ``current``: the touched files' bytes on disk; ``carries``: per file, the fix ids its hash
    says it carries, with ``states`` the manifest's map that hash was found in (None: unknown bytes).
    ``files``: per touched file its ``path``, ``state`` (`FILE_STATES`), ``found`` sha256, the
    measured ones ``released`` and ``patched`` (with this fix's patch, alone or with others'), and the
    fix ids it ``carries`` (None for bytes the manifest does not know).
    """

    __slots__ = ("fix", "installed", "patch", "state", "action", "reason", "files", "current", "carries", "states")

    def __init__(self, fix: "Declaration", installed: "Installed | None") -> None:
        self.fix, self.installed = fix, installed
        self.patch: "Any" = None  # the patch file (a Path) once a release family fits
        self.state: "Any" = None  # a State once surveyed
        self.action: "str | None" = None
        self.reason: "Any" = None  # a str once set
        self.files: "list[dict[str, Any]]" = []
        self.current: "Files" = {}
        self.carries: "dict[str, frozenset[str]]" = {}
        self.states: "dict[str, States]" = {}

    def set(self, state: str, reason: str) -> "Report":
        self.state, self.reason = state, reason
        return self

    def as_dict(self) -> "dict[str, Any]":
        installed = self.installed
        return {
            "fix": self.fix.name,
            "distribution": self.fix.distribution,
            "version": installed.version if installed else None,
            "site_packages": str(installed.root) if installed else None,
            "variant": self.patch.name if self.patch else None,
            "state": self.state,
            "action": self.action,
            "reason": self.reason,
            "files": self.files,
        }


def survey(fix: "Declaration", manifest: "Manifest", dirs: "Iterable[str | os.PathLike[str]] | None" = None,
           verify: bool = True) -> Report:
    """The on-disk state of ``fix`` (its Declaration) in ``dirs`` (default: sys.path); nothing written.

    ``verify``: prove a `State.NEEDED` patch applies cleanly (runs ``git apply`` on a scratch copy).
    """
    installed = find_distribution(fix.distribution, dirs)
    report = Report(fix, installed)
    if installed is None:
        where = ", ".join(map(str, dirs)) if dirs is not None else "sys.path"
        return report.set(State.ABSENT, f"{fix.distribution} is not installed in {where}")
    name = f"{fix.distribution} {installed.version}"
    family = fix.family_of(installed.version)
    if family is None:
        ranges = "; ".join(f"{family} fits {versions}" for family, versions in fix.families.items())
        if marker_on_disk(fix, installed.root):
            return report.set(State.REDUNDANT, f"{name} fits no release family ({ranges}) and {fix.marker}: already upstream")
        if _older_than_every_family(fix, installed.version):
            return report.set(State.UNSUPPORTED, f"{name} predates every release family ({ranges}): no source patch "
                              "for it (`mtp-overlay check` says what the runtime hook finds)")
        return report.set(State.MISMATCH, f"{name} fits no release family ({ranges})")
    report.patch = manifest.patch_path(fix, family)
    report.current = {file: _read(installed.root / file) for file in touched_files(report.patch)}
    for file, data in report.current.items():
        found, candidates = sha256(data), manifest.file_states(fix, installed.version, file)
        for states in candidates:
            carries = next((applied for applied, digest in states.items() if digest == found), None)
            if carries is not None:
                report.carries[file], report.states[file] = carries, states
                break
        released = sorted({states[frozenset()] for states in candidates if frozenset() in states})
        patched = sorted({digest for states in candidates for applied, digest in states.items() if fix.name in applied})
        carries = report.carries.get(file)
        report.files.append({"path": file, "state": _file_state(fix, data, carries), "found": found,
                             "released": released, "patched": patched,
                             "carries": None if carries is None else sorted(carries)})
    known = [fix.name in report.carries[file] for file in report.current if file in report.carries]
    if len(known) == len(report.current):
        if all(known):
            return report.set(State.APPLIED, f"{report.patch.name}: every file matches its patched sha256")
        if not any(known):
            if verify:
                try:
                    transform(report, report.current, report.carries, reverse=False)
                except GitMissing:
                    raise
                except PatchError as exc:
                    return report.set(State.MISMATCH, str(exc))
            return report.set(State.NEEDED, f"{report.patch.name} fits {name}: pre-image sha256 matches, applies cleanly")
    if git_apply(report.patch, report.current, reverse=True)[0] is not None:
        return report.set(State.APPLIED, f"{report.patch.name}: the reverse patch applies (files differ from the manifest)")
    # a measured release's files are known byte for byte: other bytes are a local edit, never "upstream"
    if installed.version not in manifest.images.get(fix.distribution, {}) and marker_on_disk(fix, installed.root):
        return report.set(State.REDUNDANT, f"{name}: {fix.marker}: the behaviour is already in the pre-image")
    return report.set(State.MISMATCH, _mismatch(report))


def _older_than_every_family(fix: "Declaration", version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    lowest = [Version(spec.version) for versions in fix.families.values() for spec in SpecifierSet(versions)
              if spec.operator in (">=", ">")]
    return bool(lowest) and Version(version) < min(lowest)


def transform(report: Report, current: "Mapping[str, bytes | None]", carries: "Mapping[str, frozenset[str]]",
              reverse: bool) -> "tuple[Files, dict[str, frozenset[str]]]":
    """The bytes ``report``'s patch makes of ``current`` (files carrying ``carries``), or takes out
    of them when ``reverse``, each checked against the manifest: ``(files, carries after)``."""
    fix = report.fix
    unknown = [file for file in current if file not in carries]
    if unknown:
        raise PatchError(
            f"{fix.name}: cannot {'revert' if reverse else 'apply'} byte-exactly: {', '.join(unknown)} "
            f"match(es) no sha256 the manifest has for {report.patch.name}'s files (edited since?)"
        )
    files, error = git_apply(report.patch, current, reverse)
    verb = "git apply --reverse" if reverse else "git apply"
    if files is None:
        raise PatchError(f"{fix.name}: {verb} {report.patch} failed: {error}")
    after: "dict[str, frozenset[str]]" = {}
    for file, data in files.items():
        after[file] = carries[file] - {fix.name} if reverse else carries[file] | {fix.name}
        want = report.states[file].get(after[file])
        if want is None:
            raise ManifestError(
                f"{fix.name}: the manifest has no sha256 for {file} carrying {state_key(after[file])!r}: "
                "run scripts/measure_patches.py"
            )
        if sha256(data) != want:
            raise PatchError(f"{fix.name}: {verb} made {file} with sha256 {sha256(data)}, the manifest says {want}")
    return files, after


def marker_on_disk(fix: "Declaration", root: "Path") -> bool:
    """Whether the file of ``fix.marker`` under ``root`` carries the marker (read, not run)."""
    if fix.marker is None:
        return False
    path = root / fix.marker.file
    data = _read(path)
    return data is not None and fix.marker.in_source(data, str(path))


def source_verdict(fix: "Declaration", module: str, manifest: "Manifest | None" = None) -> "Verdict | None":
    """What the installed source says of ``fix``, for `check` where its target ``module`` cannot be
    imported on this machine (a package it needs is missing): a `Verdict` read from disk, never run;
    None when the release has no such module.

    The module's file must read and parse (else `State.UNSUPPORTED`); the answer is this survey's:
    files as a measured release ships them, with the fix's patch fitting, are needed; the patch on
    disk, or the fix's marker in the source, is redundant; a patch that fits no file is drifted.
    """
    from ..contract import Verdict, drifted, needed, redundant
    from .manifest import load

    installed = find_distribution(fix.distribution)
    if installed is None:
        return Verdict(State.ABSENT, f"{fix.distribution} is not installed")
    base = installed.root / module.replace(".", "/")
    path = next((found for found in (base.with_suffix(".py"), base / "__init__.py") if found.is_file()), None)
    if path is None:
        return None
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError) as exc:
        return Verdict(State.UNSUPPORTED, f"cannot read {path}: {type(exc).__name__}: {exc}")
    if not fix.families:
        if marker_on_disk(fix, installed.root):
            return redundant(str(fix.marker))
        return Verdict(State.UNSUPPORTED, f"{fix.name} has no source patch and no marker to read {path} by")
    try:
        report = survey(fix, manifest or load(), verify=False)
    except (ManifestError, PatchError) as exc:
        return Verdict(State.UNSUPPORTED, f"cannot survey the source: {exc}")
    name = f"{fix.distribution} {installed.version}"
    if report.state == State.NEEDED:
        return needed(f"the files are {name} as released (measured sha256), where {report.patch.name} fits")
    if report.state == State.APPLIED:
        return redundant(f"its source patch is on disk ({report.reason})")
    if report.state == State.MISMATCH:
        return drifted(report.reason)
    return Verdict(report.state, report.reason)


def patched_on_disk(fix: "Declaration", manifest: "Manifest | None" = None) -> "bool | None":
    """Whether the installed files of ``fix`` carry its patch (hashes only, nothing run).

    None when the distribution is not importable, or no patch of ``fix`` fits it or is shipped.
    """
    from .manifest import load

    if not fix.families:
        return None
    try:
        state = survey(fix, manifest or load(), verify=False).state
    except (ManifestError, PatchError):  # no patches/ here, or no git to read an edited file with:
        return None  # `mtp-overlay patch` says which; status and check go on
    return {State.APPLIED: True, State.NEEDED: False}.get(state)


def _file_state(fix: "Declaration", data: "bytes | None", carries: "frozenset[str] | None") -> str:
    if data is None:
        return "missing"
    if carries is None:
        return "edited"
    return "patched" if fix.name in carries else "unpatched"


def _mismatch(report: Report) -> str:
    """Why the files fit no state of the patch: each edited or missing file named with the sha256 the
    other files say it should have, then what those are (patched, unpatched, or both: half-applied).

    Nothing is written then, by apply or by revert: a container build needs every file of a fix in one
    measured state, and a partial revert would leave the fix half-applied under a hook that reads one file.
    """
    fix, installed = report.fix, report.installed
    assert installed is not None, "a mismatch is found on an installed distribution"
    name = f"{fix.distribution} {installed.version}"
    groups = {state: [entry for entry in report.files if entry["state"] == state] for state in FILE_STATES}
    patched, unpatched, changed = groups["patched"], groups["unpatched"], groups["edited"] + groups["missing"]
    lines = []
    for entry in changed:
        if patched and not unpatched:
            wanted, what, since = entry["patched"], f"{name} with this patch, as the other files carry it", "the patch"
        else:
            wanted, what, since = entry["released"], f"{name} as released, or with other fixes' patches", "the release"
        how = "edited" if entry["found"] else "removed"
        lines.append(f"{installed.root / entry['path']}: expected sha256 {' or '.join(wanted) or '(none measured)'} "
                     f"({what}), found {entry['found'] or 'no file'} ({how} since {since})")
    if patched and unpatched:
        lines.append(f"half-applied: {_paths(patched)} carry the patch, {_paths(unpatched)} do not")
    elif changed and (patched or unpatched):
        lines.append(f"the other {len(patched or unpatched)} file(s) {'carry' if patched else 'do not carry'} the "
                     "patch, as measured")
    undo = "undo the edit, or " if changed else ""
    release = f"{fix.distribution}=={installed.version}"
    lines.append(f"nothing is written until every file is in one measured state: {undo}reinstall {release} "
                 f"(`pip install --force-reinstall --no-deps {release}`: every file as released)")
    return f"{report.patch.name}: " + "; ".join(lines)


def _paths(entries: "list[dict[str, Any]]") -> str:
    return ", ".join(entry["path"] for entry in entries)


def _read(path: "Path") -> "bytes | None":
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
