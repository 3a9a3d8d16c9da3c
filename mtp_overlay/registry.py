"""The list of fixes, and install / uninstall / status / check over it.

``FIXES`` is all that ``import mtp_overlay`` reads: each fix id with the upstream modules whose
import installs it. A fix's code (``mtp_overlay/fixes/<fix id>/``) and the lifecycle machinery load
only when one of its targets is imported, or when `status()` / `check()` ask about it.
"""

import os

from . import hooks

FIXES = [
    ("mtp-sp-scatter", ("megatron.core.transformer.multi_token_prediction",)),
    ("mtp-packed-roll", ("megatron.core.transformer.multi_token_prediction",)),
    ("mtp-loss-mask", ("megatron.core.models.gpt.gpt_model", "megatron.core.models.hybrid.hybrid_model")),
    (
        "mtp-cp-loss-scale",
        (
            "megatron.core.transformer.multi_token_prediction",
            "megatron.core.models.gpt.gpt_model",
            "megatron.core.models.hybrid.hybrid_model",
        ),
    ),
    ("hf-modules-cache", ("ray",)),
    (
        "device-normalized-broadcast",
        ("vllm.distributed.weight_transfer.packed_tensor", "vllm.distributed.weight_transfer.nccl_engine"),
    ),
    (
        "vllm-chat-template",
        (
            "vllm.renderers.online_renderer",
            "vllm.renderers.online_derenderer",
            "vllm.entrypoints.serve.tokenize.serving",
            "vllm.entrypoints.openai.chat_completion.serving",
            "vllm.entrypoints.openai.responses.serving",
            "vllm.entrypoints.anthropic.serving",
        ),
    ),
    (
        "vllm-mtp-drafter-load",
        (
            "vllm.model_executor.models.nemotron_h_mtp",
            "vllm.model_executor.models.deepseek_mtp",
            "vllm.model_executor.model_loader.reload.layerwise",
            "vllm.model_executor.model_loader.reload",
            "vllm.model_executor.model_loader.reload.inplace",
        ),
    ),
]

_lifecycles = {}  # fix id -> Lifecycle, made on first use
_strict = {}  # fix id -> strict, for a fix installed before its Lifecycle exists
_callbacks = {}  # fix id -> its post-import callback (one object per fix, so it can be cancelled)


def names():
    """The fix ids, in registry order."""
    return [name for name, _ in FIXES]


def lifecycle(name):
    """The Lifecycle of fix ``name`` in this process; ValueError listing the known ids otherwise."""
    found = _lifecycles.get(name)
    if found is None:
        targets = dict(FIXES).get(name)
        if targets is None:
            raise ValueError(f"unknown fix {name!r}: expected one of {', '.join(names())}")
        from .lifecycle import Lifecycle

        found = _lifecycles.setdefault(name, Lifecycle(name, targets))
        found.strict = _strict.pop(name, False)
    return found


def get(name):
    """The Fix declaration of fix ``name`` (its module is imported)."""
    return lifecycle(name).fix


def _select(names_or_name):
    if names_or_name is None:
        return names()
    selected = [names_or_name] if isinstance(names_or_name, str) else list(names_or_name)
    known = names()
    for name in selected:
        if name not in known:
            raise ValueError(f"unknown fix {name!r}: expected one of {', '.join(known)}")
    return selected


STRICT_ON, STRICT_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def strict_from_env():
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


def _warn(message):
    import warnings

    from .contract import OverlayWarning

    warnings.warn(OverlayWarning("mtp-overlay: " + message), stacklevel=4)


def disabled_from_env(strict=False):
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

    def __init__(self, name):
        self.name = name

    def __call__(self, module):
        lifecycle(self.name).on_import(module)

    def failed(self, target, error):
        lifecycle(self.name).cannot_hook(target, error)


def _callback(name):
    found = _callbacks.get(name)
    if found is None:
        found = _callbacks.setdefault(name, _Hook(name))
    return found


def install(only=None, skip=(), strict=None):
    """Install the selected fixes: each waits for its target modules (at once if already imported).

    ``only``/``skip``: fix ids. ``strict`` (default ``MTP_OVERLAY_STRICT``): drift and hook failures
    raise OverlayError instead of warning.
    """
    if strict is None:
        strict = strict_from_env()
    elif not isinstance(strict, bool):
        raise TypeError(f"install(strict=...) must be True, False or None (MTP_OVERLAY_STRICT), got {strict!r}")
    skipped = set(_select(skip or ()))
    env_disabled = disabled_from_env(strict)
    for name in _select(only):
        if name in env_disabled or name in skipped:
            _remove(name, "disabled by " + ("MTP_OVERLAY_DISABLE" if name in env_disabled else "install(skip=...)"))
            continue
        known = _lifecycles.get(name)
        if known is None:
            _strict[name] = strict
        else:
            known.disabled_reason, known.strict = None, strict
        for target in dict(FIXES)[name]:
            if known is not None and known.handled(target):  # probed (and installed) already
                continue
            if hooks.when_imported(target, _callback(name)):
                lifecycle(name).late = True


def uninstall(only=None):
    """Remove the selected fixes: cancel waiting hooks, restore every original object."""
    for name in _select(only):
        _remove(name, "uninstalled")


def _remove(name, reason):
    for target in dict(FIXES)[name]:
        hooks.cancel(target, _callback(name))
    lifecycle(name).disable(reason)


def status(only=None):
    """One FixStatus per fix: its state in this process (`State.RUNTIME`), upstream distribution and
    version, reason, late, and ``patched``: its source patch on disk (None: no variant fits)."""
    from .contract import FixStatus, State, distribution_version
    from .patching.survey import patched_on_disk

    rows = []
    for name in _select(only):
        found = lifecycle(name)
        fix = found.fix
        state, reason = found.state()
        version = distribution_version(fix.distribution)
        if version is None and state == State.PENDING:
            state, reason = State.ABSENT, f"{fix.distribution} is not installed"
        patched = patched_on_disk(fix) if version is not None else None
        rows.append(FixStatus(fix, version, state, reason, found.late, patched))
    return rows


def check(only=None):
    """Probe every fix against the installed upstream code (imports its targets): the CI question.

    One FixStatus per fix with its ``verdict`` (`State.VERDICTS`): needed / redundant / drifted /
    failed, ``absent`` without the distribution, ``unsupported`` when a target does not import on
    this stack. A target module missing from the installed release is skipped; all missing is drift.
    """
    import importlib

    from .contract import FixStatus, State, Verdict, distribution_version, drifted
    from .lifecycle import judge

    rows = []
    for name in _select(only):
        found = lifecycle(name)
        fix = found.fix
        state = found.state()[0]
        version = distribution_version(fix.distribution)
        if version is None:
            rows.append(FixStatus(fix, None, state, f"{fix.distribution} is not installed", verdict=State.ABSENT))
            continue
        verdicts, missing = [], []
        for target in found.targets:
            try:
                module = importlib.import_module(target)
            except Exception as exc:
                gone = isinstance(exc, ModuleNotFoundError) and exc.name is not None
                if gone and (target == exc.name or target.startswith(exc.name + ".")):
                    missing.append(target)
                else:
                    verdicts.append((target, Verdict(State.UNSUPPORTED, f"import failed: {type(exc).__name__}: {exc}")))
                continue
            verdicts.append((target, judge(fix, module)))
        if not verdicts:
            verdicts.append((", ".join(missing), drifted("no target module exists in this release")))
        verdict = next(s for s in State.VERDICT_PRIORITY if any(v.state == s for _, v in verdicts))
        reason = "; ".join(f"{t}: {v.reason}" if v.reason else t for t, v in verdicts if v.state == verdict)
        rows.append(FixStatus(fix, version, state, reason, verdict=verdict))
    return rows
