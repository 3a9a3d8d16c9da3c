"""The vocabulary every layer shares: the one set of states, a probe's Verdict, a fix's Declaration
(with its Provenance and Marker), the rows `status()` / `check()` return, and the overlay's errors.

Imports nothing of the overlay, so every other module may import it. Loaded when a fix is first
needed (a target's import, `status()`, `check()`), never by ``import mtp_overlay`` itself: that
import runs in every interpreter once the startup hook is installed and reads only the generated
table (`mtp_overlay.table`).
"""

import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from types import CodeType, ModuleType
    from typing import Any


class OverlayError(RuntimeError):
    """A fix could not be applied and strict mode (``MTP_OVERLAY_STRICT=1``) asked to raise."""


class OverlayWarning(UserWarning):
    """A fix did not apply as asked; its own category so code can filter or escalate it.

    Every message starts with "mtp-overlay", so ``-W "error:mtp-overlay"`` (or ``PYTHONWARNINGS``)
    escalates them from the command line: a ``-W`` category must be importable before site-packages
    are, which ``mtp_overlay.OverlayWarning`` is not.
    """


class State:
    """Every state a fix, a probe or a source patch can be in: one vocabulary, these names only."""

    # a fix in this process (`status()`)
    PENDING = "pending"  # waiting for a target's import
    INSTALLED = "installed"
    DISABLED = "disabled"  # by MTP_OVERLAY_DISABLE, install(skip=...) or uninstall()
    FAILED = "failed"  # the hook (or the probe) raised, or a fix it requires is disabled
    ABSENT = "absent"  # the upstream distribution is not installed
    # what a probe finds in the upstream code (`check()`); REDUNDANT and DRIFTED are runtime states too
    NEEDED = "needed"  # upstream still has the bug: the fix goes in
    REDUNDANT = "redundant"  # upstream already carries the fix: stand down
    DRIFTED = "drifted"  # the target is missing or of an unknown shape: not applied
    UNSUPPORTED = "unsupported"  # the release does not import on this stack (or predates every patch)
    DISAGREES = "disagrees"  # `check(stock_run=...)`: the probe's reading and the stock run's behaviour differ
    # a source patch on disk (`mtp-overlay patch`); NEEDED, REDUNDANT and ABSENT as above
    APPLIED = "applied"
    MISMATCH = "mismatch"  # the files are neither the released nor the patched bytes

    RUNTIME = (PENDING, INSTALLED, REDUNDANT, DRIFTED, DISABLED, FAILED, ABSENT)
    VERDICTS = (NEEDED, REDUNDANT, DRIFTED, FAILED, ABSENT, UNSUPPORTED, DISAGREES)
    ON_DISK = (APPLIED, NEEDED, REDUNDANT, MISMATCH, ABSENT, UNSUPPORTED)  # unsupported: no patch this old
    # several targets that disagree: the fix reports the first of these it finds
    RUNTIME_PRIORITY = (FAILED, DRIFTED, INSTALLED, REDUNDANT)
    VERDICT_PRIORITY = (UNSUPPORTED, FAILED, DRIFTED, NEEDED, REDUNDANT)
    # the verdicts `mtp-overlay check` fails on
    FAILING = (DRIFTED, FAILED, UNSUPPORTED, DISAGREES)


class Verdict:
    """What a probe found (a `State` of `State.VERDICTS`) and why."""

    __slots__ = ("state", "reason")

    def __init__(self, state: str, reason: str = "") -> None:
        self.state, self.reason = state, reason

    def __repr__(self) -> str:
        return f"Verdict({self.state!r}, {self.reason!r})"


def needed(reason: str = "") -> Verdict:
    return Verdict(State.NEEDED, reason)


def redundant(reason: str) -> Verdict:
    return Verdict(State.REDUNDANT, reason)


def drifted(reason: str) -> Verdict:
    return Verdict(State.DRIFTED, reason)


class Provenance:
    """Where a fix comes from and where upstream fixed it (if it did).

    ``origin``: where the bug was met (prose); ``upstream_fix``: the upstream change that fixes it,
    merged or not (prose, with its PR numbers); ``first_fixed_release``: the first release of the
    fix's distribution that carries that change. ``bugs``: the upstream reports and PRs the fix
    answers, as URLs; ``backport_of``: the upstream commit its source patches backport, as a URL.
    The DEP-3 headers of the fix's patches say exactly these (``Bug:``, ``Origin: backport, <url>``,
    ``Applied-Upstream: <first fixed release>``): a test reads them back.
    """

    __slots__ = ("origin", "upstream_fix", "first_fixed_release", "bugs", "backport_of")

    def __init__(self, origin: str, upstream_fix: "str | None" = None, first_fixed_release: "str | None" = None,
                 bugs: "tuple[str, ...]" = (), backport_of: "str | None" = None) -> None:
        if not isinstance(bugs, tuple) or not all(isinstance(url, str) and url.startswith("https://") for url in bugs):
            raise TypeError(f"Provenance(bugs=...) must be a tuple of https:// URLs, got {bugs!r}")
        self.origin, self.upstream_fix, self.first_fixed_release = origin, upstream_fix, first_fixed_release
        self.bugs, self.backport_of = bugs, backport_of

    def as_dict(self) -> "dict[str, object]":
        return {name: getattr(self, name) for name in self.__slots__}


class Marker:
    """The sign that upstream carries a fix's behaviour: ``function`` of ``module`` references
    ``calls``, itself or through the functions of its own module it calls (upstream may move a fix
    into a helper). Read from the live code by the probe and from the file on disk by the patch
    engine, through the same walk, so the two never disagree on what "redundant" means."""

    __slots__ = ("module", "function", "calls")

    def __init__(self, module: str, function: str, calls: str) -> None:
        self.module, self.function, self.calls = module, function, calls

    @property
    def file(self) -> str:
        """The module's source file, relative to site-packages."""
        return self.module.replace(".", "/") + ".py"

    def in_function(self, function: "Callable[..., object]") -> bool:
        """Whether ``function`` (wrappers looked through, ours included) reaches ``calls``."""
        import inspect

        function = inspect.unwrap(function)
        namespace, home = function.__globals__, function.__module__

        def local_function(name: str) -> "CodeType | None":
            found = namespace.get(name)
            found = inspect.unwrap(found) if callable(found) else None
            return getattr(found, "__code__", None) if getattr(found, "__module__", None) == home else None

        return self._reaches(function.__code__, local_function, set())

    def in_source(self, source: "str | bytes", filename: str = "<source>") -> bool:
        """Whether ``source`` (the module's text or bytes) defines ``function`` reaching ``calls``."""
        try:
            code = compile(source, filename, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            return False
        top = {const.co_name: const for const in code.co_consts if _is_function(const)}
        return any(self._reaches(found, top.get, set()) for found in _functions_named(code, self.function.split(".")))

    def _reaches(self, code: "CodeType", local_function: "Callable[[str], CodeType | None]", seen: "set[int]") -> bool:
        if id(code) in seen:
            return False
        seen.add(id(code))
        if self.calls in code.co_names:
            return True
        inner = [const for const in code.co_consts if _is_function(const)]
        inner += [found for found in map(local_function, code.co_names) if found is not None]
        return any(self._reaches(found, local_function, seen) for found in inner)

    def __str__(self) -> str:
        return f"{self.function} already calls {self.calls}"


def _is_code(value: object) -> bool:
    return hasattr(value, "co_names") and hasattr(value, "co_consts")


def _is_function(value: object) -> bool:
    """A function's code (lambdas and comprehensions too), not a class body's."""
    return _is_code(value) and bool(getattr(value, "co_flags", 0) & 0x1)  # CO_OPTIMIZED


def _functions_named(code: "CodeType", path: "list[str]") -> "Iterator[CodeType]":
    """Code objects reached from module ``code`` by the qualified name ``path`` (nested classes/functions)."""
    for const in code.co_consts:
        if _is_code(const) and const.co_name == path[0]:
            if len(path) == 1:
                yield const
            else:
                yield from _functions_named(const, path[1:])


FIX_ID = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")  # lowercase words joined by '-'
_ROLE = re.compile(r"[a-z][a-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class Declaration:
    """Everything about a fix that is data, not code: what `mtp_overlay/fixes/<fix id>/declaration.py`
    holds, and what the table, the fix README's fact block, the README's fix table and the patch
    engine are made from.

    ``name``: the fix id. ``summary``: what the fix does, one line; ``symptom``: what goes wrong on
    stock, one sentence (the README's fix table). ``distribution``: the upstream distribution, as
    importlib.metadata names it. ``targets``: role -> module, in install order: the modules whose
    import installs the fix, each named by the role it plays, so fix code asks `target` /
    `role_of` and never depends on their order. ``families``: source-patch release family -> PEP 440
    specifier of the releases its patch fits (``patches/<fix id>/<distribution>/<family>.patch``).
    ``provenance``, ``marker`` (upstream, or a source patch on disk, carries the behaviour).
    ``requires``: fix ids this fix cannot work without (install checks them: one disabled makes this
    fix `State.FAILED`). ``reads``: fix ids whose state this fix's hooks consult (`Fix.peer_state`).
    ``after``: fix ids installed before this one because both wrap one attribute and this fix's
    wrapper must sit outside theirs (the table's order). ``collective``: the fix's hooks issue collectives
    on the model's process groups where stock issues others, so every rank of a group must run it
    (`mtp_overlay.fixes.peers` checks; the table's ``COLLECTIVE``).
    """

    __slots__ = ("name", "summary", "symptom", "distribution", "_targets", "families", "provenance", "marker",
                 "requires", "reads", "after", "collective")

    def __init__(self, name: str, *, summary: str, symptom: str, distribution: str, targets: "Mapping[str, str]",
                 provenance: Provenance, families: "Mapping[str, str] | None" = None, marker: "Marker | None" = None,
                 requires: "tuple[str, ...]" = (), reads: "tuple[str, ...]" = (), after: "tuple[str, ...]" = (),
                 collective: bool = False) -> None:
        if not isinstance(name, str) or not FIX_ID.fullmatch(name):
            raise ValueError(f"Declaration(name=...) must be a fix id (lowercase words joined by '-'), got {name!r}")
        where = f"Declaration({name!r})"
        for field, value in (("summary", summary), ("symptom", symptom), ("distribution", distribution)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{where}: {field} must be a non-empty str, got {value!r}")
        pairs = tuple(dict(targets).items()) if hasattr(targets, "items") else None
        if not pairs or not all(isinstance(r, str) and _ROLE.fullmatch(r) and isinstance(m, str) and _MODULE.fullmatch(m)
                                for r, m in pairs):
            raise ValueError(f"{where}: targets must be a non-empty mapping of role (lowercase identifier) to "
                             f"module name, got {targets!r}")
        if len({module for _, module in pairs}) != len(pairs):
            raise ValueError(f"{where}: targets name one module under two roles: {targets!r}")
        if not isinstance(provenance, Provenance):
            raise TypeError(f"{where}: provenance must be a Provenance, got {provenance!r}")
        if marker is not None and not isinstance(marker, Marker):
            raise TypeError(f"{where}: marker must be a Marker or None, got {marker!r}")
        for field, ids in (("requires", requires), ("reads", reads), ("after", after)):
            if not isinstance(ids, tuple) or not all(isinstance(i, str) and FIX_ID.fullmatch(i) for i in ids) or name in ids:
                raise ValueError(f"{where}: {field} must be a tuple of other fixes' ids, got {ids!r}")
        if not isinstance(collective, bool):
            raise TypeError(f"{where}: collective must be a bool, got {collective!r}")
        self.name, self.summary, self.symptom, self.distribution = name, summary, symptom, distribution
        self._targets = pairs
        self.families = dict(families or {})
        self.provenance, self.marker = provenance, marker
        self.requires, self.reads, self.after, self.collective = requires, reads, after, collective

    @property
    def targets(self) -> "dict[str, str]":
        """role -> module, in install order (a copy)."""
        return dict(self._targets)

    @property
    def modules(self) -> "tuple[str, ...]":
        """The target modules, in install order."""
        return tuple(module for _, module in self._targets)

    def target(self, role: str) -> str:
        """The module of target ``role``; ValueError naming the roles otherwise."""
        for found, module in self._targets:
            if found == role:
                return module
        raise ValueError(f"fix {self.name!r} has no target role {role!r}: expected one of "
                         f"{', '.join(r for r, _ in self._targets)}")

    def role_of(self, module: "ModuleType | str") -> str:
        """The role of target ``module`` (a module or its name); ValueError naming the targets otherwise."""
        name = module if isinstance(module, str) else module.__name__
        for role, found in self._targets:
            if found == name:
                return role
        raise ValueError(f"{name} is not a target of fix {self.name!r}: expected one of {', '.join(self.modules)}")

    def fixed_upstream_in(self, version: str) -> bool:
        """Whether the provenance says upstream release ``version`` carries the fix."""
        from packaging.version import Version

        fixed_in = self.provenance.first_fixed_release
        return fixed_in is not None and Version(version) >= Version(fixed_in)

    def family_of(self, version: str) -> "str | None":
        """The source-patch family whose range holds ``version``, or None."""
        from packaging.specifiers import SpecifierSet

        for family, versions in self.families.items():
            if SpecifierSet(versions).contains(version, prereleases=True):
                return family
        return None

    def __repr__(self) -> str:
        return f"Declaration({self.name!r}, {self.distribution!r}, targets={self.targets!r})"


class StockRun:
    """What running a fix's stock code path (the fix off) showed, in a `check(stock_run=...)` row.

    ``outcome``: `State.NEEDED` (the bug shows), `State.REDUNDANT` (it does not), or None when it did
    not run; ``evidence``: what it saw, or why it did not run. ``str()`` is the one wording every
    report uses.
    """

    __slots__ = ("outcome", "evidence")

    def __init__(self, outcome: "str | None", evidence: str) -> None:
        self.outcome, self.evidence = outcome, evidence

    def as_dict(self) -> "dict[str, str | None]":
        return {"outcome": self.outcome, "evidence": self.evidence}

    def __str__(self) -> str:
        return f"{self.outcome}: {self.evidence}" if self.outcome else self.evidence

    def __repr__(self) -> str:
        return f"StockRun({self.outcome!r}, {self.evidence!r})"


class FixStatus:
    """One row of `status()` / `check()`: the fix, its upstream, and where it stands.

    ``state``: the fix in this process (`State.RUNTIME`); ``verdict``: what `check()`'s probe found
    in the installed upstream (`State.VERDICTS`), None in `status()` rows; ``patched``: its source
    patch on disk (True, False; None: not asked, or no patch fits this install); ``run``: the
    `StockRun` of `check(stock_run=...)`, None otherwise; ``details``: what an installed fix reports of
    its work in this process (`mtp_overlay.fixes.Fix.details`, JSON-able; {} for most). `check()` rows
    only: ``probed``, how the deciding target's verdict was reached ("imported": the probe ran on the
    module; "source": the module does not import on this machine, a package it needs is missing, and
    its installed source was read; "import failed": `State.UNSUPPORTED`), and ``targets``, one dict
    per target module (``module``, ``verdict``, ``probed``, ``reason``; ``verdict`` None for a module
    the release lacks).
    """

    __slots__ = (
        "name", "summary", "distribution", "version", "state", "verdict", "probed", "reason", "late", "patched",
        "provenance", "run", "details", "targets",
    )

    def __init__(self, declaration: Declaration, version: "str | None", state: str, reason: str, late: bool = False,
                 patched: "bool | None" = None, verdict: "str | None" = None) -> None:
        self.name, self.summary, self.distribution = declaration.name, declaration.summary, declaration.distribution
        self.version, self.state, self.verdict, self.reason, self.late = version, state, verdict, reason, late
        self.patched = patched
        self.provenance = declaration.provenance.as_dict()
        self.run: "StockRun | None" = None
        self.details: "dict[str, object]" = {}
        self.probed: "str | None" = None
        self.targets: "list[dict[str, str | None]]" = []

    def as_dict(self) -> "dict[str, object]":
        row = {name: getattr(self, name) for name in self.__slots__}
        row["run"] = None if self.run is None else self.run.as_dict()
        return row

    def __repr__(self) -> str:
        return f"FixStatus({self.as_dict()})"


def defined_in(module: "ModuleType", names: "list[str] | tuple[str, ...]") -> "Any":
    """The first object named in ``names`` that ``module`` defines itself (not one it imports), or None."""
    for name in names:
        found = vars(module).get(name)
        if getattr(found, "__module__", None) == module.__name__:
            return found
    return None


def distribution_version(distribution: str) -> "str | None":
    """Installed version of ``distribution``, or None (importlib.metadata loaded only when asked)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# modules `import mtp_overlay` must never pull in: it runs in every interpreter once the startup hook is
# installed (checked by tests/contract/test_lifecycle.py and scripts/bench_import.py)
HEAVY_IMPORTS = (
    "torch", "megatron", "vllm", "ray", "transformers", "wrapt", "importlib.metadata", "asyncio",
    "packaging", "inspect", "json", "dataclasses",
)
