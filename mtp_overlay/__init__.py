"""mtp-overlay: Multi-Token-Prediction training fixes for stock upstream stacks, without forking them.

``import mtp_overlay`` installs every enabled fix lazily: each waits, through a post-import hook, for
its upstream target module, so nothing upstream is imported here, and no fix's code either (only the
generated table of fix ids and target modules). Switches: ``MTP_OVERLAY_DISABLE`` (``name,name`` or
``all``) and ``MTP_OVERLAY_STRICT=1``.
"""

from .registry import check, install, status, uninstall

TYPE_CHECKING = False  # type checkers take the block below; no `import typing` here (it costs every interpreter)
if TYPE_CHECKING:
    from .contract import OverlayError, OverlayWarning, State
    from .verification import verify

__all__ = ["FIXES", "OverlayError", "OverlayWarning", "State", "check", "install", "status", "uninstall", "verify"]
__version__ = "0.1.0"

_CONTRACT = ("OverlayError", "OverlayWarning", "State")


def __getattr__(name: str) -> object:
    # the contract module loads on first use, not at import (it costs every interpreter otherwise)
    if name in _CONTRACT:
        from . import contract

        return getattr(contract, name)
    if name == "verify":  # `mtp-overlay verify`'s API (mtp_overlay.verification): loaded on first use
        from .verification import verify

        return verify
    if name == "FIXES":  # ((fix id, target modules), ...) in install order: the generated table's
        from . import table

        return table.FIXES
    raise AttributeError(f"module 'mtp_overlay' has no attribute {name!r}")


install()
