"""The Fix contract every fix fills in, the states a fix can be in, and the overlay's error types.

Deliberately free of enum/dataclasses/typing: `import mtp_overlay` runs in every interpreter once the
startup hook is installed, and its budget is 15 ms (issue #2).
"""

import os
import warnings
from _thread import RLock


class OverlayError(RuntimeError):
    """A fix could not be applied and strict mode (``MTP_OVERLAY_STRICT=1``) asked to raise."""


class OverlayWarning(UserWarning):
    """A fix did not apply as asked; its own category so users can filter or escalate it."""


class State:
    """Lifecycle of a fix in this process (SPEC section 3)."""

    PENDING = "pending"  # hook waiting for the target's import
    INSTALLED = "installed"
    REDUNDANT = "redundant"  # upstream already carries the fix: stood down
    DRIFTED = "drifted"  # target missing or of an unknown shape: not applied
    DISABLED = "disabled"  # by MTP_OVERLAY_DISABLE, install(skip=...) or uninstall()
    FAILED = "failed"  # the hook raised
    ABSENT = "absent"  # upstream distribution not installed
    # when several targets disagree, the fix reports the first of these
    PRIORITY = (FAILED, DRIFTED, INSTALLED, REDUNDANT)


class Verdict:
    """What a probe found: ``needed``, ``redundant`` or ``drifted``, and why."""

    __slots__ = ("state", "reason")
    NEEDED, REDUNDANT, DRIFTED = "needed", State.REDUNDANT, State.DRIFTED
    # aggregating verdicts over several targets (and probe failures) reports the first of these
    PRIORITY = (State.FAILED, DRIFTED, NEEDED, REDUNDANT)

    def __init__(self, state, reason=""):
        self.state, self.reason = state, reason

    def __repr__(self):
        return f"Verdict({self.state!r}, {self.reason!r})"


def needed(reason=""):
    return Verdict(Verdict.NEEDED, reason)


def redundant(reason):
    return Verdict(Verdict.REDUNDANT, reason)


def drifted(reason):
    return Verdict(Verdict.DRIFTED, reason)


class Provenance:
    """Where a fix comes from and where upstream fixed it (if it did)."""

    __slots__ = ("origin", "upstream_fix", "first_fixed_release")

    def __init__(self, origin, upstream_fix=None, first_fixed_release=None):
        self.origin = origin
        self.upstream_fix = upstream_fix
        self.first_fixed_release = first_fixed_release

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__slots__}


class FixStatus:
    """One row of `mtp_overlay.status()` / `check()`: the fix, its upstream, and where it stands."""

    __slots__ = ("name", "summary", "distribution", "version", "state", "reason", "late", "patched", "provenance")

    def __init__(self, fix, version, state, reason, late, patched=None):
        self.name, self.summary, self.distribution = fix.name, fix.summary, fix.distribution
        self.version, self.state, self.reason, self.late = version, state, reason, late
        self.patched = patched  # source patch on disk: True, False, None (no variant for this install)
        self.provenance = fix.provenance.as_dict() if fix.provenance else None

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self):
        return f"FixStatus({self.as_dict()})"


def strict_from_env():
    return os.environ.get("MTP_OVERLAY_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


class Fix:
    """One fix: what it targets, how it recognises the bug, how it goes in and comes out.

    A fix module defines a subclass filling in the class attributes, `probe` and `wrappers`. The base
    class does the bookkeeping every fix shares: probe-then-wrap on import, never stacking wrappers,
    restoring originals by identity, and reporting (warning, or OverlayError when strict).
    """

    name = ""
    summary = ""
    distribution = ""  # upstream distribution, as importlib.metadata names it
    targets = ()  # modules whose import installs the fix
    provenance = None

    def expected_state(self, version):
        """``redundant`` from the first upstream release carrying the fix on, ``needed`` before it."""
        from packaging.version import Version

        fixed_in = self.provenance.first_fixed_release if self.provenance else None
        if fixed_in is not None and Version(version) >= Version(fixed_in):
            return Verdict.REDUNDANT
        return Verdict.NEEDED

    @property
    def patches(self):
        """Source-patch variants for `mtp-overlay patch`, read from patches/manifest.json on first use."""
        from .patching.manifest import variants_for

        return variants_for(self.name)

    def __init__(self):
        self._lock = RLock()
        self._originals = {}  # (owner, attribute) -> (object found in owner.__dict__, our wrapper)
        self._target_states = {}  # module name -> (state, reason)
        self.disabled_reason = None
        self.late = False
        self.strict = False

    # --- filled in by each fix -------------------------------------------------------------
    def probe(self, module):
        """Return a Verdict for the imported target ``module``."""
        raise NotImplementedError

    def wrappers(self, module):
        """Yield ``(owner, attribute, wrapper)``: wrapt-style wrappers to put on ``module``."""
        return ()

    def reproduce(self):
        """Run the stock upstream code path with this fix off; return (bug shows, evidence text).

        The behavioural half of upstream tracking: `probe` reads the code, this runs it.
        """
        raise NotImplementedError

    # --- shared lifecycle ------------------------------------------------------------------
    def on_import(self, module):
        """Post-import hook body: never breaks the upstream import unless strict."""
        with self._lock:
            before = set(self._originals)
            try:
                verdict = self.probe(module)
                if verdict.state == Verdict.NEEDED:
                    self.install(module)
                    self.record(module.__name__, State.INSTALLED, verdict.reason)
                else:
                    self.record(module.__name__, verdict.state, verdict.reason)
                    if verdict.state == Verdict.DRIFTED:
                        self.report(f"{module.__name__}: {verdict.reason}")
            except OverlayError:
                raise
            except Exception as exc:
                self.uninstall_wrappers(set(self._originals) - before)  # this target's, not the others'
                self.record(module.__name__, State.FAILED, f"{type(exc).__name__}: {exc}")
                self.report(f"hook on {module.__name__} raised {type(exc).__name__}: {exc}", exc)

    def install(self, module):
        """Put this fix's wrappers on ``module``; a second call never stacks them.

        An alias bound to one of our own wrappers (``from target import f`` run after ``target`` was
        hooked) gets the original back first, then its own wrapper: never a wrapper around ours, and
        uninstall leaves no wrapper behind in the alias.
        """
        import wrapt

        for owner, attribute, wrapper in self.wrappers(module):
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

    def uninstall_wrappers(self, keys=None):
        """Put back the original objects (all, or those of ``keys``), by identity, unless someone
        wrapped ours since (then ours stays inside theirs: removing it would drop theirs; warned)."""
        with self._lock:
            for key in list(self._originals if keys is None else keys):
                owner, attribute = key
                original, ours = self._originals.pop(key)
                if vars(owner).get(attribute) is ours:
                    setattr(owner, attribute, original)
                else:
                    where = f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{attribute}"
                    warnings.warn(OverlayWarning(
                        f"mtp-overlay fix {self.name!r}: {where} was wrapped again after the overlay; "
                        "left in place (uninstall the outer wrapper first)"), stacklevel=3)

    def uninstall(self):
        self.uninstall_wrappers()
        self._target_states.clear()
        self.late = False

    def wrapped(self):
        """The (owner, attribute) pairs this fix currently wraps."""
        return list(self._originals)

    def handled(self, target):
        """Whether the import of ``target`` has already been probed (and the fix put in, if needed)."""
        return target in self._target_states

    def state(self):
        """(state, reason) aggregated over the targets imported so far."""
        if self.disabled_reason is not None:
            return State.DISABLED, self.disabled_reason
        states = self._target_states
        for state in State.PRIORITY:
            reasons = [f"{name}: {r}" if r else name for name, (s, r) in states.items() if s == state]
            if reasons:
                return state, "; ".join(reasons)
        return State.PENDING, "waiting for import of " + ", ".join(self.targets)

    # --- for fixes whose work goes beyond wrappers (e.g. hf-modules-cache's import path) -------
    def record(self, module_name, state, reason):
        """Set the state of target ``module_name`` (what `status()` reports)."""
        self._target_states[module_name] = (state, reason)

    def report(self, message, cause=None):
        """Say the fix did not apply: OverlayWarning, or OverlayError in strict mode."""
        text = f"mtp-overlay fix {self.name!r} not applied: {message}"
        if self.strict:
            raise OverlayError(text) from cause
        warnings.warn(OverlayWarning(text), stacklevel=3)


def distribution_version(distribution):
    """Installed version of ``distribution``, or None (importlib.metadata loaded only when asked)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
