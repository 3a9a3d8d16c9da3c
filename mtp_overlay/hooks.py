"""Post-import hooks that cost nothing until a target module is imported.

The only module that talks to wrapt's import machinery. `import wrapt` costs ~75 ms (it pulls in
asyncio and importlib.metadata) and the process-startup hook imports the overlay in every interpreter,
so until the first target is looked up only a duck-typed finder sits on `sys.meta_path`. On that
first lookup it hands every waiting module over to `wrapt.register_post_import_hook` and answers
the lookup through wrapt's own finder, so the target that woke it is hooked as well.

Each module name is registered with wrapt once, through one dispatcher: callbacks live here and can
be cancelled, so repeated install/uninstall cycles leave nothing behind in wrapt.

Never in the way of the upstream import: without an importable wrapt the trigger steps aside, tells
every waiting callback (its ``failed(name, error)``, when it has one) and warns once; a target that
another thread is still importing is handed over once that import has finished.
"""

import sys
from _thread import RLock, start_new_thread

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], object]  # may carry ``failed(name, error)``

_lock = RLock()
_callbacks: "dict[str, list[Callback]]" = {}  # module name -> callbacks still waiting for its import
_watched: "frozenset[str]" = frozenset()  # what the trigger wakes on: waiting names and their top packages
_armed: "set[str]" = set()  # names whose dispatcher wrapt holds
_handed_over = False
_broken: "ImportError | None" = None  # the ImportError of wrapt, once the hand-over found it missing


def when_imported(name: str, callback: "Callback") -> bool:
    """Call ``callback(module)`` once module ``name`` is imported; at once if it already is.

    Returns True when the module was already imported, or being imported (a late install).
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            if _broken is not None:
                _tell_failed(name, [callback], _broken)
                return False
            waiting = _callbacks.setdefault(name, [])
            if callback not in waiting:
                waiting.append(callback)
            _watch()
            _arm(name)
            return False
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        start_new_thread(_after_import, (name, callback))  # another thread is still running its body
    else:
        callback(module)
    return True


def cancel(name: str, callback: "Callback") -> None:
    """Forget a callback that has not fired yet."""
    with _lock:
        waiting = _callbacks.get(name, [])
        if callback in waiting:
            waiting.remove(callback)
        if not waiting:
            _callbacks.pop(name, None)
        _watch()


def waiting() -> "list[str]":
    """Names of modules with callbacks still waiting (for tests and status)."""
    with _lock:
        return sorted(_callbacks)


def _after_import(name: str, callback: "Callback") -> None:
    """Wait for the import of ``name`` in progress elsewhere (the import system blocks a second
    importer until the first has finished), then run ``callback`` on the finished module."""
    import importlib

    try:
        module = importlib.import_module(name)
    except Exception:
        return  # the import failed where it ran, and said so there
    callback(module)


def _watch() -> None:
    global _watched
    _watched = frozenset(_callbacks) | {name.partition(".")[0] for name in _callbacks}


def _dispatch(module: "ModuleType") -> None:
    with _lock:
        callbacks = _callbacks.pop(module.__name__, [])
        _armed.discard(module.__name__)
        _watch()
    for callback in callbacks:
        callback(module)


def _arm(name: str) -> None:
    if _handed_over:
        if name not in _armed:
            import wrapt

            _armed.add(name)
            wrapt.register_post_import_hook(_dispatch, name)
    elif _TRIGGER not in sys.meta_path:
        sys.meta_path.insert(0, _TRIGGER)


def _hand_over() -> "Any":
    """Give every waiting module to wrapt; return wrapt's finder (None if nothing was waiting)."""
    global _handed_over
    try:
        import wrapt.importer  # outside the lock: another thread may hold wrapt's module lock
    except ImportError as exc:
        _step_aside(exc)
        return None

    with _lock:
        if not _handed_over:
            _handed_over = True
            for name in list(_callbacks):
                _arm(name)
    return next((f for f in sys.meta_path if isinstance(f, wrapt.importer.ImportHookFinder)), None)


def _step_aside(error: ImportError) -> None:
    """wrapt cannot be imported: take the trigger off, tell every waiting callback, warn once."""
    global _broken
    with _lock:
        if _broken is not None:
            return
        _broken = error
        waiting = dict(_callbacks)
        _callbacks.clear()
        _watch()
        if _TRIGGER in sys.meta_path:
            sys.meta_path.remove(_TRIGGER)
    import warnings

    from .contract import OverlayWarning

    warnings.warn(OverlayWarning(
        f"mtp-overlay: wrapt cannot be imported ({type(error).__name__}: {error}): no fix installs in this "
        "process (pip install wrapt)"), stacklevel=3)
    for name, callbacks in waiting.items():
        _tell_failed(name, callbacks, error)


def _tell_failed(name: str, callbacks: "Sequence[Callback]", error: ImportError) -> None:
    for callback in callbacks:
        failed = getattr(callback, "failed", None)
        if failed is not None:
            failed(name, error)


class _ImportTrigger:
    """Meta-path finder that wakes on the first lookup of a waiting module or its top package."""

    def find_spec(self, fullname: str, path: "Sequence[str] | None" = None,
                  target: "ModuleType | None" = None) -> "ModuleSpec | None":
        if _handed_over or fullname not in _watched:
            return None
        finder = _hand_over()
        return None if finder is None else finder.find_spec(fullname, path, target)


_TRIGGER = _ImportTrigger()
