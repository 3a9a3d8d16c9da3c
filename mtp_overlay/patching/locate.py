"""Where a distribution is installed in the target environment, and which version it is."""

import json
import subprocess
import sys
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    import os
    from collections.abc import Iterable

_ASK_PATHS = "import json, sysconfig; p = sysconfig.get_paths(); print(json.dumps([p['purelib'], p['platlib']]))"


class Installed:
    """A distribution found on disk: its version and the folder its files are relative to."""

    __slots__ = ("name", "version", "root")

    def __init__(self, name: str, version: str, root: "str | os.PathLike[str]") -> None:
        self.name, self.version, self.root = name, version, Path(root)

    def __repr__(self) -> str:
        return f"Installed({self.name!r}, {self.version!r}, {str(self.root)!r})"


def site_dirs(python: "str | None" = None, site_packages: "str | os.PathLike[str] | None" = None) -> "list[Path]":
    """Folders to search: ``site_packages``, or the purelib/platlib of ``python`` (default: this one).

    ValueError naming the argument when the folder is missing or the interpreter cannot answer.
    """
    if site_packages is not None:
        folder = Path(site_packages)
        if not folder.is_dir():
            raise ValueError(f"--site-packages: {folder} is not a directory")
        return [folder.resolve()]
    if python is None:
        import sysconfig

        paths = sysconfig.get_paths()
        found = [paths["purelib"], paths["platlib"]]
    else:
        try:
            result = subprocess.run([python, "-c", _ASK_PATHS], capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise ValueError(f"--python: cannot run {python!r}: {exc}") from None
        if result.returncode != 0:
            raise ValueError(f"--python: {python!r} could not report its site-packages: {result.stderr.strip()}")
        found = json.loads(result.stdout)
    unique: "list[Path]" = []
    for folder in map(Path, found):
        if folder.is_dir() and folder.resolve() not in unique:
            unique.append(folder.resolve())
    return unique


def find_distribution(name: str, dirs: "Iterable[str | os.PathLike[str]] | None" = None) -> "Installed | None":
    """The one installed ``name`` in ``dirs`` (default: ``sys.path``), or None.

    Several copies in one search path are ambiguous: ValueError listing them.
    """
    from importlib import metadata

    search = [str(d) for d in dirs] if dirs is not None else sys.path
    found: "list[tuple[str, Path]]" = []
    for dist in metadata.distributions(name=name, path=search):
        copy = (dist.version, Path(str(dist.locate_file(""))).resolve())
        if copy not in found:
            found.append(copy)
    if not found:
        return None
    if len(found) > 1 and dirs is not None:
        where = ", ".join(f"{version} in {root}" for version, root in found)
        raise ValueError(f"{name} is installed more than once ({where}): pass --site-packages to pick one")
    version, root = found[0]  # on sys.path the first one is the one that imports
    return Installed(name, version, root)
