"""One upstream attribute swapped for a stand-in (`Shim`), for a block (`swapped`), and one import
statement's module swapped for a stand-in, for a block and one importer (`scoped_import`): the two
mechanisms of the bed's stand-ins. The process-wide table of CPU shims is `cpu_shims`.
"""

import builtins
import contextlib
import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Shim:
    owner: object
    attribute: str
    replacement: object


@contextlib.contextmanager
def swapped(replacements):
    """``with swapped([Shim, ...]): ...`` sets each attribute for the block, restoring the originals."""
    saved = []
    try:
        for shim in replacements:
            saved.append((shim.owner, shim.attribute, vars(shim.owner)[shim.attribute]))
            setattr(shim.owner, shim.attribute, shim.replacement)
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


@contextlib.contextmanager
def scoped_import(stand_in):
    """While the block runs, an absolute import statement of a module gets ``stand_in(importer, name,
    fromlist)`` (``importer``: the importing module's ``__name__``) when that is not None, else what it
    would get. ``builtins.__import__`` is the only thing swapped: nothing enters ``sys.modules``, and every
    other importer finds what it found before."""
    real_import = builtins.__import__

    def hook(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and globals is not None:
            module = stand_in(globals.get("__name__"), name, fromlist)
            if module is not None:
                return module
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = hook
    try:
        yield
    finally:
        if builtins.__import__ is hook:
            builtins.__import__ = real_import


def having(module_name, attribute):
    """[module ``module_name``] if it imports and has ``attribute``, else []: a shim for one upstream
    line is skipped on the releases that lack that line."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    return [module] if attribute in vars(module) else []
