"""install / uninstall / status / check over the fixes of the generated table.

`mtp_overlay.table` (ids, target modules, requirements) is all that ``import mtp_overlay`` reads. A
fix's code (``mtp_overlay/fixes/<fix id>/``) and the lifecycle machinery load only when one of its
targets is imported, or when `status()` / `check()` ask about it. Whether a source patch is on disk
and what the stock code does when run are handed in by the caller (`status(patched=...)`,
`check(stock_run=...)`): the registry never reads the test bed, and the patch engine only where
`check()` reads the installed source of a target that cannot import here.
"""

import os

from . import hooks, table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import ModuleType

    from .contract import Declaration, FixStatus, StockRun, Verdict
    from .fixes import Fix
    from .lifecycle import Lifecycle

_strict: "dict[str, bool]" = {}  # fix id -> strict, for a fix installed before its Lifecycle exists
_disabled: "dict[str, str]" = {}  # fix id -> why it is disabled (the requirement check of `install`)
_callbacks: "dict[str, _Hook]" = {}  # fix id -> its post-import callback (one object per fix, so it can be cancelled)


def __getattr__(name: str) -> object:
    if name == "FIXES":  # the table's, read when asked (a test may register a fix in it)
        return table.FIXES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> "list[str]":
    """The fix ids, in the table's (install) order."""
    return [name for name, _ in table.FIXES]


def lifecycle(name: str) -> "Lifecycle":
    """The Lifecycle of fix ``name`` in this process; ValueError listing the known ids otherwise."""
    from . import lifecycle as lifecycles

    found = lifecycles.of(name)
    if name in _strict:
        found.strict = _strict.pop(name)
    return found


def get(name: str) -> "Fix":
    """The Fix of fix ``name`` (its module is imported)."""
    from .fixes import Fix

    found = lifecycle(name).fix
    if not isinstance(found, Fix):
        raise TypeError(f"fix {name!r}: its module's FIX must be a mtp_overlay.fixes.Fix, got {found!r}")
    return found


def _select(names_or_name: "str | Iterable[str] | None") -> "list[str]":
    if names_or_name is None:
        return names()
    selected = [names_or_name] if isinstance(names_or_name, str) else list(names_or_name)
    known = names()
    for name in selected:
        if name not in known:
            raise ValueError(f"unknown fix {name!r}: expected one of {', '.join(known)}")
    return selected


STRICT_ON, STRICT_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def strict_from_env() -> bool:
    """``MTP_OVERLAY_STRICT``: on for 1/true/yes/on, off for unset/0/false/no/off (any case); anything
    else is a typo the user must hear about: off, with a warning."""
    raw = os.environ.get("MTP_OVERLAY_STRICT", "")
    value = raw.strip().lower()
    if value in STRICT_ON:
        return True
    if value not in STRICT_OFF:
        _warn(f"MTP_OVERLAY_STRICT={raw!r} is not one of {', '.join(STRICT_ON)} (on) or "
              f"{', '.join(v for v in STRICT_OFF if v)} (off): strict mode stays off")
    return False


def _warn(message: str) -> None:
    import warnings

    from .contract import OverlayWarning

    warnings.warn(OverlayWarning("mtp-overlay: " + message), stacklevel=4)


def disabled_from_env(strict: bool = False) -> "set[str]":
    """Names switched off by ``MTP_OVERLAY_DISABLE=name,name`` or ``=all``.

    An unknown name is a typo the user must hear about, but runs at import (often from the startup
    hook), so it warns and is ignored; strict mode raises.
    """
    raw = {part.strip() for part in os.environ.get("MTP_OVERLAY_DISABLE", "").split(",") if part.strip()}
    known = set(names())
    if "all" in raw:
        return known
    for name in sorted(raw - known):
        message = f"MTP_OVERLAY_DISABLE names unknown fix {name!r}: expected 'all' or any of {', '.join(sorted(known))}"
        if strict:
            from .contract import OverlayError

            raise OverlayError(message)
        _warn(message)
    return raw & known


class _Hook:
    """Fix ``name``'s post-import callback (one object per fix, so it can be cancelled)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: "ModuleType") -> None:
        lifecycle(self.name).on_import(module)

    def failed(self, target: str, error: BaseException) -> None:
        lifecycle(self.name).cannot_hook(target, error)


def _callback(name: str) -> _Hook:
    found = _callbacks.get(name)
    if found is None:
        found = _callbacks.setdefault(name, _Hook(name))
    return found


def install(only: "str | Iterable[str] | None" = None, skip: "str | Iterable[str] | None" = (),
            strict: "bool | None" = None) -> None:
    """Install the selected fixes: each waits for its target modules (at once if already imported).

    ``only``/``skip``: fix ids. ``strict`` (default ``MTP_OVERLAY_STRICT``): drift and hook failures
    raise OverlayError instead of warning. A fix whose required fix (its declaration's ``requires``)
    is disabled is not installed: `State.FAILED`, naming it.
    """
    if strict is None:
        strict = strict_from_env()
    elif not isinstance(strict, bool):
        raise TypeError(f"install(strict=...) must be True, False or None (MTP_OVERLAY_STRICT), got {strict!r}")
    skipped = set(_select(skip or ()))
    env_disabled = disabled_from_env(strict)
    asked = set(_select(only))
    selected = [name for name in names() if name in asked]  # the table's order: wrappers stack as declared
    for name in selected:
        if name in env_disabled or name in skipped:
            _remove(name, "disabled by " + ("MTP_OVERLAY_DISABLE" if name in env_disabled else "install(skip=...)"))
    for name in selected:
        if name in env_disabled or name in skipped:
            continue
        _disabled.pop(name, None)
        blocked = [f"fix {required!r}, which is {_disabled[required]}" for required in table.REQUIRES.get(name, ())
                   if required in _disabled]
        if blocked:
            _refuse(name, strict, "requires " + "; ".join(blocked))
            continue
        known = _lifecycle_if_made(name)
        if known is None:
            _strict[name] = strict
        else:
            known.enable(strict)
        for target in dict(table.FIXES)[name]:
            if known is not None and known.handled(target):  # probed (and installed) already
                continue
            if hooks.when_imported(target, _callback(name)):
                lifecycle(name).late = True


def _lifecycle_if_made(name: str) -> "Lifecycle | None":
    """Fix ``name``'s Lifecycle if one exists already (none does before the first target's import:
    ``import mtp_overlay`` must not load the lifecycle machinery)."""
    import sys

    made = sys.modules.get(__package__ + ".lifecycle")
    return None if made is None else made._lifecycles.get(name)


def _refuse(name: str, strict: bool, reason: str) -> None:
    for target in dict(table.FIXES)[name]:
        hooks.cancel(target, _callback(name))
    found = lifecycle(name)
    found.strict = strict
    found.fail(reason)


def uninstall(only: "str | Iterable[str] | None" = None) -> None:
    """Remove the selected fixes: cancel waiting hooks, restore every original object."""
    for name in _select(only):
        _remove(name, "uninstalled")


def _remove(name: str, reason: str) -> None:
    for target in dict(table.FIXES)[name]:
        hooks.cancel(target, _callback(name))
    _disabled[name] = reason
    lifecycle(name).disable(reason)


def status(only: "str | Iterable[str] | None" = None, *,
           patched: "Callable[[Declaration], bool | None] | None" = None) -> "list[FixStatus]":
    """One FixStatus per fix: its state in this process (`State.RUNTIME`), upstream distribution and
    version, reason, late, ``details`` (what an installed fix has seen: `Fix.details`), and ``patched``: what ``patched(declaration)`` says of its source patch on
    disk (True, False, None: no patch fits; the CLI hands in `mtp_overlay.patching.survey.patched_on_disk`),
    None when no ``patched`` is given."""
    from .contract import FixStatus, State, distribution_version

    rows = []
    for name in _select(only):
        found = lifecycle(name)
        declaration = found.declaration
        state, reason = found.state()
        version = distribution_version(declaration.distribution)
        if version is None and state == State.PENDING:
            state, reason = State.ABSENT, f"{declaration.distribution} is not installed"
        on_disk = patched(declaration) if patched is not None and version is not None else None
        details = found.details()
        if details.get("note"):
            reason = f"{reason}; {details['note']}"
        row = FixStatus(declaration, version, state, reason, found.late, on_disk)
        row.details = details
        rows.append(row)
    return rows


def check(only: "str | Iterable[str] | None" = None, *,
          stock_run: "Callable[[str], tuple[bool, str]] | None" = None) -> "list[FixStatus]":
    """Probe every fix against the installed upstream code (imports its targets): the CI question.

    One FixStatus per fix with its ``verdict`` (`State.VERDICTS`): needed / redundant / drifted /
    failed, ``absent`` without the distribution. A target that does not import on this machine
    because a package it needs is missing (an ImportError: Megatron-Bridge without Transformer
    Engine) is read from its installed source instead (`mtp_overlay.patching.survey.source_verdict`);
    one whose import fails otherwise, or whose file cannot be read or parsed, is ``unsupported``. A
    target module missing from the installed release is skipped; all missing is drift. ``probed``
    says how the verdict was reached (`contract.FixStatus`), ``targets`` each target's verdict; the
    ``reason`` is the deciding target's, once.

    A module whose import failed once fails the same way for the rest of the call, whatever imports
    it later: a release whose first import fails can leave state behind on which a second import
    "succeeds" half-initialised (megatron-core 0.15.3's torch extension build), and a verdict must not
    depend on which fixes are checked together.

    ``stock_run``: ``fix id -> (bug shows, evidence)``, the fix's stock code path run with the fix
    off (the test bed's `mtp_overlay.bed.fixes.stock_run`), raising an exception whose
    one-line ``str()`` says why when it cannot run. Given one, every row the probe finds needed or
    redundant is run too; its `StockRun` goes in ``row.run``, and a run that behaves the other way
    than the probe reads makes the verdict `State.DISAGREES` (an upstream fix in another spelling).
    """
    import sys

    from .contract import FixStatus, State, distribution_version, drifted

    rows = []
    imports = _FailingOnce()
    sys.meta_path.insert(0, imports)
    try:
        for name in _select(only):
            found = lifecycle(name)
            declaration = found.declaration
            state = found.state()[0]
            version = distribution_version(declaration.distribution)
            if version is None:
                row = FixStatus(declaration, None, state, f"{declaration.distribution} is not installed",
                                verdict=State.ABSENT)
            else:
                probes = [_probe_target(found, target, imports) for target in found.targets]
                verdicts = [(target, v, how) for target, v, how in probes if v is not None]
                if not verdicts:
                    missing = drifted("no target module exists in this release")
                    verdicts.append((", ".join(found.targets), missing, None))
                verdict = next(s for s in State.VERDICT_PRIORITY if any(v.state == s for _, v, _ in verdicts))
                deciding = [(target, v, how) for target, v, how in verdicts if v.state == verdict]
                target, first, probed = deciding[0]
                reason = f"{target}: {first.reason}" if first.reason else target
                if len(deciding) > 1:
                    reason += f" (and {len(deciding) - 1} other target module{'s' if len(deciding) > 2 else ''})"
                row = FixStatus(declaration, version, state, reason, verdict=verdict)
                row.probed = probed
                row.targets = [{"module": target, "verdict": None if v is None else v.state, "probed": how,
                                "reason": "not in this release" if v is None else v.reason}
                               for target, v, how in probes]
            if stock_run is not None:
                row.run = _stock_run(row, stock_run)
                if row.run.outcome is not None and row.run.outcome != row.verdict:
                    row.reason = (f"the probe says {row.verdict} ({row.reason}) but the stock run says "
                                  f"{row.run.outcome}: {row.run.evidence}")
                    row.verdict = State.DISAGREES
            rows.append(row)
    finally:
        sys.meta_path.remove(imports)
    return rows


def _probe_target(found: "Lifecycle", target: str,
                  imports: "_FailingOnce") -> "tuple[str, Verdict | None, str | None]":
    """(target, its Verdict, how it was reached: "imported", "source" or "import failed"); the Verdict
    and how are None for a module the release lacks."""
    from .contract import State, Verdict
    from .lifecycle import judge

    try:
        module = imports.load(target)
    except Exception as exc:
        gone = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if gone and (target == gone or target.startswith(f"{gone}.")):
            return target, None, None
        why = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, ImportError):
            return target, Verdict(State.UNSUPPORTED, f"import failed: {why}"), "import failed"
        from .patching.survey import source_verdict

        verdict = source_verdict(found.declaration, target)
        if verdict is None:
            return target, None, None
        read = f"does not import here ({why}); read from source: {verdict.reason}"
        return target, Verdict(verdict.state, read), "source"
    return target, judge(found.fix, module), "imported"


class _FailingOnce:
    """A meta path finder for the length of a `check`: a module whose import raised once raises the
    same error again, whatever imports it later; the modules whose import raised are those whose
    top-level code the error passed through (Python has taken them out of sys.modules)."""

    def __init__(self) -> None:
        self.failed: "dict[str, Exception]" = {}

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        error = self.failed.get(name)
        if error is not None:
            raise error

    def load(self, name: str) -> "ModuleType":
        import importlib
        import sys
        import traceback

        try:
            return importlib.import_module(name)
        except Exception as exc:
            frames = (frame.f_globals.get("__name__") for frame, _ in traceback.walk_tb(exc.__traceback__)
                      if frame.f_code.co_name == "<module>")
            for failed in (name, *frames):
                if isinstance(failed, str) and failed not in sys.modules:
                    self.failed.setdefault(failed, exc)
            raise


def _stock_run(row: "FixStatus", stock_run: "Callable[[str], tuple[bool, str]]") -> "StockRun":
    """Run ``row``'s stock path when its probe found needed or redundant; what it showed."""
    from .contract import State, StockRun

    if row.verdict not in (State.NEEDED, State.REDUNDANT):
        return StockRun(None, f"not run: the probe says {row.verdict}")
    try:
        shows, evidence = stock_run(row.name)
    except Exception as exc:  # the test bed's StockPathNotRun, or another one-line reason it could not run
        return StockRun(None, str(exc) or type(exc).__name__)
    return StockRun(State.NEEDED if shows else State.REDUNDANT, evidence)
