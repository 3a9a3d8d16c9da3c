"""The fixes, one package each (``<fix_id>/``), and `Fix`, the class every one of them fills in.

A fix package holds ``declaration.py`` (``DECLARATION``: its targets by role, distribution, release
families, provenance, marker, the fixes it requires or reads: data only, the table and the READMEs'
fact blocks are generated from it), ``__init__.py`` (``FIX``, an instance of its `Fix` subclass: the
probe and the wrappers) and ``README.md`` (the generated fact block, then why the fix exists).
"""

from .. import lifecycle

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from types import ModuleType
    from typing import Any

    from ..contract import Declaration, Marker, Provenance, Verdict
    from ..lifecycle import Lifecycle


class Fix:
    """One fix: how it recognises the bug in a target module (`probe`) and what it wraps there
    (`wrappers`). Everything else is its ``declaration``, which the subclass names
    (``declaration = DECLARATION``) and this class reads: name, targets, distribution, ...

    Targets are known by role (`target`, `role_of`), never by position. The bookkeeping every fix
    shares (probe-then-wrap, no stacking, identity restore, warn or raise) is its `lifecycle`'s.
    """

    declaration: "Declaration"
    _lifecycle: "Lifecycle | None" = None  # set by the Lifecycle that loads the fix

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def summary(self) -> str:
        return self.declaration.summary

    @property
    def distribution(self) -> str:
        return self.declaration.distribution

    @property
    def provenance(self) -> "Provenance":
        return self.declaration.provenance

    @property
    def marker(self) -> "Marker":
        """The declared Marker (ValueError for a fix that declares none)."""
        marker = self.declaration.marker
        if marker is None:
            raise ValueError(f"fix {self.name!r} declares no marker")
        return marker

    @property
    def families(self) -> "dict[str, str]":
        return self.declaration.families

    @property
    def targets(self) -> "dict[str, str]":
        """role -> module: the modules whose import installs the fix."""
        return self.declaration.targets

    def target(self, role: str) -> str:
        """The module name of target ``role``."""
        return self.declaration.target(role)

    def role_of(self, module: "ModuleType | str") -> str:
        """The role of target ``module`` (a module or its name)."""
        return self.declaration.role_of(module)

    def family_of(self, version: str) -> "str | None":
        return self.declaration.family_of(version)

    def fixed_upstream_in(self, version: str) -> bool:
        return self.declaration.fixed_upstream_in(version)

    @property
    def lifecycle(self) -> "Lifecycle":
        """Its `mtp_overlay.lifecycle.Lifecycle`: where a fix whose work goes beyond wrappers records
        and reports (also for a fix module imported directly, which the Lifecycle then binds)."""
        if self._lifecycle is None:
            lifecycle.of(self.name).fix  # loads this fix's module, whose FIX the Lifecycle binds
        if self._lifecycle is None:  # an instance that is not its module's FIX
            raise RuntimeError(f"this {type(self).__name__} is not the FIX of fix {self.name!r}: it has no Lifecycle")
        return self._lifecycle

    def peer_state(self, fix_id: str) -> "tuple[str, str]":
        """(state, reason) of fix ``fix_id`` in this process, which the declaration must name in
        ``reads`` (or ``requires``): ValueError otherwise."""
        return self.lifecycle.peer_state(fix_id)

    def probe(self, module: "ModuleType") -> "Verdict":
        """Return a Verdict for the imported target ``module``: needed, redundant or drifted."""
        raise NotImplementedError(f"fix {self.name!r} has no probe")

    def wrappers(self, module: "ModuleType") -> "Iterable[tuple[Any, str, Any]]":
        """Yield ``(owner, attribute, wrapper)``: wrapt-style wrappers to put on ``module``."""
        return ()

    def details(self) -> "dict[str, Any]":
        """What the installed fix has seen in this process, JSON-able, for `status()` rows (``details``);
        a ``"note"`` entry (one line) also goes into the row's reason. {} for a fix with nothing to say."""
        return {}
