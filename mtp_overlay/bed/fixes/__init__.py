"""Reproducers, keyed by fix id: each module ``<fix id with underscores>.py`` has ``reproduce()``,
which runs the stock upstream code path with the fix off and returns ``(bug_shows, evidence)``.

The behavioural half of upstream tracking (the probe reads the code, this runs it): the support
matrix, ``pytest --pyargs mtp_overlay.upstream_tests`` and ``mtp-overlay check --run`` reach them
through `stock_run`, the tests through `reproduce`.
"""

import importlib
import re
import traceback


class StockPathNotRun(RuntimeError):
    """The test bed could not run a fix's stock code path on the installed upstream.

    Not a verdict on the fix: the upstream changed under the test bed (a new module, a new
    requirement such as Transformer Engine) and the test bed needs updating. ``str()`` is the one
    wording every report uses; ``reason`` is where and why it broke.
    """

    def __init__(self, fix_id, distribution, version, reason):
        self.fix_id, self.distribution, self.version, self.reason = fix_id, distribution, version, reason
        super().__init__(
            f"could not run the stock path on {distribution} {version}: {reason}; the test bed needs updating"
        )


def reproduce(fix_id):
    """Run fix ``fix_id``'s reproducer; ``(bug_shows, evidence)``."""
    return importlib.import_module(f"{__name__}.{fix_id.replace('-', '_')}").reproduce()


def stock_run(fix_id):
    """`reproduce` for upstream tracking: any failure to run becomes `StockPathNotRun`, naming the
    upstream distribution and version, the error and where in the code it was raised."""
    from mtp_overlay import declarations
    from mtp_overlay.contract import distribution_version

    try:
        return reproduce(fix_id)
    except Exception as exc:
        distribution = declarations.load(fix_id).distribution
        failure = StockPathNotRun(fix_id, distribution, distribution_version(distribution), failure_reason(exc))
    raise failure  # outside the except block: the report carries no chained traceback


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


def failure_reason(exc):
    """``"<error type>: <message> (at <file>:<line>)"`` of the innermost error of ``exc``.

    A `RanksFailed` (the ranks' tracebacks as text) is read from the first rank that raised: its
    traceback's last line is the error, its last frame where it was raised. Paths start at the package
    (``megatron/core/...``).
    """
    failed = [result for result in getattr(exc, "results", ()) if getattr(result, "error", None)]
    failed.sort(key=lambda result: "Traceback" not in result.error)  # a raised error before "was killed"
    if failed:
        lines = [line for line in failed[0].error.splitlines() if line.strip()]
        error = lines[-1].strip() if lines else f"rank {failed[0].rank} failed"
        frames = [match for match in map(_FRAME.match, lines) if match]
        where = (frames[-1]["file"], frames[-1]["line"]) if frames else None
    else:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        error = f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
        frames = traceback.extract_tb(exc.__traceback__)
        where = (frames[-1].filename, frames[-1].lineno) if frames else None
    return error if where is None else f"{error} (at {_short_path(where[0])}:{where[1]})"


def _short_path(path):
    """``path`` relative to the longest ``sys.path`` folder holding it (``megatron/core/x.py``), else as is."""
    import os
    import sys

    path = os.path.abspath(path)
    roots = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    holding = [root for root in roots if path.startswith(root.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, max(holding, key=len)) if holding else path
