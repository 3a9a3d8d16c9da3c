"""Reproducers, keyed by fix id: each module ``<fix id with underscores>.py`` has ``reproduce()``,
which runs the stock upstream code path with the fix off and returns ``(bug_shows, evidence)``.

The behavioural half of upstream tracking (the probe reads the code, this runs it): the support
matrix, ``pytest --pyargs mtp_overlay.upstream_tests`` and the tests reach them through `reproduce`.
"""

import importlib


def reproduce(fix_id):
    """Run fix ``fix_id``'s reproducer; ``(bug_shows, evidence)``."""
    return importlib.import_module(f"{__name__}.{fix_id.replace('-', '_')}").reproduce()
