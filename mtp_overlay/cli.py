"""`mtp-overlay`: a thin command-line face over the package's API.

Exit codes: 0 done, 1 the command ran and found a problem it was asked to fail on, 2 usage.
"""

import argparse
import json
import sys

from . import registry


def _print_table(rows, columns):
    widths = [max(len(str(row.get(c, ""))) for row in rows + [{c: c for c in columns}]) for c in columns]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)).rstrip())


def _status(args):
    rows = [row.as_dict() for row in registry.status()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows, ["name", "distribution", "version", "state", "reason"])
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="mtp-overlay", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="state of every fix in this process")
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=_status)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
