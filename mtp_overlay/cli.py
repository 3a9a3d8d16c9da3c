"""`mtp-overlay`: a thin command-line face over the package's API.

Exit codes: 0 done, 1 the command ran and found a problem it was asked to fail on, 2 usage.
"""

import argparse
import json
import sys

from . import registry, startup
from .patching import command as patch_command

STATUS_COLUMNS = ["name", "distribution", "version", "state", "patched", "reason"]
CHECK_COLUMNS = ["name", "distribution", "version", "verdict", "reason"]


def print_table(rows, columns):
    widths = [max(len(str(row.get(c, ""))) for row in rows + [{c: c for c in columns}]) for c in columns]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)).rstrip())


def _rows(rows, args, columns):
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    else:
        print_table([row.as_dict() for row in rows], columns)


def _status(args):
    _rows(registry.status(), args, STATUS_COLUMNS)
    return 0


def _check(args):
    from .contract import State

    registry.uninstall(args.only)  # probe the stock code: no hook fires (or raises) while targets import
    rows = registry.check(args.only)
    if args.run_stock:
        _cross_check(rows)
    _rows(rows, args, CHECK_COLUMNS)
    failing = set(State.FAILING) | ({State.REDUNDANT} if args.fail_on_redundant else set())
    return 1 if any(row.verdict in failing for row in rows) else 0


def _cross_check(rows):
    """Run each probed fix's stock code path (the test bed's reproducer) and compare: a probe that
    reads the code one way while the code behaves the other is `State.DISAGREES`."""
    from .contract import State
    from .testing.reproducers import StockPathNotRun, stock_run  # the test bed, reached only from `check --run`

    for row in rows:
        if row.verdict not in (State.NEEDED, State.REDUNDANT):
            continue
        try:
            shows, evidence = stock_run(row.name)
        except StockPathNotRun as exc:
            row.reason += f"; {exc}"
            continue
        ran = State.NEEDED if shows else State.REDUNDANT
        if ran != row.verdict:
            row.reason = f"the probe says {row.verdict} ({row.reason}) but the stock run says {ran}: {evidence}"
            row.verdict = State.DISAGREES


def _demo(args):
    from .testing import demo  # the test bed, reached only from this command

    return demo.main()


def build_parser():
    parser = argparse.ArgumentParser(prog="mtp-overlay", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="state of every fix in this process")
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=_status)
    check = commands.add_parser("check", help="probe every fix against the installed upstream (for CI)")
    check.add_argument("--json", action="store_true")
    check.add_argument("--only", action="append", metavar="FIX", help="this fix only (repeatable)")
    check.add_argument("--fail-on-redundant", action="store_true", help="exit 1 when a fix is already upstream")
    check.add_argument("--run", action="store_true", dest="run_stock",
                       help="also run each fix's stock code path (test bed) and report a disagreement with the probe")
    check.set_defaults(run=_check)
    demo = commands.add_parser("demo", help="the tiny GPT+MTP on 2 gloo ranks, each fix off and on")
    demo.set_defaults(run=_demo)
    patch_command.add_parser(commands)
    startup.add_parser(commands)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader left (`mtp-overlay status | head`): nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except (ValueError, OSError) as exc:  # bad names, paths, permissions: usage, not a crash
        print(f"mtp-overlay {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
