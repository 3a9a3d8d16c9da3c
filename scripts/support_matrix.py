"""Measure every fix on every supported upstream release and write docs/SUPPORT.md.

Each release is installed side by side (`pip install --no-deps --target`, sharing the venv's torch)
and examined in a fresh interpreter: the probe (`mtp-overlay check`) reads the installed code, and
the fix's reproducer runs the stock code path with the fix off. Nothing in the table is declared by hand.

``--megatron-main SOURCE`` adds a "Megatron-LM main @ <commit> (<date>)" row per megatron-core fix,
measured the same way on a source snapshot: SOURCE is a Megatron-LM git directory (a bare mirror will
do; its HEAD is taken, its ``megatron/core`` extracted under the git-ignored ``.cache/megatron-lm-main/``)
or a folder made that way. ``--bridge-main SOURCE`` does the same for Megatron-Bridge (its
``src/megatron/bridge``, under ``.cache/megatron-bridge-main/``): a "Megatron-Bridge main @ <commit>
(<date>) on megatron-core <version>" row per Bridge fix, measured with the Megatron-LM main snapshot
on the path too when one is given (Bridge main imports megatron-core main's names), else with the
venv's megatron-core. Without them, the main rows already in docs/SUPPORT.md are kept as they are
(they name their commit and date). A snapshot's version is ``<package_info version>+<commit>``, a
local version no release carries: the main rows are never compared with the default pins.

Bridge's targets are imported through the test bed's scoped stand-ins for its optional packages
(`bed.models.bridge.import_stand_ins`: Transformer Engine, ModelOpt... on this CPU stack), as its stock
runs are: without them no Bridge module imports here, and every Bridge row would read unsupported.

``--only FIX`` (repeatable) measures those fixes alone and keeps every other fix's rows of
docs/SUPPORT.md as they are: a new or changed fix's rows without re-measuring the others.
"""

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

from packaging.version import Version

from mtp_overlay import declarations
from mtp_overlay.contract import distribution_version
from mtp_overlay.bed.runtime.releases import (
    bridge_main_site,
    megatron_main_site,
    release_site,
    run_with_release,
    snapshot_of,
)

RELEASES = {  # a distribution not named here is measured at the venv's pinned release only
    "megatron-core": ["0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2"],
    "megatron-bridge": ["0.6.0", "0.6.2"],  # 0.6.1 is not on the index; 0.5.x and older do not import here
    "vllm": ["0.25.1", "0.33.0"],
}
ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "docs" / "SUPPORT.md"
MAIN_SNAPSHOTS = ROOT / ".cache" / "megatron-lm-main"
BRIDGE_MAIN_SNAPSHOTS = ROOT / ".cache" / "megatron-bridge-main"
MAIN_LABEL = "Megatron-LM main @ {short} ({date})"
BRIDGE_MAIN_LABEL = "Megatron-Bridge main @ {short} ({date}) on megatron-core {core}"
MAIN_ROW = re.compile(r"^\| [\w-]+ \| megatron-core \| Megatron-LM main @ ")
BRIDGE_MAIN_ROW = re.compile(r"^\| [\w-]+ \| megatron-bridge \| Megatron-Bridge main @ ")
TABLE_ROW = re.compile(r"^\| (?P<name>[\w-]+) \| (?P<dist>[\w.-]+) \| [^|]+ \| \*\*\w+\*\* \|")  # not the header

MEASURE = """
import json, warnings
warnings.simplefilter("ignore")
from mtp_overlay import registry
from mtp_overlay.bed.models.bridge import import_stand_ins
from mtp_overlay.bed.fixes import stock_run
with import_stand_ins():
    rows = [dict(row.as_dict(), run=str(row.run)) for row in registry.check({names!r}, stock_run=stock_run)]
print("MATRIX " + json.dumps(rows))
"""


def fixes_by_distribution():
    """distribution -> the ids of its fixes, in the table's order: every declared fix gets rows."""
    found = {}
    for declaration in declarations.every():
        found.setdefault(declaration.distribution, []).append(declaration.name)
    return found


def releases_of(distribution):
    """The releases of ``distribution`` to measure (None: the venv's pinned one)."""
    return RELEASES.get(distribution, [None])


def measure(distribution, site, names=None):
    """The rows of the fixes ``names`` (default: every fix) of ``distribution``, measured with ``site``
    first on the path ("" for the venv's): `mtp_overlay.check` with the test bed's stock runs, each
    row's run in the one wording (`StockRun`)."""
    code = MEASURE.format(names=names or fixes_by_distribution()[distribution])
    result = run_with_release(site, code, timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.startswith("MATRIX ")]
    if result.returncode or not lines:
        raise SystemExit(f"{distribution} from {site or 'the venv'}: measurement failed\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("MATRIX "):])


def main_snapshot(source, option="--megatron-main", project="Megatron-LM", make=megatron_main_site,
                  snapshots=MAIN_SNAPSHOTS):
    """The importable snapshot folder for ``--megatron-main SOURCE`` (``--bridge-main``: Bridge's), a
    git directory or a snapshot folder."""
    source = Path(source)
    if snapshot_of(source) is not None:
        return source
    if not (source / "HEAD").is_file() and not (source / ".git").exists():
        raise SystemExit(f"{option}: {source} is neither a {project} git directory nor a snapshot folder")
    try:
        return make(source / ".git" if (source / ".git").exists() else source, snapshots)
    except ValueError as exc:
        raise SystemExit(f"{option}: {exc}") from None


def bridge_snapshot(source):
    return main_snapshot(source, "--bridge-main", "Megatron-Bridge", bridge_main_site, BRIDGE_MAIN_SNAPSHOTS)


def cell(text):
    return " ".join(str(text).split()).replace("|", "\\|")


def table_line(row):
    return (
        f"| {row['name']} | {row['distribution']} | {row.get('label') or row['version']} | **{row['verdict']}** | "
        f"{cell(row['reason'])} | {cell(row['run'])} |"
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-main", metavar="SOURCE",
                        help="also measure Megatron-LM main: its git directory, or a snapshot folder made from one")
    parser.add_argument("--distribution", action="append", metavar="DIST",
                        help="measure only this distribution's fixes (repeatable); every other row stays as it is")
    parser.add_argument("--bridge-main", metavar="SOURCE",
                        help="also measure Megatron-Bridge main (with --megatron-main's megatron-core when given): its "
                             "git directory, or a snapshot folder made from one")
    parser.add_argument("--only", action="append", metavar="FIX", choices=declarations.names(),
                        help="measure this fix only (repeatable); the other fixes' rows are kept as they are")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    snapshot = main_snapshot(args.megatron_main) if args.megatron_main else None
    bridge = bridge_snapshot(args.bridge_main) if args.bridge_main else None
    rows = []
    unknown = sorted(set(args.distribution or ()) - set(fixes_by_distribution()))
    if unknown:
        raise SystemExit(f"--distribution: no fix targets {unknown}; the fixes' distributions are "
                         f"{sorted(fixes_by_distribution())}")
    # distribution -> its fixes to measure (--distribution, --only); every other fix's rows are kept
    measured = {distribution: [name for name in names if args.only is None or name in args.only]
                for distribution, names in fixes_by_distribution().items()
                if not args.distribution or distribution in args.distribution}
    for distribution, names in measured.items():
        for version in releases_of(distribution) if names else ():
            print(f"measuring {distribution} {version or distribution_version(distribution)}", file=sys.stderr)
            rows += measure(distribution, release_site(distribution, version) if version else "", names)
    core_main = snapshot is not None and bool(measured.get("megatron-core"))
    if core_main:  # (with --distribution megatron-bridge alone the snapshot only pairs Bridge main)
        facts = snapshot_of(snapshot)
        print(f"measuring megatron-core from Megatron-LM main {facts['short']} ({facts['date']})", file=sys.stderr)
        for row in measure("megatron-core", snapshot, measured["megatron-core"]):
            if row["version"] != facts["version"]:
                raise SystemExit(f"{snapshot}: megatron-core answered {row['version']}, not the snapshot's {facts['version']}")
            rows.append(dict(row, label=MAIN_LABEL.format(**facts)))
    if bridge is not None and measured.get("megatron-bridge"):
        facts = snapshot_of(bridge)
        core = snapshot_of(snapshot)["version"] if snapshot is not None else distribution_version("megatron-core")
        print(f"measuring megatron-bridge from Bridge main {facts['short']} ({facts['date']}) on megatron-core {core}",
              file=sys.stderr)
        site = os.pathsep.join(str(path) for path in (bridge, snapshot) if path is not None)
        for row in measure("megatron-bridge", site, measured["megatron-bridge"]):
            if row["version"] != facts["version"]:
                raise SystemExit(f"{bridge}: megatron-bridge answered {row['version']}, not the snapshot's {facts['version']}")
            rows.append(dict(row, label=BRIDGE_MAIN_LABEL.format(**facts, core=core)))
    order = declarations.names()
    rows.sort(key=lambda row: (order.index(row["name"]), "label" in row, Version(row["version"])))
    # kept as they are: the main rows not re-measured, the rows of the distributions not asked for
    # (--distribution) and of the declared fixes not asked for (--only)
    def untouched(row):
        return row is not None and (
            (args.distribution and row["dist"] not in args.distribution)
            or (args.only and row["name"] in order and row["name"] not in args.only))

    kept = [] if not SUPPORT.exists() else [
        line for line in SUPPORT.read_text().splitlines()
        if (MAIN_ROW.match(line) and not core_main) or (BRIDGE_MAIN_ROW.match(line) and bridge is None)
        or untouched(TABLE_ROW.match(line))
    ]
    pins = {distribution: distribution_version(distribution) for distribution in fixes_by_distribution()}
    lines = [
        "# Support matrix",
        "",
        f"Generated by `scripts/upstream_matrix.sh` on {datetime.date.today().isoformat()} from real runs, "
        "never by hand. For every fix and upstream release: **probe** is `mtp-overlay check` reading the "
        "installed code (needed / redundant / drifted); **stock run** is the fix's reproducer running the stock "
        "code path with the fix off; **unsupported**: the release does not import on this stack. Default pins: "
        + ", ".join(f"{d} {v}" for d, v in sorted(pins.items())) + ". "
        "**Megatron-LM main @ commit (date)** rows come from a source snapshot of that commit's `megatron/core` "
        "(`scripts/upstream_matrix.sh --megatron-main <Megatron-LM git dir>`; version `<package_info>+<commit>`), "
        "measured the same way; **Megatron-Bridge main @ commit (date) on megatron-core <version>** rows likewise "
        "from Bridge's `src/megatron/bridge` (`--bridge-main <Megatron-Bridge git dir>`), with the Megatron-LM main "
        "snapshot's megatron-core when both are given. Megatron-Bridge's modules import through the test bed's "
        "scoped stand-ins for its optional packages (Transformer Engine, ModelOpt, ...: not on this CPU stack), as "
        "its stock runs do. CI checks only the rows of the installed versions.",
        "",
        "| fix | distribution | version | probe | reason | stock run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    # each fix's rows in the table's order: its releases by version, then its main rows (kept ones too)
    body = sorted([table_line(row) for row in rows] + kept, key=lambda line: row_order(line, order))
    SUPPORT.parent.mkdir(exist_ok=True)
    SUPPORT.write_text("\n".join(lines + body) + "\n")
    print(f"wrote {SUPPORT}" + (f" (kept {len(kept)} rows as they were)" if kept else ""))


def row_order(line, order):
    """Where a table line goes: (its fix's place in ``order``, main rows after releases, the version)."""
    name, version = (cell.strip() for cell in line.split("|")[1:4:2])
    main = " main @ " in version
    return order.index(name), main, Version("0") if main else Version(version)


if __name__ == "__main__":
    main()
