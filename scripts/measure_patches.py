"""Write patches/manifest.json: for every release a fix's patch family covers, the sha256 of each file
its patches touch, as released and with every combination of the fixes' patches applied.

Releases are read from the venv (the pinned ones) or installed side by side (`pip --no-deps
--target`, cached). Usage: python scripts/measure_patches.py [DISTRIBUTION==VERSION ...] [DISTRIBUTION ...]
With no arguments, the releases already in the manifest are measured again; DISTRIBUTION==VERSION adds
a release; a bare DISTRIBUTION measures that distribution's releases only, the others' entries kept.
"""

import json
import sys
from pathlib import Path

from mtp_overlay import declarations
from mtp_overlay.contract import distribution_version
from mtp_overlay.patching.manifest import DEFAULT_PATH, FORMAT
from mtp_overlay.bed.engines.patch_images import measure, patches_for, released_files
from mtp_overlay.bed.runtime.releases import installed_site, release_site

ABOUT = (
    "Measured sha256 of every file a source patch touches, per distribution and release: as released and "
    "with each set of fixes' patches applied (key: fix ids, sorted, joined by '+'). Written by "
    "scripts/measure_patches.py from the real releases; which patch fits which release is each fix's "
    "`families` (patch <fix id>/<distribution>/<family>.patch)."
)


def main(extra):
    path = Path(DEFAULT_PATH)
    manifest = json.loads(path.read_text()) if path.exists() else {}
    releases = {(dist, version) for dist, versions in manifest.items() if isinstance(versions, dict)
                for version in versions}
    releases |= {tuple(item.split("==")) for item in extra if "==" in item}
    only = {item for item in extra if "==" not in item}
    fixes = declarations.every()
    measured = {"format": FORMAT, "about": ABOUT}
    for distribution, version in sorted(releases):
        if only and distribution not in only:
            measured.setdefault(distribution, {})[version] = manifest[distribution][version]
            continue
        patches = patches_for(fixes, distribution, version, path.parent)
        if not patches:
            continue
        print(f"measuring {distribution} {version}: {', '.join(patches)}", file=sys.stderr)
        site = installed_site(distribution) if distribution_version(distribution) == version else release_site(distribution, version)
        measured.setdefault(distribution, {})[version] = measure(patches, released_files(site, patches))
    path.write_text(json.dumps(measured, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
