"""``mtp-overlay patch apply|check|revert``: the command-line face of the patch engine.

Exit codes: 0 done; 1 a needed patch could not be applied or reverted (mismatch, failure), or a
``--fail-on-*`` condition held; 2 usage (bad arguments, unreadable manifest, unknown interpreter).
"""

import json
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from ..contract import Declaration


def add_parser(commands: "argparse._SubParsersAction[Any]") -> "argparse.ArgumentParser":
    """Add the ``patch`` subcommand to ``commands`` (an argparse subparsers object)."""
    from .manifest import DEFAULT_PATH

    patch: "argparse.ArgumentParser" = commands.add_parser(
        "patch",
        help="apply, check or revert the fixes' source patches in an installed environment",
        description="Source patches on the installed upstream packages (for container builds). "
        "Exit: 0 done, 1 a needed patch could not be applied (fail the build), 2 usage.",
    )
    patch.add_argument("action", choices=("apply", "check", "revert"))
    patch.add_argument("--only", action="append", metavar="FIX", help="this fix only (repeatable)")
    where = patch.add_mutually_exclusive_group()
    where.add_argument("--site-packages", metavar="DIR", help="the site-packages folder to patch")
    where.add_argument("--python", metavar="INTERPRETER", help="patch this interpreter's site-packages")
    patch.add_argument("--dry-run", action="store_true", help="decide and verify everything, write nothing")
    patch.add_argument("--json", action="store_true", help="one JSON object per fix, in a list")
    patch.add_argument("--fail-on-redundant", action="store_true", help="exit 1 when a patch is already upstream")
    patch.add_argument("--fail-on-needed", action="store_true",
                       help="exit 1 when a patch is still not applied, or when no patched distribution is there at all")
    patch.add_argument("--manifest", default=str(DEFAULT_PATH), help="patch manifest (default: %(default)s)")
    patch.set_defaults(run=run)
    return patch


def patched_fixes(only: "list[str] | None" = None) -> "list[Declaration]":
    """The declarations of the fixes that ship source patches (those of ``only``, which must all ship one)."""
    from .. import declarations

    if only is None:
        return [declaration for declaration in declarations.every() if declaration.families]
    fixes = [declarations.load(name) for name in only]
    unpatched = [fix.name for fix in fixes if not fix.families]
    if unpatched:
        shipped = ", ".join(fix.name for fix in patched_fixes())
        raise ValueError(f"--only: {', '.join(map(repr, unpatched))} ship no source patch; expected one of {shipped}")
    return fixes


def run(args: "argparse.Namespace") -> int:
    from pathlib import Path

    from ..contract import State
    from .engine import run as run_engine
    from .gitapply import GitMissing, PatchError
    from .locate import site_dirs
    from .manifest import ManifestError, load

    try:
        fixes = patched_fixes(args.only)
        manifest = load(Path(args.manifest).resolve())
        dirs = site_dirs(python=args.python, site_packages=args.site_packages)
        reports = run_engine(args.action, fixes, manifest, dirs, dry_run=args.dry_run)
    except (ManifestError, ValueError, GitMissing) as exc:
        print(f"mtp-overlay patch: {exc}", file=sys.stderr)
        return 2
    except PatchError as exc:
        print(f"mtp-overlay patch: {exc}", file=sys.stderr)
        return 1
    rows = [report.as_dict() for report in reports]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            _print_row(row)
    failed = any(row["action"] in ("refused", "failed") or row["state"] == State.MISMATCH for row in rows)
    failed |= args.fail_on_redundant and any(row["state"] == State.REDUNDANT for row in rows)
    nothing_here = all(row["state"] == State.ABSENT for row in rows)  # a wrong --site-packages, say
    failed |= args.fail_on_needed and (nothing_here or any(row["state"] == State.NEEDED for row in rows))
    return 1 if failed else 0


def _print_row(row: "dict[str, Any]") -> None:
    where = f"{row['distribution']} {row['version']}" if row["version"] else row["distribution"]
    variant = f", {row['variant']}" if row["variant"] else ""
    action, state = row["action"], row["state"]
    if action in ("patched", "reverted"):
        outcome = f"{action} -> {state}"
    elif action in ("skipped", "refused", "failed"):
        outcome = f"{action} ({state})"
    else:
        outcome = action or state
    print(f"{row['fix']} ({where}{variant}): {outcome}")
    print(f"  {row['reason']}")
    for entry in row["files"]:
        print(f"  {row['site_packages']}/{entry['path']}  {entry['state']}  sha256 {entry['found']}")
