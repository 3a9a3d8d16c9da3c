"""One fix's life in this process: probe-then-wrap on its targets' import, never stacking wrappers,
restoring the originals by identity, and saying so when it does not apply.

The bookkeeping every fix shares, kept apart from the fixes (a fix declares and probes, this runs
it). A hook error never breaks the upstream import: it records the state and warns, unless strict
mode asks to raise. The process's Lifecycles live here (`of`), one per fix id, each bound to the Fix
it loads, so a fix reaches its own (strict flag, report) and its declared peers' states without the
registry.
"""

import importlib
import warnings
from _thread import RLock

from . import declarations, table
from .contract import OverlayError, OverlayWarning, State, Verdict

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from types import ModuleType
    from typing import Any, Protocol

    from .contract import Declaration

    class Fix(Protocol):
        """What a Lifecycle runs: `mtp_overlay.fixes.Fix` (named here without importing the layer above)."""

        declaration: Declaration
        _lifecycle: "Lifecycle | None"

        def probe(self, module: ModuleType) -> Verdict: ...

        def wrappers(self, module: ModuleType) -> "Iterable[tuple[Any, str, Any]]": ...

        def details(self) -> "dict[str, Any]": ...


_lifecycles: "dict[str, Lifecycle]" = {}  # fix id -> its Lifecycle, made on first use


def of(fix_id: str) -> "Lifecycle":
    """The Lifecycle of fix ``fix_id`` in this process; ValueError listing the known ids otherwise."""
    found = _lifecycles.get(fix_id)
    if found is None:
        targets = dict(table.FIXES).get(fix_id)
        if targets is None:
            raise ValueError(f"unknown fix {fix_id!r}: expected one of {', '.join(name for name, _ in table.FIXES)}")
        found = _lifecycles.setdefault(fix_id, Lifecycle(fix_id, targets))  # one per id, whichever thread wins
    return found


def judge(fix: "Fix", module: "ModuleType") -> Verdict:
    """``fix``'s probe on ``module``: its Verdict; DRIFTED when one of the fix's own target modules
    is missing (upstream moved it); else FAILED naming what the probe raised.

    The one code path from which both the runtime hook and `check()` take their answer.
    """
    try:
        return fix.probe(module)
    except ModuleNotFoundError as exc:
        if exc.name in fix.declaration.modules:
            return Verdict(State.DRIFTED, f"target module {exc.name} does not exist in this release (moved?)")
        return Verdict(State.FAILED, f"probe raised {type(exc).__name__}: {exc}")
    except Exception as exc:
        return Verdict(State.FAILED, f"probe raised {type(exc).__name__}: {exc}")


class Lifecycle:
    """The state of fix ``name`` (target modules ``targets``) in this process; its Fix is loaded on
    first use (or given: ``fix``)."""

    def __init__(self, name: str, targets: "Iterable[str]", fix: "Fix | None" = None) -> None:
        self.name, self.targets = name, tuple(targets)
        self._fix: "Fix | None" = None
        if fix is not None:
            self._adopt(fix)
        self._lock = RLock()
        self._originals: "dict[tuple[object, str], tuple[object, object]]" = {}  # (owner, attribute) -> (found, ours)
        self._target_states: "dict[str, tuple[str, str]]" = {}  # module name -> (state, reason)
        self.disabled_reason: "str | None" = None
        self.failed_reason: "str | None" = None  # a required fix is disabled: nothing of this one goes in
        self.late = False
        self.strict = False

    @property
    def fix(self) -> "Fix":
        """The Fix, imported from its package (`declarations.package_of`) the first time."""
        if self._fix is None:
            self._adopt(importlib.import_module(declarations.package_of(self.name)).FIX)
        assert self._fix is not None
        return self._fix

    @property
    def declaration(self) -> "Declaration":
        """The fix's Declaration (its Fix's, when one was given)."""
        return self._fix.declaration if self._fix is not None else declarations.load(self.name)

    def _adopt(self, fix: "Fix") -> None:
        fix._lifecycle = self  # a fix whose work goes beyond wrappers records and reports through it
        self._fix = fix

    def peer_state(self, fix_id: str) -> "tuple[str, str]":
        """(state, reason) of fix ``fix_id`` in this process: a fix this one declares it reads or requires."""
        declaration = self.declaration
        if fix_id not in declaration.reads + declaration.requires:
            raise ValueError(f"fix {self.name!r} reads the state of {fix_id!r} but does not declare it: add it to "
                             f"reads= in {declarations.package_of(self.name)}.declaration")
        return of(fix_id).state()

    def on_import(self, module: "ModuleType") -> None:
        """Post-import hook body: never breaks the upstream import unless strict."""
        with self._lock:
            before = set(self._originals)
            try:
                verdict = judge(self.fix, module)
                if verdict.state == State.NEEDED:
                    self.install(module)
                    self.record(module.__name__, State.INSTALLED, verdict.reason)
                    return
                self.record(module.__name__, verdict.state, verdict.reason)
                if verdict.state != State.REDUNDANT:
                    self.report(f"{module.__name__}: {verdict.reason}")
            except (OverlayError, OverlayWarning):  # strict mode, or warnings escalated to errors (-W error)
                raise
            except Exception as exc:
                self.uninstall_wrappers(set(self._originals) - before)  # this target's, not the others'
                self.record(module.__name__, State.FAILED, f"{type(exc).__name__}: {exc}")
                self.report(f"hook on {module.__name__} raised {type(exc).__name__}: {exc}", exc)

    def cannot_hook(self, target: str, error: BaseException) -> None:
        """The import machinery cannot hook ``target`` (wrapt is missing): record it; strict raises."""
        with self._lock:
            self.record(target, State.FAILED, f"wrapt cannot be imported ({type(error).__name__}: {error})")
        if self.strict:
            raise OverlayError(f"mtp-overlay fix {self.name!r} not applied: wrapt cannot be imported: {error}") from error

    def install(self, module: "ModuleType") -> None:
        """Put the fix's wrappers on ``module``; a second call never stacks them.

        An alias bound to one of our own wrappers (``from target import f`` run after ``target`` was
        hooked) gets the original back first, then its own wrapper: never a wrapper around ours, and
        uninstall leaves no wrapper behind in the alias.
        """
        import wrapt

        for owner, attribute, wrapper in self.fix.wrappers(module):
            key = (owner, attribute)
            if key in self._originals:
                continue
            original = vars(owner)[attribute]
            for known, ours in self._originals.values():
                if original is ours:
                    original = known
                    setattr(owner, attribute, original)
                    break
            self._originals[key] = (original, wrapt.wrap_function_wrapper(owner, attribute, wrapper))

    def uninstall_wrappers(self, keys: "Iterable[tuple[object, str]] | None" = None) -> None:
        """Put back the original objects (all, or those of ``keys``), by identity.

        A wrapt wrapper stacked on ours since (another fix's, a user's) stays where it is, and ours is
        taken out from inside it; under any other kind of wrapper ours has to stay (warned).
        """
        import wrapt

        with self._lock:
            for key in list(self._originals if keys is None else keys):
                owner, attribute = key
                original, ours = self._originals.pop(key)
                current = vars(owner).get(attribute)
                if current is ours:
                    # another fix's wrapper we stacked on was taken out from inside ours since: what ours
                    # wraps now is what goes back (the saved one would put that wrapper back)
                    now = getattr(ours, "__wrapped__", original)
                    spliced = isinstance(original, wrapt.BaseObjectProxy) and now is not original
                    setattr(owner, attribute, now if spliced else original)
                    continue
                while isinstance(current, wrapt.BaseObjectProxy) and current.__wrapped__ is not ours:
                    current = current.__wrapped__
                if isinstance(current, wrapt.BaseObjectProxy):
                    current.__wrapped__ = original
                    continue
                where = f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attribute}"
                warnings.warn(OverlayWarning(
                    f"mtp-overlay fix {self.name!r}: {where} was wrapped again after the overlay, not by wrapt; "
                    "left in place (uninstall the outer wrapper first)"), stacklevel=3)

    def disable(self, reason: str) -> None:
        """Take the wrappers off and forget every target's state; ``reason`` is what status says."""
        self.uninstall_wrappers()
        self._target_states.clear()
        self.late = False
        self.disabled_reason, self.failed_reason = reason, None

    def enable(self, strict: bool) -> None:
        """Asked to install (again): neither disabled nor failed any more; drift and failures raise
        when ``strict``."""
        self.disabled_reason = self.failed_reason = None
        self.strict = strict

    def fail(self, reason: str) -> None:
        """Refuse to install (a fix it requires is disabled): the wrappers off, every target's state
        forgotten, `State.FAILED` with ``reason``; warned, or OverlayError when strict."""
        self.disable(reason)
        self.disabled_reason, self.failed_reason = None, reason
        self.report(reason)

    def details(self) -> "dict[str, Any]":
        """The fix's `details` while it is installed (its module loaded), else {}."""
        if self._fix is None or self.state()[0] != State.INSTALLED:
            return {}
        return self._fix.details()

    def wrapped(self) -> "list[tuple[object, str]]":
        """The (owner, attribute) pairs this fix currently wraps."""
        return list(self._originals)

    def handled(self, target: str) -> bool:
        """Whether the import of ``target`` has already been probed (and the fix put in, if needed)."""
        return target in self._target_states

    def state(self) -> "tuple[str, str]":
        """(state, reason) aggregated over the targets imported so far."""
        if self.disabled_reason is not None:
            return State.DISABLED, self.disabled_reason
        if self.failed_reason is not None:
            return State.FAILED, self.failed_reason
        states = self._target_states
        for state in State.RUNTIME_PRIORITY:
            reasons = [f"{name}: {r}" if r else name for name, (s, r) in states.items() if s == state]
            if reasons:
                return state, "; ".join(reasons)
        return State.PENDING, "waiting for import of " + ", ".join(self.targets)

    def record(self, module_name: str, state: str, reason: str) -> None:
        """Set the state of target ``module_name`` (what `status()` reports)."""
        with self._lock:
            self._target_states[module_name] = (state, reason)

    def report(self, message: str, cause: "BaseException | None" = None) -> None:
        """Say the fix did not apply as asked: OverlayWarning, or OverlayError in strict mode."""
        text = f"mtp-overlay fix {self.name!r} not applied: {message}"
        if self.strict:
            raise OverlayError(text) from cause
        warnings.warn(OverlayWarning(text), stacklevel=3)
