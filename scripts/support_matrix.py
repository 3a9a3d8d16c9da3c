"""Measure every fix on every supported upstream release and write docs/SUPPORT.md.

Each release is installed side by side (`pip install --no-deps --target`, sharing the venv's torch)
and examined in a fresh interpreter: the probe (`mtp-overlay check`) reads the installed code, and
the fix's reproducer runs the stock code path with the fix off. Nothing in the table is declared by hand.

``--megatron-main SOURCE`` adds a "Megatron-LM main @ <commit> (<date>)" row per megatron-core fix,
measured the same way on a source snapshot: SOURCE is a Megatron-LM git directory (a bare mirror will
do; its HEAD is taken, its ``megatron/core`` extracted under the git-ignored ``.cache/megatron-lm-main/``)
or a folder made that way. Without it, the main rows already in docs/SUPPORT.md are kept as they are
(they name their commit and date). The snapshot's version is ``<package_info version>+<commit>``, a
local version no release carries: the main rows are never compared with the default pins.

``--only FIX`` (repeatable) measures those fixes alone and keeps every other fix's rows of
docs/SUPPORT.md as they are: a new or changed fix's rows without re-measuring the others.
"""

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from packaging.version import Version

from mtp_overlay import declarations
from mtp_overlay.contract import distribution_version
from mtp_overlay.testing.releases import megatron_main_site, release_site, run_with_release, snapshot_of

RELEASES = {  # a distribution not named here is measured at the venv's pinned release only
    "megatron-core": ["0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2"],
    "vllm": ["0.25.1", "0.33.0"],
}
ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "docs" / "SUPPORT.md"
MAIN_SNAPSHOTS = ROOT / ".cache" / "megatron-lm-main"
MAIN_LABEL = "Megatron-LM main @ {short} ({date})"
MAIN_ROW = re.compile(r"^\| [\w-]+ \| megatron-core \| Megatron-LM main @ ")

MEASURE = """
import json, warnings
warnings.simplefilter("ignore")
from mtp_overlay import registry
from mtp_overlay.testing.reproducers import stock_run
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


def main_snapshot(source):
    """The importable snapshot folder for ``--megatron-main SOURCE`` (a git directory or a snapshot folder)."""
    source = Path(source)
    if snapshot_of(source) is not None:
        return source
    if not (source / "HEAD").is_file() and not (source / ".git").exists():
        raise SystemExit(f"--megatron-main: {source} is neither a Megatron-LM git directory nor a snapshot folder")
    try:
        return megatron_main_site(source / ".git" if (source / ".git").exists() else source, MAIN_SNAPSHOTS)
    except ValueError as exc:
        raise SystemExit(f"--megatron-main: {exc}") from None


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
    parser.add_argument("--only", action="append", metavar="FIX", choices=declarations.names(),
                        help="measure this fix only (repeatable); the other fixes' rows are kept as they are")
    return parser.parse_args(argv)


def fix_of(line):
    """The fix id a row of the table names."""
    return line.split("|")[1].strip()


def main(argv=None):
    args = parse_args(argv)
    snapshot = main_snapshot(args.megatron_main) if args.megatron_main else None
    measured = {distribution: [name for name in names if args.only is None or name in args.only]
                for distribution, names in fixes_by_distribution().items()}
    rows = []
    for distribution, names in measured.items():
        for version in releases_of(distribution) if names else ():
            print(f"measuring {distribution} {version or distribution_version(distribution)}", file=sys.stderr)
            rows += measure(distribution, release_site(distribution, version) if version else "", names)
    if snapshot is not None and measured.get("megatron-core"):
        facts = snapshot_of(snapshot)
        print(f"measuring megatron-core from Megatron-LM main {facts['short']} ({facts['date']})", file=sys.stderr)
        for row in measure("megatron-core", snapshot, measured["megatron-core"]):
            if row["version"] != facts["version"]:
                raise SystemExit(f"{snapshot}: megatron-core answered {row['version']}, not the snapshot's {facts['version']}")
            rows.append(dict(row, label=MAIN_LABEL.format(**facts)))
    order = declarations.names()
    rows.sort(key=lambda row: (order.index(row["name"]), "label" in row, Version(row["version"])))
    # kept from the table as it is: the main rows when no snapshot was given and, with --only, every row
    # of the fixes not measured
    remeasured = {name for names in measured.values() for name in names}
    kept = [] if not SUPPORT.exists() else [
        line for line in SUPPORT.read_text().splitlines()
        if (snapshot is None and MAIN_ROW.match(line)) or (
            args.only and line.startswith("| ") and not line.startswith(("| fix |", "| --- |"))
            and fix_of(line) not in remeasured)
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
        "measured the same way; CI checks only the rows of the installed versions.",
        "",
        "| fix | distribution | version | probe | reason | stock run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines_of = {}
    for line in [table_line(row) for row in rows] + kept:  # a fix's kept rows after its measured ones
        lines_of.setdefault(fix_of(line), []).append(line)
    body = [line for name in order for line in lines_of.get(name, ())]
    SUPPORT.parent.mkdir(exist_ok=True)
    SUPPORT.write_text("\n".join(lines + body) + "\n")
    print(f"wrote {SUPPORT}" + (f" (kept {len(kept)} rows as they were)" if kept else ""))


if __name__ == "__main__":
    main()
