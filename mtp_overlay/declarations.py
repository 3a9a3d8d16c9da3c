"""Each fix's Declaration, read from its folder (``mtp_overlay/fixes/<fix id>/declaration.py``).

What the lifecycle, `status()` and the patch engine know about a fix beyond the generated table
(`mtp_overlay.table`: ids and target modules, all that ``import mtp_overlay`` reads). Loaded on first
use and kept; the fix's folder is its id with ``_`` for ``-``.
"""

import importlib

from . import table
from .contract import Declaration

_loaded: "dict[str, Declaration]" = {}  # fix id -> its Declaration, read on first use


def package_of(fix_id: str) -> str:
    """The package of fix ``fix_id``: ``mtp_overlay.fixes.<fix id with _ for ->``."""
    return f"{__package__}.fixes.{fix_id.replace('-', '_')}"


def names() -> "list[str]":
    """The fix ids, in the table's (install) order."""
    return [name for name, _ in table.FIXES]


def load(fix_id: str) -> Declaration:
    """The Declaration of fix ``fix_id``; ValueError listing the known ids for an unknown one."""
    found = _loaded.get(fix_id)
    if found is None:
        if fix_id not in names():
            raise ValueError(f"unknown fix {fix_id!r}: expected one of {', '.join(names())}")
        found = importlib.import_module(package_of(fix_id) + ".declaration").DECLARATION
        if not isinstance(found, Declaration) or found.name != fix_id:
            raise ValueError(f"{package_of(fix_id)}.declaration.DECLARATION must be the Declaration of {fix_id!r}, "
                             f"got {found!r}")
        found = _loaded.setdefault(fix_id, found)
    return found


def every() -> "list[Declaration]":
    """Every fix's Declaration, in the table's order."""
    return [load(name) for name in names()]
