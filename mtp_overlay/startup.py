"""The process-startup hook: a ``.pth`` file that makes every interpreter of an environment import the
overlay before any user code, Ray workers, spawned engine processes and torchrun ranks included.

At start-up `site` executes each line of a site-packages ``.pth`` file that begins with ``import``.
Ours imports ``mtp_overlay`` inside a guard, so a broken overlay costs one line on stderr, never the
interpreter. Its text is one file: ``hooks/mtp_overlay_startup.pth`` in the source tree, shipped as
package data (``mtp_overlay/startup.pth``) for this command and for images that copy it in by hand.
"""

import os
import sys
import sysconfig
import tempfile
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any, TypedDict

    class HookStatus(TypedDict):
        installed: bool
        current: bool
        path: str

PTH_NAME = "mtp_overlay_startup.pth"
PTH_TEXT = Path(__file__).with_name("startup.pth").read_text(encoding="utf-8")


def site_packages_dir(site_packages: "str | os.PathLike[str] | None" = None) -> str:
    """``site_packages`` as an absolute path (it must be an existing directory), or this interpreter's."""
    if site_packages is None:
        return sysconfig.get_paths()["purelib"]
    folder = os.fspath(site_packages)
    if not os.path.isdir(folder):
        raise ValueError(f"site_packages: {folder!r} is not an existing directory (expected a site-packages folder)")
    return os.path.abspath(folder)


def status(site_packages: "str | os.PathLike[str] | None" = None) -> "HookStatus":
    """``{"installed", "current", "path"}``: is our .pth there, does it hold this version's text, where."""
    path = os.path.join(site_packages_dir(site_packages), PTH_NAME)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return {"installed": False, "current": False, "path": path}
    return {"installed": True, "current": text == PTH_TEXT, "path": path}


def install(site_packages: "str | os.PathLike[str] | None" = None) -> str:
    """Write the .pth file and return its path; an up-to-date file is left untouched.

    Written to a temporary name (which site.py ignores) and renamed, so an interpreter starting
    meanwhile sees the old file or the new one, never half of it.
    """
    found = status(site_packages)
    if found["current"]:
        return found["path"]
    folder = os.path.dirname(found["path"])
    descriptor, temporary = tempfile.mkstemp(prefix=f".{PTH_NAME}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(PTH_TEXT)
        os.chmod(temporary, 0o644)
        os.replace(temporary, found["path"])
    except BaseException:
        os.unlink(temporary)
        raise
    return found["path"]


def uninstall(site_packages: "str | os.PathLike[str] | None" = None) -> "str | None":
    """Remove the .pth file; return its path, or None when there was none."""
    path = status(site_packages)["path"]
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    return path


def add_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    """``mtp-overlay startup-hook install|uninstall|status [--site-packages DIR]``."""
    parser = commands.add_parser("startup-hook", help="the .pth file that imports the overlay in every interpreter")
    parser.add_argument("action", choices=["install", "uninstall", "status"])
    parser.add_argument("--site-packages", metavar="DIR", help="default: this interpreter's site-packages")
    parser.set_defaults(run=_command)


def _command(args: "argparse.Namespace") -> int:
    try:
        if args.action == "install":
            print(f"installed: {install(args.site_packages)}")
        elif args.action == "uninstall":
            removed = uninstall(args.site_packages)
            print(f"removed: {removed}" if removed else f"not installed: {status(args.site_packages)['path']}")
        else:
            found = status(args.site_packages)
            if not found["installed"]:
                print(f"not installed: {found['path']}")
            else:
                print(f"installed: {found['path']}" + ("" if found["current"] else " (outdated: run install)"))
    except ValueError as exc:
        print(f"mtp-overlay startup-hook: {exc}", file=sys.stderr)
        return 2
    return 0
