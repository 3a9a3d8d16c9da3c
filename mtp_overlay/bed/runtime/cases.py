"""What a test's rank worker does between cases: switch the overlay's fixes, and keep a failure as text.

A worker runs several cases in one rank (one rank run per layout keeps the suite's cost down), each
with its own fixes; a case whose stock path fails returns the failure's kind and text for the test to
compare, instead of failing the whole rank run.
"""


def use_fixes(fixes):
    """Uninstall the overlay, then install exactly ``fixes`` (an iterable of fix ids; empty: none)."""
    import mtp_overlay

    mtp_overlay.uninstall()
    mtp_overlay.install(only=list(fixes))


def failure_of(call):
    """``"<ExceptionType>: <message>"`` of what ``call()`` raised, or None when it returned."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the failure is the case's result
        return f"{type(exc).__name__}: {exc}"
    return None
