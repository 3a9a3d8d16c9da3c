"""The list of fixes, and install / uninstall / status over it.

The registry knows fixes only through the Fix contract; the hooks module is the only way in to the
import machinery.
"""

import os
import warnings

from . import hooks
from .fix import (
    FixStatus,
    OverlayError,
    OverlayWarning,
    State,
    Verdict,
    distribution_version,
    drifted,
    strict_from_env,
)
from .fixes import device_broadcast, loss_mask, modules_cache, sp_scatter, vllm_mtp_drafter_load

FIXES = [sp_scatter.FIX, loss_mask.FIX, modules_cache.FIX, device_broadcast.FIX, vllm_mtp_drafter_load.FIX]


def get(name):
    """The fix called ``name``; ValueError listing the known names otherwise."""
    for fix in FIXES:
        if fix.name == name:
            return fix
    raise ValueError(f"unknown fix {name!r}: expected one of {', '.join(fix.name for fix in FIXES)}")


def _select(names):
    return FIXES if names is None else [get(name) for name in ([names] if isinstance(names, str) else names)]


def disabled_from_env(strict=False):
    """Names switched off by ``MTP_OVERLAY_DISABLE=name,name`` or ``=all``.

    An unknown name is a typo the user must hear about, but runs at import (often from the startup
    hook), so it warns and is ignored; strict mode raises.
    """
    raw = {part.strip() for part in os.environ.get("MTP_OVERLAY_DISABLE", "").split(",") if part.strip()}
    known = {fix.name for fix in FIXES}
    if "all" in raw:
        return known
    for name in sorted(raw - known):
        message = f"MTP_OVERLAY_DISABLE names unknown fix {name!r}: expected 'all' or any of {', '.join(sorted(known))}"
        if strict:
            raise OverlayError(message)
        warnings.warn(OverlayWarning(message), stacklevel=3)
    return raw & known


def install(only=None, skip=(), strict=None):
    """Install the selected fixes: each waits for its target modules (at once if already imported).

    ``only``/``skip``: fix names. ``strict`` (default ``MTP_OVERLAY_STRICT``): drift and hook failures
    raise OverlayError instead of warning.
    """
    strict = strict_from_env() if strict is None else bool(strict)
    skipped = {get(name).name for name in ([skip] if isinstance(skip, str) else skip)}
    env_disabled = disabled_from_env(strict)
    for fix in _select(only):
        if fix.name in env_disabled or fix.name in skipped:
            why = "MTP_OVERLAY_DISABLE" if fix.name in env_disabled else "install(skip=...)"
            _remove(fix, f"disabled by {why}")
            continue
        fix.disabled_reason = None
        fix.strict = strict
        for target in fix.targets:
            if fix.handled(target):  # probed and installed (or stood down) already: nothing to redo
                continue
            if hooks.when_imported(target, fix.on_import):
                fix.late = True


def uninstall(only=None):
    """Remove the selected fixes: cancel waiting hooks, restore every original object."""
    for fix in _select(only):
        _remove(fix, "uninstalled")


def _remove(fix, reason):
    for target in fix.targets:
        hooks.cancel(target, fix.on_import)
    fix.uninstall()
    fix.disabled_reason = reason


def status(only=None):
    """One FixStatus per fix: state in State, upstream distribution and version, reason, late, and
    ``patched``: whether the fix's source patch is on disk (None when no variant fits the install)."""
    from .patching.engine import patched_on_disk

    rows = []
    for fix in _select(only):
        state, reason = fix.state()
        version = distribution_version(fix.distribution)
        if version is None and state == State.PENDING:
            state, reason = State.ABSENT, f"{fix.distribution} is not installed"
        patched = patched_on_disk(fix) if version is not None else None
        rows.append(FixStatus(fix, version, state, reason, fix.late, patched))
    return rows


def check(only=None):
    """Probe every fix against the installed upstream code (imports its targets): the CI question.

    One FixStatus per fix, state in needed / redundant / drifted / failed / absent. A target module
    missing from the installed release is skipped; all of them missing is drift.
    """
    import importlib

    rows = []
    for fix in _select(only):
        version = distribution_version(fix.distribution)
        if version is None:
            rows.append(FixStatus(fix, None, State.ABSENT, f"{fix.distribution} is not installed", False))
            continue
        verdicts, missing = [], []
        for target in fix.targets:
            try:
                module = importlib.import_module(target)
            except Exception as exc:
                gone = isinstance(exc, ModuleNotFoundError) and exc.name is not None
                if gone and (target == exc.name or target.startswith(exc.name + ".")):
                    missing.append(target)
                else:
                    verdicts.append((target, Verdict(State.FAILED, f"import failed: {type(exc).__name__}: {exc}")))
                continue
            try:
                verdicts.append((target, fix.probe(module)))
            except Exception as exc:
                verdicts.append((target, Verdict(State.FAILED, f"probe raised {type(exc).__name__}: {exc}")))
        if not verdicts:
            verdicts.append((", ".join(missing), drifted("no target module exists in this release")))
        state = next(s for s in Verdict.PRIORITY if any(v.state == s for _, v in verdicts))
        reason = "; ".join(f"{t}: {v.reason}" if v.reason else t for t, v in verdicts if v.state == state)
        rows.append(FixStatus(fix, version, state, reason, False))
    return rows
