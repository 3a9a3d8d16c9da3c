"""What vllm-mtp-drafter-load keeps per process: weak tables keyed by model, which models are hooked
drafters, and how the fix speaks (an OverlayWarning, or OverlayError in strict mode).

The lowest module of the fix: `accounting` and `freshness` import it, it imports neither.
"""

from _thread import RLock

from ...contract import OverlayError, OverlayWarning
from ...lifecycle import of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ...lifecycle import Lifecycle

NAME = "vllm-mtp-drafter-load"
lock = RLock()
# name -> WeakKeyDictionary, made on first use (weakref is not imported at interpreter start:
# `import mtp_overlay` stays cheap). Accounting: "refits" (open Refit per drafter), "shapes"
# (DrafterShape), "reports" (last refit's RefitReport), "calls" (last judged call's), "counts"
# (refits closed). Freshness: "drafters" (Freshness per drafter), "targets" (the same per target).
_tables: "dict[str, Any]" = {}


def table(name: str) -> "Any":
    found = _tables.get(name)
    if found is None:
        import weakref

        found = _tables[name] = weakref.WeakKeyDictionary()
    return found


def life() -> "Lifecycle":
    """The fix's Lifecycle (its strict flag and what it wraps)."""
    return of(NAME)


def is_drafter(model: object) -> bool:
    """Whether ``model`` is an instance of a drafter class whose ``load_weights`` the fix wraps now."""
    wrapped = life().wrapped()
    return any((owner, "load_weights") in wrapped for owner in type(model).__mro__)


def say(message: str, stacklevel: int = 4) -> None:
    """One report of the fix: OverlayError in strict mode, else an OverlayWarning (``message`` goes
    after the fix's name)."""
    text = f"mtp-overlay fix {NAME!r}: {message}"
    if life().strict:
        raise OverlayError(text)
    import warnings

    warnings.warn(OverlayWarning(text), stacklevel=stacklevel)


def notice(message: str, stacklevel: int = 4) -> None:
    """A heads-up that stays an OverlayWarning in strict mode: nothing is wrong yet (what goes wrong
    later is reported by `say` when it happens)."""
    import warnings

    warnings.warn(OverlayWarning(f"mtp-overlay fix {NAME!r}: {message}"), stacklevel=stacklevel)
