"""The Fix contract every fix fills in, the one vocabulary of states, and the overlay's error types.

Loaded when a fix is first needed (a target's import, `status()`, `check()`), never by
``import mtp_overlay`` itself: that import runs in every interpreter once the startup hook is
installed and only knows the registry's table of fix ids and target modules.
"""


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
    FAILED = "failed"  # the hook (or the probe) raised
    ABSENT = "absent"  # the upstream distribution is not installed
    # what a probe finds in the upstream code (`check()`); REDUNDANT and DRIFTED are runtime states too
    NEEDED = "needed"  # upstream still has the bug: the fix goes in
    REDUNDANT = "redundant"  # upstream already carries the fix: stand down
    DRIFTED = "drifted"  # the target is missing or of an unknown shape: not applied
    UNSUPPORTED = "unsupported"  # the release does not import on this stack (or predates every patch)
    DISAGREES = "disagrees"  # `check --run`: the probe's reading and the stock run's behaviour differ
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

    def __init__(self, state, reason=""):
        self.state, self.reason = state, reason

    def __repr__(self):
        return f"Verdict({self.state!r}, {self.reason!r})"


def needed(reason=""):
    return Verdict(State.NEEDED, reason)


def redundant(reason):
    return Verdict(State.REDUNDANT, reason)


def drifted(reason):
    return Verdict(State.DRIFTED, reason)


class Provenance:
    """Where a fix comes from and where upstream fixed it (if it did)."""

    __slots__ = ("origin", "upstream_fix", "first_fixed_release")

    def __init__(self, origin, upstream_fix=None, first_fixed_release=None):
        self.origin = origin
        self.upstream_fix = upstream_fix
        self.first_fixed_release = first_fixed_release

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__slots__}


class Marker:
    """The sign that upstream carries a fix's behaviour: ``function`` of ``module`` references
    ``calls``, itself or through the functions of its own module it calls (upstream may move a fix
    into a helper). Read from the live code by the probe and from the file on disk by the patch
    engine, through the same walk, so the two never disagree on what "redundant" means."""

    __slots__ = ("module", "function", "calls")

    def __init__(self, module, function, calls):
        self.module, self.function, self.calls = module, function, calls

    @property
    def file(self):
        """The module's source file, relative to site-packages."""
        return self.module.replace(".", "/") + ".py"

    def in_function(self, function):
        """Whether ``function`` (wrappers looked through, ours included) reaches ``calls``."""
        import inspect

        function = inspect.unwrap(function)
        namespace, home = function.__globals__, function.__module__

        def local_function(name):
            found = namespace.get(name)
            found = inspect.unwrap(found) if callable(found) else None
            return found.__code__ if getattr(found, "__module__", None) == home and hasattr(found, "__code__") else None

        return self._reaches(function.__code__, local_function, set())

    def in_source(self, source, filename="<source>"):
        """Whether ``source`` (the module's text or bytes) defines ``function`` reaching ``calls``."""
        try:
            code = compile(source, filename, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            return False
        top = {const.co_name: const for const in code.co_consts if _is_function(const)}
        return any(self._reaches(found, top.get, set()) for found in _functions_named(code, self.function.split(".")))

    def _reaches(self, code, local_function, seen):
        if id(code) in seen:
            return False
        seen.add(id(code))
        if self.calls in code.co_names:
            return True
        inner = [const for const in code.co_consts if _is_function(const)]
        inner += [found for found in map(local_function, code.co_names) if found is not None]
        return any(self._reaches(found, local_function, seen) for found in inner)

    def __str__(self):
        return f"{self.function} already calls {self.calls}"


def _is_code(value):
    return hasattr(value, "co_names") and hasattr(value, "co_consts")


def _is_function(value):
    """A function's code (lambdas and comprehensions too), not a class body's."""
    return _is_code(value) and bool(value.co_flags & 0x1)  # CO_OPTIMIZED


def _functions_named(code, path):
    """Code objects reached from module ``code`` by the qualified name ``path`` (nested classes/functions)."""
    for const in code.co_consts:
        if _is_code(const) and const.co_name == path[0]:
            if len(path) == 1:
                yield const
            else:
                yield from _functions_named(const, path[1:])


class Fix:
    """One fix: what it patches, how it recognises the bug, what it wraps. A declaration only.

    A fix module (``mtp_overlay/fixes/<fix_id>/``) defines ``FIX``, an instance of a subclass that
    fills in the class attributes, `probe` and `wrappers`. Its target modules are the registry's
    (`mtp_overlay.registry.FIXES`); the bookkeeping every fix shares (probe-then-wrap, no stacking,
    identity restore, warn or raise) is `mtp_overlay.lifecycle`'s.
    """

    name = ""  # the fix id
    summary = ""
    distribution = ""  # the upstream distribution, as importlib.metadata names it
    provenance = None
    marker = None  # a Marker: upstream (or a source patch on disk) carries the behaviour
    # source-patch release families: name -> PEP 440 specifier of the releases its patch fits
    # (patches/<fix id>/<distribution>/<family>.patch)
    families = {}
    _lifecycle = None  # set by the Lifecycle that loads the fix

    @property
    def lifecycle(self):
        """Its `mtp_overlay.lifecycle.Lifecycle`: where a fix whose work goes beyond wrappers records
        and reports (the registry's, also for a fix module imported directly)."""
        if self._lifecycle is None:
            from . import registry

            registry.lifecycle(self.name).fix  # loads this fix through the registry, which binds it
        return self._lifecycle

    @property
    def targets(self):
        """The modules whose import installs the fix: the registry's."""
        return self.lifecycle.targets

    def probe(self, module):
        """Return a Verdict for the imported target ``module``."""
        raise NotImplementedError

    def wrappers(self, module):
        """Yield ``(owner, attribute, wrapper)``: wrapt-style wrappers to put on ``module``."""
        return ()

    def fixed_upstream_in(self, version):
        """Whether the provenance says upstream release ``version`` carries the fix."""
        from packaging.version import Version

        fixed_in = self.provenance.first_fixed_release if self.provenance else None
        return fixed_in is not None and Version(version) >= Version(fixed_in)

    def family_of(self, version):
        """The source-patch family whose range holds ``version``, or None."""
        from packaging.specifiers import SpecifierSet

        for family, versions in self.families.items():
            if SpecifierSet(versions).contains(version, prereleases=True):
                return family
        return None


class FixStatus:
    """One row of `status()` / `check()`: the fix, its upstream, and where it stands.

    ``state``: the fix in this process (`State.RUNTIME`); ``verdict``: what `check()`'s probe found
    in the installed upstream (`State.VERDICTS`), None in `status()` rows.
    """

    __slots__ = (
        "name", "summary", "distribution", "version", "state", "verdict", "reason", "late", "patched", "provenance",
    )

    def __init__(self, fix, version, state, reason, late=False, patched=None, verdict=None):
        self.name, self.summary, self.distribution = fix.name, fix.summary, fix.distribution
        self.version, self.state, self.verdict, self.reason, self.late = version, state, verdict, reason, late
        self.patched = patched  # source patch on disk: True, False, None (no variant for this install)
        self.provenance = fix.provenance.as_dict() if fix.provenance else None

    def as_dict(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self):
        return f"FixStatus({self.as_dict()})"


def defined_in(module, names):
    """The first object named in ``names`` that ``module`` defines itself (not one it imports), or None."""
    for name in names:
        found = vars(module).get(name)
        if getattr(found, "__module__", None) == module.__name__:
            return found
    return None


def distribution_version(distribution):
    """Installed version of ``distribution``, or None (importlib.metadata loaded only when asked)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None

