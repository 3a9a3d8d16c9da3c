"""Reproducers keyed by fix id: ``reproducers/<fix_id_with_underscores>.py`` defines ``reproduce()``,
which runs the fix's stock upstream code path with the fix off and returns (bug shows, evidence)."""

import importlib


def reproducer(fix):
    """The test bed's reproducer of ``fix``; the fix's own ``reproduce`` for fixes that still carry one."""
    name = f"{__name__}.{fix.name.replace('-', '_')}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return fix.reproduce
    return module.reproduce
