"""`mtp-overlay`: a thin command-line face over the package's API.

Exit codes: 0 done, 1 the command ran and found a problem it was asked to fail on, 2 usage.
"""

import argparse
import contextlib
import json
import sys

from . import registry, startup
from .patching import command as patch_command

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from .contract import FixStatus

STATUS_COLUMNS = ["name", "distribution", "version", "state", "patched", "reason"]
CHECK_COLUMNS = ["name", "distribution", "version", "verdict", "reason"]


def print_table(rows: "list[dict[str, object]]", columns: "list[str]") -> None:
    widths = [max(len(str(row.get(c, ""))) for row in rows + [{c: c for c in columns}]) for c in columns]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)).rstrip())


def _rows(rows: "list[FixStatus]", args: argparse.Namespace, columns: "list[str]") -> None:
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    else:
        print_table([{**row.as_dict(), "run": str(row.run)} for row in rows], columns)


def _status(args: argparse.Namespace) -> int:
    from .patching.survey import patched_on_disk

    _rows(registry.status(patched=patched_on_disk), args, STATUS_COLUMNS)
    return 0


def _check(args: argparse.Namespace) -> int:
    from .contract import State

    registry.uninstall(args.only)  # probe the stock code: no hook fires (or raises) while targets import
    stock_run: "Callable[[str], tuple[bool, str]] | None" = None
    imports: "contextlib.AbstractContextManager[None]" = contextlib.nullcontext()
    if args.run_stock:
        from .testing import reproducers  # the test bed, reached only from `check --run`
        from .testing.bridge import import_stand_ins

        stock_run = reproducers.stock_run
        # the targets import as the stock runs do: where an optional package of Bridge's is missing
        # (Transformer Engine, ModelOpt... on a CPU machine), through the test bed's scoped stand-ins
        imports = import_stand_ins()
    with imports, _stdout_to_stderr():
        rows = registry.check(args.only, stock_run=stock_run)
    _rows(rows, args, CHECK_COLUMNS + (["run"] if args.run_stock else []))
    failing = set(State.FAILING) | ({State.REDUNDANT} if args.fail_on_redundant else set())
    return 1 if any(row.verdict in failing for row in rows) else 0


@contextlib.contextmanager
def _stdout_to_stderr() -> "Iterator[None]":
    """While the block runs, whatever this process and the processes it starts print goes to stderr,
    so that stdout is the report alone (``--json``: parseable): the targets' imports print
    (megatron-core 0.19's ``megatron/training/training.py``, which Bridge imports, logs INFO to
    stdout), and so do the test bed's ranks under ``--run``. Python objects made meanwhile keep
    stderr (a log handler)."""
    import os

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _demo(args: argparse.Namespace) -> int:
    from .testing import demo  # the test bed, reached only from this command

    return demo.main()


def _new_fix(args: argparse.Namespace) -> int:
    from . import scaffold

    targets = [scaffold.target_argument(value) for value in args.target or ()]
    written = scaffold.new_fix(args.fix_id, args.distribution, targets, summary=args.summary)
    for path in written:
        print(f"wrote {path}")
    print(scaffold.next_steps(args.fix_id))
    return 0


def build_parser() -> argparse.ArgumentParser:
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
                       help="also run each fix's stock code path (test bed) and report a disagreement with the probe; "
                       "the targets then import as in the test bed (Bridge's missing optional packages stood in)")
    check.set_defaults(run=_check)
    demo = commands.add_parser("demo", help="the tiny GPT+MTP on 2 gloo ranks, each fix off and on")
    demo.set_defaults(run=_demo)
    new_fix = commands.add_parser(
        "new-fix", help="scaffold a fix in this source checkout: declaration, module, README, tests, reproducer",
        description="Write the files of a new fix (its probe and wrappers refuse to install until written) and "
                    "regenerate the table and the READMEs' facts. Only in a source checkout of mtp-overlay.")
    new_fix.add_argument("fix_id", metavar="FIX_ID", help="lowercase words joined by '-', e.g. bridge-mtp-config")
    new_fix.add_argument("--distribution", required=True, help="the upstream distribution, as pip names it")
    new_fix.add_argument("--target", action="append", metavar="ROLE=MODULE",
                         help="a module whose import installs the fix, named by its role (repeatable; at least one)")
    new_fix.add_argument("--summary", help="what the fix does, one line (default: a placeholder to edit)")
    new_fix.set_defaults(run=_new_fix)
    patch_command.add_parser(commands)
    startup.add_parser(commands)
    return parser


def main(argv: "list[str] | None" = None) -> int:
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
