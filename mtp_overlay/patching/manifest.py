"""``patches/manifest.json``: the measured sha256 of every file the source patches touch.

For each distribution, release and touched file: the file's sha256 as released (``"released"``) and
with each set of fixes' patches applied (key: the fix ids, sorted, joined by ``+``). Nothing else:
which patch fits which release is the fix's own declaration (`Declaration.families`, patch
``<fix id>/<distribution>/<family>.patch`` beside the manifest), and so is its redundancy marker.
Written by ``scripts/measure_patches.py`` from the real releases, never by hand.

Several fixes may patch one file: a file's hash then says exactly which of them it carries, and
every patch applies on top of any other combination (the measuring script checks that).
"""

import json
import re
from functools import lru_cache
from pathlib import Path

TYPE_CHECKING = False
if TYPE_CHECKING:
    import os
    from collections.abc import Iterable
    from typing import Any

    from ..contract import Declaration

    States = dict[frozenset[str], str]  # applied fix ids -> the file's sha256
    Images = dict[str, dict[str, dict[str, States]]]  # distribution -> version -> file -> States

FORMAT = 2
RELEASED = "released"
# mtp_overlay/patches links to the top-level patches/ in the source tree and is a copy of it in a wheel
DEFAULT_PATH = Path(__file__).resolve().parents[1] / "patches" / "manifest.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """The manifest or a patch it implies is malformed; the message names the file and the key."""


def state_key(applied: "Iterable[str]") -> str:
    """The manifest key of a file carrying the patches of the fix ids in ``applied``."""
    return "+".join(sorted(applied)) or RELEASED


def applied_in(key: str) -> "frozenset[str]":
    """The fix ids a manifest key stands for (`state_key`'s inverse)."""
    return frozenset() if key == RELEASED else frozenset(key.split("+"))


class Manifest:
    """The parsed manifest: ``images[distribution][version][file] = {frozenset(fix ids): sha256}``."""

    __slots__ = ("path", "images")

    def __init__(self, path: "str | os.PathLike[str]", images: "Images") -> None:
        self.path, self.images = Path(path), images

    @property
    def root(self) -> Path:
        """The folder holding the patches (the manifest's own)."""
        return self.path.parent

    def patch_path(self, fix: "Declaration", family: str) -> Path:
        """The patch file of ``fix`` for release family ``family`` (ManifestError when missing)."""
        path = self.root / fix.name / fix.distribution / f"{family}.patch"
        if not path.is_file():
            raise ManifestError(f"{self.path}: {fix.name} declares release family {family!r} but {path} does not exist")
        return path

    def file_states(self, fix: "Declaration", version: str, file: str) -> "list[States]":
        """Candidate ``{applied fix ids: sha256}`` maps for ``file`` of ``fix.distribution`` ``version``:
        the release's own when measured, else those of every measured release of the same family."""
        releases = self.images.get(fix.distribution, {})
        if version in releases:
            return [releases[version].get(file, {})]
        family = fix.family_of(version)
        distinct: "list[States]" = []
        for measured, files in releases.items():
            states = files.get(file)
            if states and fix.family_of(measured) == family and states not in distinct:
                distinct.append(states)
        return distinct


def touched_files(patch: "str | os.PathLike[str]") -> "tuple[str, ...]":
    """Paths a unified diff touches, relative to its root (the ``a/``/``b/`` prefix dropped)."""
    files: "list[str]" = []
    old: "str | None" = None
    for line in Path(patch).read_text(encoding="utf-8").splitlines():
        if line.startswith("--- "):
            old = line[4:].split("\t")[0]
        elif line.startswith("+++ "):
            new = line[4:].split("\t")[0]
            path = old if new == "/dev/null" else new
            if path is None or path == "/dev/null" or "/" not in path:
                raise ManifestError(f"{patch}: cannot read a file name from {line!r}")
            files.append(path.split("/", 1)[1])
    if not files:
        raise ManifestError(f"{patch}: no '+++ b/<path>' line: not a unified diff")
    return tuple(files)


@lru_cache(maxsize=8)
def load(path: "str | os.PathLike[str]" = DEFAULT_PATH) -> Manifest:
    """Parse and validate the manifest at ``path`` (cached per path)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"patch manifest not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: not JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else raw
        raise ManifestError(f"{path}: format must be {FORMAT}, got {got!r}")
    return Manifest(path, _images(path, {key: value for key, value in raw.items() if key not in ("format", "about")}))


def _images(path: Path, raw: "dict[str, Any]") -> "Images":
    """``raw`` (distribution -> version -> file -> key -> sha256) checked and keyed by frozensets."""
    from packaging.version import InvalidVersion, Version

    def mapping(value: object, where: str) -> "dict[str, Any]":
        if not isinstance(value, dict) or not value:
            raise ManifestError(f"{path}: {where} must be a non-empty object, got {value!r}")
        return value

    images: "Images" = {}
    for distribution, releases in raw.items():
        for version, files in mapping(releases, distribution).items():
            try:
                Version(version)
            except InvalidVersion:
                raise ManifestError(f"{path}: {distribution}: {version!r} is not a version") from None
            for file, states in mapping(files, f"{distribution}[{version!r}]").items():
                where = f"{distribution}[{version!r}][{file!r}]"
                mapping(states, where)
                if RELEASED not in states:
                    raise ManifestError(f"{path}: {where} has no {RELEASED!r} sha256")
                for key, digest in states.items():
                    if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
                        raise ManifestError(f"{path}: {where}[{key!r}] must be a sha256, got {digest!r}")
                    if key != state_key(applied_in(key)):
                        raise ManifestError(f"{path}: {where}: key {key!r} must be fix ids, sorted, joined by '+'")
                images.setdefault(distribution, {}).setdefault(version, {})[file] = {
                    applied_in(key): digest for key, digest in states.items()
                }
    return images
