"""``patches/manifest.json``: the one list of source-patch variants.

Read by ``mtp-overlay patch`` and by ``Fix.patches``. For each fix: the distribution it patches, an
optional upstream marker (the function that calls a name only where the behaviour is present), and
its variants. A variant is a patch file, the version range it fits (a PEP 440 specifier set), and for
each measured release the sha256 of every touched file before (``pre``) and after (``post``).

Variants are chosen by version range and pre-image hash, never by "the patch applies": the 0.17
patch applies textually to 0.16 yet is wrong there (issue #7).

Two fixes may patch the same file (mtp-sp-scatter and mtp-packed-roll both patch megatron-core's
``multi_token_prediction.py``, in hunks that do not overlap). Each patch must then apply whether or
not the other is on disk, and every state of the file must stay a measured one, so a shared file's
entry carries ``with``: for each combination of the other fixes (names joined by ``+``, sorted), the
file's sha256 with their patches applied (``pre``) and with this one applied on top (``post``).
The manifest is refused unless every release measured by two fixes sharing a file lists the other
combinations in both entries.
"""

import itertools
import json
import re
from functools import lru_cache
from pathlib import Path

FORMAT = 1
# mtp_overlay/patches links to the top-level patches/ in the source tree and is a copy of it in a wheel
DEFAULT_PATH = Path(__file__).resolve().parents[1] / "patches" / "manifest.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """The manifest or a patch it names is malformed; the message names the file and the key."""


class Marker:
    """On-disk sign that the patched behaviour is present: ``function`` in ``file`` references
    ``calls``, itself or through the functions of that file it calls (see `reaches`)."""

    __slots__ = ("file", "function", "calls")

    def __init__(self, file, function, calls):
        self.file, self.function, self.calls = file, function, calls

    def __str__(self):
        return f"{self.function} already calls {self.calls}"


def reaches(functions, start, name):
    """Whether the code of ``functions[start]``, or of a function in ``functions`` it names
    (transitively), references ``name``. ``functions``: {name: code object} of one module.

    Upstream moves logic into helpers (Megatron-LM dev reads the padded boundaries in
    ``_get_packed_roll_cu_seqlens``, called by the packed roll), so a direct reference is too narrow.
    """
    seen, todo = set(), [start]
    while todo:
        current = todo.pop()
        code = functions.get(current)
        if code is None or current in seen:
            continue
        seen.add(current)
        if name in code.co_names:
            return True
        todo.extend(code.co_names)
    return False


class Variant:
    """One patch file, the versions it fits, and the measured pre/post hashes of its files."""

    __slots__ = ("fix", "patch", "versions", "measured", "combined", "files")

    def __init__(self, fix, patch, versions, measured, files, combined=None):
        self.fix, self.patch, self.versions = fix, patch, versions
        self.measured = measured  # version -> {file: (pre sha256, post sha256)}, this patch alone
        # version -> {file: {frozenset(other fixes applied first): (pre sha256, post sha256)}}
        self.combined = combined or {}
        self.files = files  # touched paths, relative to site-packages, in patch order

    def fits(self, version):
        return self.versions.contains(version, prereleases=True)

    def pairs(self, version, file):
        """The (pre, post) sha256 pairs of ``file`` at ``version``: alone, then with each combination."""
        return [self.measured[version][file], *self.combined.get(version, {}).get(file, {}).values()]

    def images(self, version):
        """Candidate {file: [(pre, post), ...]} maps for ``version``: its own if measured, else every
        measured one. Each file's list: this patch alone first, then on top of the other fixes' patches."""
        versions = [version] if version in self.measured else list(self.measured)
        distinct = []
        for measured in versions:
            images = {file: self.pairs(measured, file) for file in self.files}
            if images not in distinct:
                distinct.append(images)
        return distinct

    def __repr__(self):
        return f"Variant({self.fix!r}, {self.patch.name!r}, {str(self.versions)!r})"


class FixPatches:
    """A fix's entry in the manifest."""

    __slots__ = ("name", "distribution", "marker", "variants")

    def __init__(self, name, distribution, marker, variants):
        self.name, self.distribution, self.marker, self.variants = name, distribution, marker, variants

    def variant_for(self, version):
        """The variant whose range holds ``version``, or None; ManifestError if several do."""
        fitting = [variant for variant in self.variants if variant.fits(version)]
        if len(fitting) > 1:
            names = ", ".join(f"{v.patch.name} ({v.versions})" for v in fitting)
            raise ManifestError(f"{self.name}: {self.distribution} {version} fits several variants: {names}")
        return fitting[0] if fitting else None


class Manifest:
    __slots__ = ("path", "fixes")

    def __init__(self, path, fixes):
        self.path, self.fixes = path, fixes  # fixes: name -> FixPatches, in manifest order

    def select(self, only=None):
        """The entries named in ``only`` (all when None); ValueError naming the known ones otherwise."""
        if only is None:
            return list(self.fixes.values())
        unknown = [name for name in only if name not in self.fixes]
        if unknown:
            raise ValueError(
                f"--only: no patches for {', '.join(map(repr, unknown))} in {self.path}; "
                f"expected one of {', '.join(self.fixes) or '(none)'}"
            )
        return [self.fixes[name] for name in only]


def touched_files(patch):
    """Paths a unified diff touches, relative to its root (the ``a/``/``b/`` prefix dropped)."""
    files, old = [], None
    for line in patch.read_text(encoding="utf-8").splitlines():
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
def load(path=DEFAULT_PATH):
    """Parse and validate the manifest at ``path`` (cached per path)."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"patch manifest not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path}: not JSON: {exc}") from None

    def need(mapping, key, kind, where):
        value = mapping.get(key) if isinstance(mapping, dict) else None
        if not isinstance(value, kind):
            raise ManifestError(f"{path}: {where}.{key} must be a {kind.__name__}, got {value!r}")
        return value

    if raw.get("format") != FORMAT:
        raise ManifestError(f"{path}: format must be {FORMAT}, got {raw.get('format')!r}")
    fixes, owners = {}, {}
    for name, entry in need(raw, "fixes", dict, "manifest").items():
        where = f"fixes[{name!r}]"
        distribution = need(entry, "distribution", str, where)
        marker = entry.get("marker")
        if marker is not None:
            marker = Marker(*(need(marker, key, str, f"{where}.marker") for key in ("file", "function", "calls")))
        variants = []
        for index, item in enumerate(need(entry, "variants", list, where)):
            at = f"{where}.variants[{index}]"
            patch = path.parent / need(item, "patch", str, at)
            if not patch.is_file():
                raise ManifestError(f"{path}: {at}.patch: no such file {patch}")
            try:
                versions = SpecifierSet(need(item, "versions", str, at))
            except InvalidSpecifier as exc:
                raise ManifestError(f"{path}: {at}.versions: {exc}") from None
            files = touched_files(patch)
            measured, combined = {}, {}
            for version, images in need(item, "measured", dict, at).items():
                try:
                    Version(version)
                except InvalidVersion:
                    raise ManifestError(f"{path}: {at}.measured: {version!r} is not a version") from None
                if not versions.contains(version, prereleases=True):
                    raise ManifestError(f"{path}: {at}.measured: {version} is outside {versions}")
                if sorted(images) != sorted(files):
                    raise ManifestError(
                        f"{path}: {at}.measured[{version!r}] lists {sorted(images)}, "
                        f"but {patch.name} touches {sorted(files)}"
                    )
                measured[version] = {}
                for file in files:
                    pair = need(images, file, dict, f"{at}.measured[{version!r}]")
                    where_file = f"{at}.measured[{version!r}][{file!r}]"
                    measured[version][file] = _hashes(pair, where_file, path)
                    others = pair.get("with", {})
                    if not isinstance(others, dict):
                        raise ManifestError(f"{path}: {where_file}.with must be a dict, got {others!r}")
                    combined.setdefault(version, {})[file] = {
                        frozenset(key.split("+")): _hashes(value, f"{where_file}.with[{key!r}]", path)
                        for key, value in others.items()
                    }
            if not measured:
                raise ManifestError(f"{path}: {at}.measured is empty: measure at least one release")
            variants.append(Variant(name, patch, versions, measured, files, combined))
        fix = FixPatches(name, distribution, marker, tuple(variants))
        for variant in variants:
            for version in variant.measured:
                try:
                    fix.variant_for(version)
                except ManifestError as exc:  # two ranges overlap on a measured release
                    raise ManifestError(f"{path}: {exc}") from None
            for file in variant.files:
                owners.setdefault((distribution, file), []).append(variant)
        fixes[name] = fix
    _check_shared_files(path, owners)
    return Manifest(path, fixes)


def _hashes(pair, where, path):
    hashes = tuple(pair.get(key) if isinstance(pair, dict) else None for key in ("pre", "post"))
    if not all(isinstance(h, str) and _SHA256.fullmatch(h) for h in hashes):
        raise ManifestError(f"{path}: {where} needs pre and post sha256")
    return hashes


def _check_shared_files(path, owners):
    """Every release two fixes both measured on a shared file lists, in each fix's entry, the file's
    hashes on top of every combination of the other fixes (``with``); and only real fixes appear."""
    for (distribution, file), variants in owners.items():
        fixes = {variant.fix for variant in variants}
        for variant in variants:
            for version in variant.measured:
                sharing = sorted({v.fix for v in variants if v.fix != variant.fix and version in v.measured})
                listed = variant.combined.get(version, {}).get(file, {})
                unknown = sorted(name for combination in listed for name in combination - fixes)
                if unknown:
                    raise ManifestError(
                        f"{path}: {variant.fix}'s {variant.patch.name} lists {distribution} {version}'s {file} "
                        f"with {', '.join(unknown)}, which patch(es) no such file in this manifest"
                    )
                wanted = [frozenset(c) for k in range(1, len(sharing) + 1) for c in itertools.combinations(sharing, k)]
                missing = ["+".join(sorted(c)) for c in wanted if c not in listed]
                if missing:
                    raise ManifestError(
                        f"{path}: {variant.fix} and {', '.join(sharing)} both patch {distribution}'s {file}: "
                        f"{variant.fix}'s {variant.patch.name} must measure {version} with "
                        f"{', '.join(map(repr, missing))} "
                        "applied first (\"with\": the file's sha256 with those patches, before and after this one)"
                    )


def variants_for(fix_name, path=DEFAULT_PATH):
    """The variants of ``fix_name`` (empty when the manifest has none for it)."""
    entry = load(path).fixes.get(fix_name)
    return entry.variants if entry else ()
