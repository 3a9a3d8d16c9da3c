"""``mtp-overlay new-fix``: the files of a new fix, in a source checkout, in the shape of every other.

Writes the declaration, the fix module (its ``probe`` and ``wrappers`` raise NotImplementedError
naming the file to edit, so the fix is `failed`, never silently `needed`, until they are written),
the README (its why a placeholder), ``tests/fixes/<fix_id>/`` with a first test (the reproducer shows
the bug on stock) and the reproducer stub ``mtp_overlay/bed/fixes/<fix_id>.py``, then
regenerates the table and the READMEs' facts (`mtp_overlay.generated`). Every placeholder carries
`PLACEHOLDER`, which a test refuses in a committed fix.
"""

import re

from . import generated
from .contract import FIX_ID, Declaration, Provenance
from .generated import quoted

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

PLACEHOLDER = "TODO(new-fix)"
DISTRIBUTION = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")  # a PEP 508 name

DECLARATION = '''"""{name}: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Provenance

# add families=, marker=, requires=, reads=, after=, collective= as the fix needs them
# (mtp_overlay.contract.Declaration)
DECLARATION = Declaration(
    {fix_id},
    summary={summary},
    symptom={symptom},
    distribution={distribution},
    targets={{  # role -> the module whose import installs the fix
{targets}    }},
    provenance=Provenance(origin={origin}),
)
'''

MODULE = '''"""{fix_id}: {summary}

{placeholder}: what upstream does wrong (file:line in the release), what the hook changes and what it
leaves to upstream. This docstring tells how the fix works; its README tells why it exists.
"""

from ...contract import Verdict
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

SOURCE = "mtp_overlay/fixes/{folder}/__init__.py"


class {cls}(Fix):
    declaration = DECLARATION

    def probe(self, module: "ModuleType") -> Verdict:
        """needed, redundant or drifted for target ``module`` (``self.role_of(module)`` says which)."""
        raise NotImplementedError(f"fix {{self.name!r}} has no probe yet: write it in {{SOURCE}}")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        """Yield ``(owner, attribute, wrapper)`` for target ``module``: read a call's arguments with
        `mtp_overlay.calls.argument`, reach the stock function with `mtp_overlay.calls.original`."""
        raise NotImplementedError(f"fix {{self.name!r}} has no wrappers yet: write them in {{SOURCE}}")


FIX = {cls}()
'''

README = '''## Why

{placeholder}: what breaks on stock and who hits it (measured: its reproducer says what it saw), and
what upstream has done about it. How the hook works belongs in the module docstring, not here.
'''

TEST = '''"""{fix_id}: the bug shows on the installed upstream with the fix off."""

from mtp_overlay.bed.fixes import reproduce


def test_the_stock_path_shows_the_bug():
    shows, evidence = reproduce({fix_id!r})
    assert shows, evidence
'''

REPRODUCER = '''"""{fix_id} on stock {distribution}: {placeholder}: the stock code path that shows the bug (the fix off)."""


def reproduce():
    """Run the stock code path with the fix off: ``(bug_shows, evidence)``, the evidence one line."""
    raise NotImplementedError("fix {fix_id!r} has no reproducer yet: write it in mtp_overlay/bed/fixes/{folder}.py")
'''


def target_argument(value: str) -> "tuple[str, str]":
    """``ROLE=MODULE`` (the CLI's ``--target``) as ``(role, module)``; ValueError naming the argument."""
    role, equals, module = value.partition("=")
    if not equals or not role.strip() or not module.strip():
        raise ValueError(f"--target must be ROLE=MODULE (e.g. model=megatron.core.models.gpt.gpt_model), got {value!r}")
    return role.strip(), module.strip()


def checkout() -> "Path":
    """The source checkout this package lives in; ValueError when it is an installed copy."""
    root = generated.ROOT
    pyproject = root / "pyproject.toml"
    if not (pyproject.is_file() and 'name = "mtp-overlay"' in pyproject.read_text(encoding="utf-8")
            and (root / "tests" / "fixes").is_dir() and generated.README.is_file()):
        raise ValueError(f"new-fix writes into a source checkout of mtp-overlay (pyproject.toml, README.md and "
                         f"tests/fixes/ beside the package); {root} is not one: run it in a clone of the repository")
    return root


def new_fix(fix_id: str, distribution: str, targets: "list[tuple[str, str]]",
            summary: "str | None" = None) -> "list[Path]":
    """Write fix ``fix_id``'s files and regenerate; the paths written. ValueError, before anything is
    written, for a bad or taken id, a bad distribution name, no or bad targets, or no source checkout."""
    root = checkout()
    if not isinstance(fix_id, str) or not FIX_ID.fullmatch(fix_id):
        raise ValueError(f"fix id must be lowercase words joined by '-' (e.g. bridge-mtp-config), got {fix_id!r}")
    if not isinstance(distribution, str) or not DISTRIBUTION.fullmatch(distribution):
        raise ValueError(f"--distribution must be a distribution name as pip knows it (e.g. megatron-core), "
                         f"got {distribution!r}")
    if not targets:
        raise ValueError("give at least one --target ROLE=MODULE: the upstream module whose import installs the fix")
    if len(dict(targets)) != len(targets):
        raise ValueError(f"--target: each role once, got {[role for role, _ in targets]}")
    folder = fix_id.replace("-", "_")
    summary = summary or f"{PLACEHOLDER}: what the fix does, one line."
    declaration = Declaration(fix_id, summary=summary, symptom=f"{PLACEHOLDER}: what goes wrong on stock, one sentence",
                              distribution=distribution, targets=dict(targets),
                              provenance=Provenance(origin=f"{PLACEHOLDER}: where the bug was met"))
    taken = {d.name for d in generated.found_declarations()}
    package = generated.PACKAGE / "fixes" / folder
    files = {
        package / "declaration.py": DECLARATION.format(
            name=fix_id, fix_id=quoted(fix_id), summary=quoted(declaration.summary), symptom=quoted(declaration.symptom),
            distribution=quoted(distribution), origin=quoted(declaration.provenance.origin),
            targets="".join(f"        {quoted(role)}: {quoted(module)},\n" for role, module in declaration.targets.items())),
        package / "__init__.py": MODULE.format(fix_id=fix_id, summary=summary, placeholder=PLACEHOLDER, folder=folder,
                                               cls="".join(part.capitalize() for part in fix_id.split("-")) + "Fix"),
        package / "README.md": README.format(placeholder=PLACEHOLDER),
        root / "tests" / "fixes" / folder / f"test_{folder}.py": TEST.format(fix_id=fix_id),
        generated.PACKAGE / "bed" / "fixes" / f"{folder}.py": REPRODUCER.format(
            fix_id=fix_id, distribution=distribution, placeholder=PLACEHOLDER, folder=folder),
    }
    existing = [path for path in files if path.exists()]
    if fix_id in taken or existing:
        where = ", ".join(str(path.relative_to(root)) for path in existing) or "declared"
        raise ValueError(f"fix {fix_id!r} exists already ({where})")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    regenerated = generated.write()
    return [path.relative_to(root) for path in files] + [path.relative_to(root) for path in regenerated if path not in files]


def next_steps(fix_id: str) -> str:
    """What to do after `new_fix`, for the CLI to print."""
    folder = fix_id.replace("-", "_")
    return (f"next: write the probe and wrappers in mtp_overlay/fixes/{folder}/__init__.py (until then the fix says "
            f"failed), the reproducer in mtp_overlay/bed/fixes/{folder}.py, the why in its README and every "
            f"{PLACEHOLDER} in its declaration; then python scripts/generate.py and "
            f"pytest tests/contract/test_fix_contract.py -k {fix_id} tests/fixes/{folder}")
