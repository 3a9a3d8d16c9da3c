"""mtp-overlay: Multi-Token-Prediction training fixes for stock upstream stacks, without forking them.

``import mtp_overlay`` installs every enabled fix lazily: each waits, through a post-import hook, for
its upstream target module, so nothing upstream is imported here. Switches: ``MTP_OVERLAY_DISABLE``
(``name,name`` or ``all``) and ``MTP_OVERLAY_STRICT=1``.
"""

from .fix import OverlayError, OverlayWarning, State
from .registry import FIXES, install, status, uninstall

__all__ = ["FIXES", "OverlayError", "OverlayWarning", "State", "install", "status", "uninstall"]
__version__ = "0.1.0"

install()
