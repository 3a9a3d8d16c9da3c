"""`mtp-overlay`: a thin command-line face over the package's API.

Exit codes: 0 done, 1 the command ran and found a problem it was asked to fail on, 2 usage. A
reader that leaves early (``| head``, ``| true``) changes none of them.
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
    from typing import Any, TextIO

    from .contract import FixStatus

STATUS_COLUMNS = ["name", "distribution", "version", "state", "patched", "reason"]
CHECK_COLUMNS = ["name", "distribution", "version", "verdict", "probed", "patched", "reason"]


def print_table(rows: "list[dict[str, Any]]", columns: "list[str]", verbose: bool = False) -> None:
    """One line per row; ``verbose``: then one indented line per target module of a `check` row."""
    widths = [max(len(str(row.get(c, ""))) for row in rows + [{c: c for c in columns}]) for c in columns]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)).rstrip())
        for target in row.get("targets", ()) if verbose else ():
            print(f"    {target['module']}: {target['verdict'] or 'missing'} ({target['probed'] or 'not found'}): "
                  f"{target['reason']}")


def _rows(rows: "list[FixStatus]", args: argparse.Namespace, columns: "list[str]") -> None:
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    else:
        print_table([{**row.as_dict(), "run": str(row.run)} for row in rows], columns, getattr(args, "verbose", False))


def _status(args: argparse.Namespace) -> int:
    from .patching.survey import patched_on_disk

    _rows(registry.status(patched=patched_on_disk), args, STATUS_COLUMNS)
    return 0


def _check(args: argparse.Namespace) -> int:
    """The probe's verdict per fix. Each row's ``state`` and ``patched`` are those `status` reports
    in this process before check takes the hooks off to probe the stock code (its own uninstall
    would otherwise make every row say "disabled"), ``patched`` read from disk."""
    from .contract import State
    from .patching.survey import patched_on_disk

    before = {row.name: row for row in registry.status(args.only, patched=patched_on_disk)}
    registry.uninstall(args.only)  # probe the stock code: no hook fires (or raises) while targets import
    stock_run: "Callable[[str], tuple[bool, str]] | None" = None
    imports: "contextlib.AbstractContextManager[None]" = contextlib.nullcontext()
    if args.run_stock:
        from .bed import fixes as reproducers  # the test bed, reached only from `check --run`
        from .bed.models.bridge import import_stand_ins

        stock_run = reproducers.stock_run
        # the targets import as the stock runs do: where an optional package of Bridge's is missing
        # (Transformer Engine, ModelOpt... on a CPU machine), through the test bed's scoped stand-ins
        imports = import_stand_ins()
    with imports, _stdout_to_stderr():
        rows = registry.check(args.only, stock_run=stock_run)
    for row in rows:
        row.state, row.patched = before[row.name].state, before[row.name].patched
    failing = set(State.FAILING) | ({State.REDUNDANT} if args.fail_on_redundant else set())
    code = 1 if any(row.verdict in failing for row in rows) else 0
    _rows(rows, args, CHECK_COLUMNS + (["run"] if args.run_stock else []))
    return code


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
    from .bed.engines import demo  # the test bed, reached only from this command

    code: int = demo.main()
    return code


def _verify(args: argparse.Namespace) -> int:
    from .verification import verify

    try:
        report = verify(
            args.hf_config, provider=args.provider, tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp, pp=args.pp,
            sp=args.sp, world_size=args.world_size, packing=args.packing, loss=args.loss, forward=args.forward,
            mtp_mask=args.mtp_mask, mtp_num_layers=args.mtp_num_layers, repeated_layer=args.repeated_layer,
            scatter_embedding=args.scatter_embedding, layers=args.layers, data=args.data,
            pad_multiple=args.pad_multiple,
            tolerance=args.tolerance, max_ranks=args.max_ranks, search=not args.no_search, log=args.log,
        )
    except RuntimeError as exc:  # the test bed could not run at all: not a verdict on the overlay
        print(f"mtp-overlay verify: could not run: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return report.exit_code


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"must be on or off, got {value!r}")
    return value == "on"


def _add_verify(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from . import verification

    verify = commands.add_parser(
        "verify", help="prove on CPU that your config and layout train the MTP head on the right tokens",
        description="Shrink your model config to CPU size (keeping its shape), run your layout on gloo ranks "
                    "through Megatron's own step, stock and with the overlay, and hold every step to each "
                    "sequence run alone (TP1, unpacked) and to the positions the mask allows. Exit 0: the "
                    "overlay's MTP training equals the references; 1: it differs; 2: bad input.")
    source = verify.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", metavar="PATH",
                        help="a Hugging Face config: a folder with config.json, or the file")
    source.add_argument("--provider", metavar="MODULE:NAME",
                        help="a Megatron-Bridge provider, its class, or a function returning one or a recipe's "
                             "ConfigContainer (MODULE:NAME or FILE.py:NAME)")
    for flag, what in (("--tp", "tensor"), ("--cp", "context"), ("--ep", "expert"), ("--pp", "pipeline")):
        verify.add_argument(flag, type=int, default=1, help=f"{what}-parallel size (default 1)")
    verify.add_argument("--etp", type=int, help="expert tensor-parallel size (default: megatron-core's, the TP size)")
    verify.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    verify.add_argument("--world-size", type=int, help="ranks (default: the fewest that hold the layout)")
    verify.add_argument("--packing", choices=verification.PACKINGS,
                        help="none (BSHD rows), thd-padded (NeMo-RL's default: cu_seqlens_q padded) or "
                             "thd-real-lengths (real lengths in cu_seqlens_q); default thd-padded (none for a VL / "
                             "Omni model)")
    verify.add_argument("--loss", choices=verification.LOSSES, default="per-token",
                        help="per-token (calculate_per_token_loss), 2-output or 3-output; default per-token")
    verify.add_argument("--forward", choices=("rl", "sft"),
                        help="rl: no labels, Megatron derives the MTP labels (default); sft: labels passed (the "
                             "default and the only choice for a VL / Omni model)")
    verify.add_argument("--mtp-mask", choices=verification.MASKS, default="passed",
                        help="how the trainer gives the MTP head its mask: passed as loss_mask (default) or "
                             "scoped with mtp_overlay.mtp.loss_mask_scope")
    verify.add_argument("--mtp-num-layers", type=int, help="MTP depth (default: the config's)")
    verify.add_argument("--repeated-layer", type=_on_off, metavar="{on,off}",
                        help="one MTP layer repeated at every depth (default: the config's, or Bridge's)")
    verify.add_argument("--scatter-embedding", type=_on_off, metavar="{on,off}",
                        help="scatter_embedding_sequence_parallel (default: the config's, or the provider's)")
    verify.add_argument("--layers", choices=("auto", "all", "runs"), default="auto",
                        help="keep every layer (all), every distinct run of one layer kind (runs), or all up to "
                             "16 layers (auto, default)")
    verify.add_argument("--data", metavar="JSONL",
                        help='a sample of your data: one {"tokens": N, "prompt": P} per line (a VL / Omni model: '
                             'also "images": [positions of the image placeholders])')
    verify.add_argument("--pad-multiple", type=int, help="your packer's per-sequence padding (default NeMo-RL's)")
    verify.add_argument("--tolerance", type=float, default=1e-4, help="largest relative error that counts as equal")
    verify.add_argument("--max-ranks", type=int, default=8, help="most processes to start (default 8)")
    verify.add_argument("--no-search", action="store_true", help="do not look for the smallest layout of a difference")
    verify.add_argument("--log", help="file for the ranks' output (default: a temporary file)")
    verify.add_argument("--json", action="store_true", help="the report as JSON (for CI)")
    verify.set_defaults(run=_verify)


def _new_fix(args: argparse.Namespace) -> int:
    from . import scaffold

    targets = [scaffold.target_argument(value) for value in args.target or ()]
    written = scaffold.new_fix(args.fix_id, args.distribution, targets, summary=args.summary)
    for path in written:
        print(f"wrote {path}")
    print(scaffold.next_steps(args.fix_id))
    return 0


def _lint_media(args: argparse.Namespace) -> int:
    from .fixes.hf_media_placeholders.lint import lint_media

    def progress(rows: int) -> None:
        print(f"mtp-overlay lint-media: {rows} rows", file=sys.stderr, flush=True)

    report = lint_media(args.data, args.processor, progress=progress)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return report.exit_code


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
    check.add_argument("-v", "--verbose", action="store_true", help="each target module's verdict under its fix")
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
    _add_verify(commands)
    lint = commands.add_parser(
        "lint-media", help="rows of a chat dataset whose media placeholders differ from their structured media",
        description="Render each row's messages with the processor's own chat template, stock and with "
                    "hf-media-placeholders, and report the rows whose placeholder tokens differ from their "
                    "structured media items, by source when the rows have a \"source\" field. CPU only, no "
                    "weights. Exit 0: clean; 1: mismatches found; 2: bad input (a malformed line named).")
    lint.add_argument("data", metavar="DATA.jsonl", help='one JSON object per line, its "messages" the conversation '
                      "as apply_chat_template takes it")
    lint.add_argument("--processor", required=True, metavar="DIR",
                      help="a local processor folder: tokenizer, chat template, processor config")
    lint.add_argument("--json", action="store_true", help="the report as JSON")
    lint.set_defaults(run=_lint_media)
    patch_command.add_parser(commands)
    startup.add_parser(commands)
    return parser


class _ReaderMayLeave:
    """``sys.stdout`` while a command runs: a reader that leaves early (``mtp-overlay status | head``,
    ``| true``) ends the output, not the command, whose exit code stays its own (1 only for what it
    found). What is still buffered and every later write go to os.devnull, so the flush at exit
    raises no second error either."""

    def __init__(self, stream: "TextIO") -> None:
        self.stream, self.left = stream, False

    def write(self, text: str) -> int:
        if not self.left:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self.left:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def _reader_left(self) -> None:
        import os

        self.left = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)
        try:
            self.stream.flush()  # the bytes the closed pipe refused, now into os.devnull
        except OSError:
            pass

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


def main(argv: "list[str] | None" = None) -> int:
    args = build_parser().parse_args(argv)
    stdout = sys.stdout
    sys.stdout = output = _ReaderMayLeave(stdout)
    try:
        code: int = args.run(args)
        output.flush()  # inside the command: a reader gone before the last bytes is still no failure
        return code
    except (ValueError, OSError) as exc:  # bad names, paths, permissions, configs: usage, not a crash
        print(f"mtp-overlay {args.command}: {exc}", file=sys.stderr)
        return 2
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
