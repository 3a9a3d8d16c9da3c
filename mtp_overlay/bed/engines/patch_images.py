"""Measure what the manifest holds: the sha256 of every file a source patch touches, as released and
with every combination of the fixes' patches applied, on the real releases.

`measure` checks as it goes that each patch applies on top of every other combination and that the
order of application never matters (the patches of fixes sharing a file must not overlap), so a file's
hash says exactly which fixes it carries. Used by ``scripts/measure_patches.py`` and by the tests that
keep the committed manifest honest.
"""

import hashlib
import itertools
from pathlib import Path

from mtp_overlay.patching.gitapply import git_apply
from mtp_overlay.patching.manifest import state_key, touched_files


def patches_for(fixes, distribution, version, root):
    """``{fix id: patch path}`` of the ``fixes`` whose release families hold ``version``."""
    found = {}
    for fix in fixes:
        family = fix.family_of(version) if fix.distribution == distribution else None
        if family is not None:
            found[fix.name] = Path(root) / fix.name / distribution / f"{family}.patch"
    return found


def measure(patches, released):
    """``{file: {state key: sha256}}`` for the touched files, from their ``released`` bytes
    ({relative path: bytes}) and ``patches`` ({fix id: patch path}); ValueError when a patch does not
    apply on top of another combination or the order of application changes the result."""
    touched = {name: touched_files(path) for name, path in patches.items()}
    states = {frozenset(): dict(released)}
    for size in range(1, len(patches) + 1):
        for subset in map(frozenset, itertools.combinations(sorted(patches), size)):
            results = []
            for last in sorted(subset):
                before = states[subset - {last}]
                files, error = git_apply(patches[last], {file: before[file] for file in touched[last]})
                if files is None:
                    raise ValueError(f"{last}'s patch does not apply on top of {state_key(subset - {last})!r}: {error}")
                results.append({**before, **files})
            if any(result != results[0] for result in results[1:]):
                raise ValueError(f"the patches of {state_key(subset)!r} give different files in different orders")
            states[subset] = results[0]
    images = {}
    for file in released:
        sharing = {name for name, files in touched.items() if file in files}
        for subset, files in states.items():
            if subset <= sharing:
                images.setdefault(file, {})[state_key(subset)] = hashlib.sha256(files[file]).hexdigest()
    return images


def released_files(site, patches):
    """The bytes of every file ``patches`` touch, read from the site folder ``site``."""
    files = sorted({file for path in patches.values() for file in touched_files(path)})
    return {file: (Path(site) / file).read_bytes() for file in files}
