"""Post-import hooks that cost nothing until a target module is imported.

The only module that talks to wrapt's import machinery. `import wrapt` costs ~75 ms (it pulls in
asyncio and importlib.metadata) and the process-startup hook imports the overlay in every interpreter,
so until the first target is looked up only a duck-typed finder sits on `sys.meta_path`. On that
first lookup it hands every waiting module over to `wrapt.register_post_import_hook` and answers
the lookup through wrapt's own finder, so the target that woke it is hooked as well.

Each module name is registered with wrapt once, through one dispatcher: callbacks live here and can
be cancelled, so repeated install/uninstall cycles leave nothing behind in wrapt.
"""

import sys
from _thread import RLock

_lock = RLock()
_callbacks = {}  # module name -> callbacks still waiting for its import
_watched = frozenset()  # what the trigger wakes on: waiting names and their top packages
_armed = set()  # names whose dispatcher wrapt holds
_handed_over = False


def when_imported(name, callback):
    """Call ``callback(module)`` once module ``name`` is imported; at once if it already is.

    Returns True when the module was already imported (a late install).
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            waiting = _callbacks.setdefault(name, [])
            if callback not in waiting:
                waiting.append(callback)
            _watch()
            _arm(name)
            return False
    callback(module)
    return True


def cancel(name, callback):
    """Forget a callback that has not fired yet."""
    with _lock:
        waiting = _callbacks.get(name, [])
        if callback in waiting:
            waiting.remove(callback)
        if not waiting:
            _callbacks.pop(name, None)
        _watch()


def waiting():
    """Names of modules with callbacks still waiting (for tests and status)."""
    with _lock:
        return sorted(_callbacks)


def _watch():
    global _watched
    _watched = frozenset(_callbacks) | {name.partition(".")[0] for name in _callbacks}


def _dispatch(module):
    with _lock:
        callbacks = _callbacks.pop(module.__name__, [])
        _armed.discard(module.__name__)
        _watch()
    for callback in callbacks:
        callback(module)


def _arm(name):
    if _handed_over:
        if name not in _armed:
            import wrapt

            _armed.add(name)
            wrapt.register_post_import_hook(_dispatch, name)
    elif _TRIGGER not in sys.meta_path:
        sys.meta_path.insert(0, _TRIGGER)


def _hand_over():
    """Give every waiting module to wrapt; return wrapt's finder (None if nothing was waiting)."""
    global _handed_over
    import wrapt.importer  # outside the lock: another thread may hold wrapt's module lock

    with _lock:
        if not _handed_over:
            _handed_over = True
            for name in list(_callbacks):
                _arm(name)
    return next((f for f in sys.meta_path if isinstance(f, wrapt.importer.ImportHookFinder)), None)


class _ImportTrigger:
    """Meta-path finder that wakes on the first lookup of a waiting module or its top package."""

    def find_spec(self, fullname, path=None, target=None):
        if _handed_over or fullname not in _watched:
            return None
        finder = _hand_over()
        return None if finder is None else finder.find_spec(fullname, path, target)


_TRIGGER = _ImportTrigger()
