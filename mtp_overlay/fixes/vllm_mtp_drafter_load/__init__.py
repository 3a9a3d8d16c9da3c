"""vllm-mtp-drafter-load: a refit that leaves vLLM's MTP drafter stale is reported, not silently accepted.

vLLM's MTP drafters skip every checkpoint name they do not recognise without a word:
``NemotronHMTP.load_weights`` reads only ``mtp.*`` (after ``language_model.`` in 0.33.0, not at all
in 0.25.1), ``DeepSeekMTP.load_weights`` only positional ``model.layers.<num_hidden_layers + i>.``.
A refit whose MTP weights arrive in the other naming, or never arrive, returns normally and the
drafter keeps its old head: acceptance falls and nobody is told (vLLM #43456: 0% acceptance from a
silent skip; NeMo-RL PR #3494: "No MTP layer weights for layers [88] found" where the naming
mismatch did fail loudly, a frozen drafter where it did not). vLLM's own completeness checks do not
cover refits: the initial load's "weights were not initialized" check runs only in
``DefaultModelLoader``, DeepSeek's per-call layer check is switched off by the weight-transfer engines
(``disable_mtp_completeness_check``: a chunked refit fails it by design), and ``reload_weights`` warns
only for the target model.

The fix wraps the drafters' ``load_weights``: it observes the names of the stream as the drafter
consumes it (no tensor is touched or copied) and the set of parameter names the drafter returns, and
adds them up over one *refit*. A refit ends with a report when some of the drafter's MTP parameters
were never loaded, or when MTP checkpoint names (either naming, `mtp_overlay.mtp.refit.mtp_layer_of`)
were dropped: skipped by the drafter's own name rule (``is_unused_checkpoint_weight``, DeepSeek's
``get_spec_layer_idx_from_weight_name``) or, where it has none, nothing of their MTP layer was loaded. The report is an OverlayWarning (one per refit,
numbered) or, strict, an OverlayError; `last_refit_report` returns it either way.

Where a refit begins and ends (vLLM calls ``load_weights`` once per chunk: NeMo-RL #2999):

1. vLLM's reload lifecycle: ``initialize_layerwise_reload(drafter)`` begins, and
   ``finalize_layerwise_reload(drafter, ...)`` ends it. vLLM 0.25.1 and 0.33.0 run every refit of
   theirs between the two: ``reload_weights`` and the NCCL / IPC (and, 0.33.0, draft-session
   ``start_draft_weight_update``) engines' ``start_weight_update`` / ``finish_weight_update``.
2. `drafter_refit(drafter)`: a context manager for trainers that call ``load_weights`` chunk by chunk
   themselves (NeMo-RL's collective / IPC update paths); nested blocks count as one refit.
3. Otherwise (no refit open) calls accumulate into an implicit refit, which ends when a name it has
   already seen arrives again (a trainer sends the same names every refit: the next refit has begun)
   or at the next boundary of 1. or 2. It is reported then, one refit late; vLLM's initial load
   (one ``load_weights`` call) is such a refit, closed silently by the first refit when complete.

Parameters counted: every parameter of the drafter except its (shared or copied) ``embed_tokens`` and
``lm_head`` and quantization ``*_scale`` / ``zero_point`` parameters a checkpoint need not carry.
"""

from _thread import RLock

from ...calls import argument, with_argument
from ...contract import Marker, OverlayError, OverlayWarning, Verdict, defined_in, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

# drafter target role -> the class its module defines, whose load_weights(self, weights) returns the
# names of the parameters it loaded: NemotronHMTP (mtp.* naming), DeepSeekMTP (positional naming); the
# other targets are vLLM's layerwise reload modules, whose begin/end bracket a refit
DRAFTERS = {"drafter_nemotron_h": "NemotronHMTP", "drafter_deepseek": "DeepSeekMTP"}
BEGIN, END = "initialize_layerwise_reload", "finalize_layerwise_reload"
SHOWN = 32  # names listed in a report's message; the report object holds them all

_lock = RLock()
# per drafter, made on first use (weakref is not imported at interpreter start: `import mtp_overlay`
# stays cheap): "refits" -> open Refit, "shapes" -> DrafterShape, "reports" -> last RefitReport,
# "counts" -> refits closed so far
_tables: "dict[str, Any]" = {}


def _table(name):
    table = _tables.get(name)
    if table is None:
        import weakref

        table = _tables[name] = weakref.WeakKeyDictionary()
    return table


class DrafterShape:
    """What a drafter loads: its counted parameters, the MTP layer (from 0) each belongs to, and the
    drafter's own rule for the checkpoint names it skips (None where it has none to ask)."""

    __slots__ = ("num_hidden_layers", "num_mtp_layers", "layer_of", "skips")

    def __init__(self, model):
        import re

        keys = sorted(int(key) for key in model.model.layers.keys())
        first = keys[0] if keys else 0
        self.num_hidden_layers = int(model.config.num_hidden_layers)
        self.num_mtp_layers = len(keys)
        in_layer = re.compile(r"model\.layers\.(\d+)\.")
        self.layer_of = {}  # counted parameter -> MTP layer, None for one outside the layers
        for name, _ in model.named_parameters():
            if counted(name):
                match = in_layer.match(name)
                self.layer_of[name] = int(match.group(1)) - first if match else None
        self.skips = skip_rule(model)


def skip_rule(model):
    """The drafter's own test for names it does not read: ``is_unused_checkpoint_weight`` (vLLM 0.33.0
    NemotronHMTP), else the ``get_spec_layer_idx_from_weight_name`` its module's loop asks (DeepSeekMTP:
    None means skipped); None when it has neither (vLLM 0.25.1 NemotronHMTP)."""
    import sys

    unused = getattr(model, "is_unused_checkpoint_weight", None)
    if unused is not None:
        return unused
    spec_layer = getattr(sys.modules.get(type(model).__module__), "get_spec_layer_idx_from_weight_name", None)
    if spec_layer is not None:
        return lambda name: spec_layer(model.config, name) is None
    return None


def counted(parameter):
    """Whether a refit must load ``parameter`` (not the shared embedding / head, not a quant scale)."""
    parts = parameter.split(".")
    last = parts[-1]
    return not ("embed_tokens" in parts or parts[0] == "lm_head" or last.endswith("_scale") or last in ("scale", "zero_point"))


def shape_of(model):
    shapes = _table("shapes")
    shape = shapes.get(model)
    if shape is None:
        shape = shapes[model] = DrafterShape(model)
    return shape


class Refit:
    """What one refit has done so far: calls, names seen, MTP names with their layer, parameters loaded."""

    __slots__ = ("boundary", "depth", "calls", "names", "seen", "mtp_names", "loaded")

    def __init__(self, boundary):
        self.boundary = boundary  # None: implicit
        self.depth, self.calls, self.names = 1, 0, 0
        self.seen, self.mtp_names, self.loaded = set(), [], set()


class RefitReport:
    """The outcome of one refit of one drafter; ``ok`` when nothing is missing or dropped."""

    __slots__ = ("drafter", "number", "boundary", "calls", "names", "parameters", "missing", "dropped")

    def __init__(self, model, refit, number):
        shape = shape_of(model)
        self.drafter, self.number, self.boundary = type(model).__name__, number, refit.boundary or "load_weights calls"
        self.calls, self.names, self.parameters = refit.calls, refit.names, len(shape.layer_of)
        self.missing = sorted(name for name in shape.layer_of if name not in refit.loaded)
        loaded_layers = {shape.layer_of[name] for name in refit.loaded if name in shape.layer_of}
        self.dropped = [name for name, layer, skipped in refit.mtp_names if skipped or layer not in loaded_layers]

    @property
    def ok(self):
        return not self.missing and not self.dropped

    def message(self):
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} of {self.parameters} MTP parameters never loaded: {_listed(self.missing)}")
        if self.dropped:
            parts.append(f"{len(self.dropped)} MTP checkpoint names dropped unrecognised: {_listed(self.dropped)}")
        return (f"vLLM MTP drafter {self.drafter}, refit #{self.number} ({self.boundary}: {self.calls} load_weights "
                f"call(s), {self.names} names): " + "; ".join(parts) + ". The drafter keeps its old MTP head "
                "and rollout acceptance falls (vLLM #43456, NeMo-RL PR #3494); the drafter reads "
                f"{_naming(self.drafter)}")

    def __repr__(self):
        return f"RefitReport({self.drafter}, #{self.number}, missing={len(self.missing)}, dropped={len(self.dropped)})"


def _listed(names):
    more = f" ... and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _naming(drafter):
    return {"NemotronHMTP": "mtp.layers.<i>.* names", "DeepSeekMTP": "model.layers.<num_hidden_layers + i>.* names"}.get(
        drafter, "its own checkpoint naming")


# --- refit boundaries ------------------------------------------------------------------------
def begin_refit(model, boundary="drafter_refit()"):
    """Open an explicit refit of ``model`` (an implicit one still open is closed and reported first)."""
    closed = None
    with _lock:
        refit = _table("refits").get(model)
        if refit is not None and refit.boundary is not None:
            refit.depth += 1
            return
        if refit is not None:
            closed = _close(model)
        _table("refits")[model] = Refit(boundary)
    _emit(closed)


def end_refit(model):
    """Close the refit of ``model`` (its outermost level) and report it; returns the RefitReport or None."""
    with _lock:
        refit = _table("refits").get(model)
        if refit is None:
            return None
        refit.depth -= 1
        if refit.depth > 0:
            return None
    return _emit(_close(model))


def discard_refit(model):
    """Forget the open refit of ``model`` without a report (the refit itself failed)."""
    with _lock:
        _table("refits").pop(model, None)


class drafter_refit:
    """``with drafter_refit(drafter): ...`` makes the ``load_weights`` calls of the block one refit,
    reported when the block exits normally (an exception discards it: the refit already failed).

    Works with the runtime hook and with the source patch (vLLM's own ``MTPDrafterRefits``); a no-op
    when the fix is disabled. ``.report`` holds the RefitReport after the block (hook only).
    """

    def __init__(self, model):
        self.model, self.report = model, None
        if is_drafter(model):
            self._begin, self._end, self._discard = begin_refit, end_refit, discard_refit
        elif FIX._patched(getattr(type(model), "load_weights", _no_code)):
            from vllm.model_executor.models.utils import MTPDrafterRefits

            self._begin, self._end, self._discard = MTPDrafterRefits.begin, MTPDrafterRefits.end, MTPDrafterRefits.discard
        elif type(model).__name__ in DRAFTERS.values():
            self._begin = self._end = self._discard = _no_code  # the fix is disabled
        else:
            raise TypeError(f"model must be a vLLM MTP drafter ({', '.join(DRAFTERS.values())}), got {type(model).__name__}")

    def __enter__(self):
        self._begin(self.model)
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.report = self._end(self.model)
        else:
            self._discard(self.model)
        return False


def _no_code(*args):
    """The refit boundaries of a disabled fix, and what a class without load_weights offers."""
    return None


def last_refit_report(model):
    """The RefitReport of the last refit of ``model`` that ended (None before the first)."""
    return _table("reports").get(model)


def _close(model):
    """Close the open refit of ``model``: its RefitReport (stored; not yet emitted)."""
    refit = _table("refits").pop(model)
    counts = _table("counts")
    number = counts[model] = counts.get(model, 0) + 1
    report = _table("reports")[model] = RefitReport(model, refit, number)
    return report


def _emit(report):
    if report is not None and not report.ok:
        if FIX.lifecycle.strict:
            raise OverlayError(f"mtp-overlay fix {FIX.name!r}: {report.message()}")
        import warnings

        warnings.warn(OverlayWarning(f"mtp-overlay fix {FIX.name!r}: {report.message()}"), stacklevel=4)
    return report


# --- the wrappers ----------------------------------------------------------------------------
def _observed(model, refit, weights, closed):
    """Yield the pairs of ``weights`` as they are, counting names into ``refit`` (the open refit of
    ``model``); a name an implicit refit has seen already starts a new one (the old goes to ``closed``)."""
    from ...mtp.refit import mtp_layer_of

    shape = shape_of(model)
    base, count, skips = shape.num_hidden_layers, shape.num_mtp_layers, shape.skips
    in_this_call = 0
    for pair in weights:
        name = pair[0]
        if refit.boundary is None and name in refit.seen:
            if not in_this_call:  # the call that begins the next refit is not part of the old one
                refit.calls -= 1
            closed.append(_close(model))
            refit = _table("refits")[model] = Refit(None)
            refit.calls = 1
        in_this_call += 1
        refit.seen.add(name)
        refit.names += 1
        if "mtp" in name or "layers." in name:
            found = mtp_layer_of(name, base, count)
            if found is not None:
                refit.mtp_names.append((name, found[1], skips is not None and skips(name)))
        yield pair


def checked_load_weights(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                         kwargs: "dict[str, Any]") -> "Any":
    """The drafter's ``load_weights`` on its stream as given; the loaded names counted into the refit."""
    try:
        weights = argument(args, kwargs, 0, "weights")
    except TypeError:
        return wrapped(*args, **kwargs)  # vLLM's own TypeError
    closed: "list[RefitReport]" = []
    refits = _table("refits")
    with _lock:
        refit = refits.get(instance)
        if refit is None:
            refit = refits[instance] = Refit(None)
        refit.calls += 1
    try:
        args, kwargs = with_argument(args, kwargs, 0, "weights", _observed(instance, refit, weights, closed))
        loaded = wrapped(*args, **kwargs)
    except BaseException:
        with _lock:
            if getattr(refits.get(instance), "boundary", "") is None:  # an implicit refit died with its call
                refits.pop(instance)
        raise
    refit = refits.get(instance)  # a new one when this call began the next implicit refit
    if refit is not None:
        refit.loaded.update(loaded or ())
    for report in closed:
        _emit(report)
    return loaded


def _model_argument(args: "tuple[Any, ...]", kwargs: "dict[str, Any]") -> "Any":
    return argument(args, kwargs, 0, "model", None)


def is_drafter(model):
    wrapped = FIX.lifecycle.wrapped()
    return any((owner, "load_weights") in wrapped for owner in type(model).__mro__)


def begin_on_reload(wrapped, instance, args, kwargs):
    """vLLM's ``initialize_layerwise_reload``: a drafter's refit begins."""
    result = wrapped(*args, **kwargs)
    model = _model_argument(args, kwargs)
    if is_drafter(model):
        begin_refit(model, "vLLM layerwise reload")
    return result


def end_on_reload(wrapped, instance, args, kwargs):
    """vLLM's ``finalize_layerwise_reload``: the drafter's refit ends and is reported."""
    model = _model_argument(args, kwargs)
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        if is_drafter(model):
            discard_refit(model)
        raise
    if is_drafter(model):
        end_refit(model)
    return result


RELOAD_WRAPPERS = {BEGIN: begin_on_reload, END: end_on_reload}


def _parameters(function):
    import inspect

    return list(inspect.signature(function).parameters.values())


class VllmMtpDrafterLoadFix(Fix):
    declaration = DECLARATION  # targets: the drafters (DRAFTERS), then vLLM's layerwise reload modules

    def _patched(self, function: "Any") -> bool:
        """Whether ``function`` calls the source patch's helper."""
        if not hasattr(function, "__code__"):
            return False
        return Marker(function.__module__, function.__qualname__, self.marker.calls).in_function(function)

    def probe(self, module: "ModuleType") -> Verdict:
        role = self.role_of(module)
        if role in DRAFTERS:
            owner = defined_in(module, [DRAFTERS[role]])
            if owner is None:
                return drifted(f"{module.__name__} has no {DRAFTERS[role]}")
            method = vars(owner).get("load_weights")
            if method is None:
                return drifted(f"{owner.__name__} defines no load_weights")
            if self._patched(method):
                return redundant(f"{owner.__name__}.load_weights already calls {self.marker.calls} (patched on disk)")
            names = [p.name for p in _parameters(method)]
            if names != ["self", "weights"]:
                return drifted(f"{owner.__name__}.load_weights{tuple(names)} is no longer ('self', 'weights')")
            return needed(f"{owner.__name__}.load_weights skips unrecognised names without a word")
        missing = [name for name in RELOAD_WRAPPERS if name not in vars(module)]
        if missing:  # a refit's boundary needs both its begin and its end
            return drifted(f"{module.__name__} has no {' nor '.join(missing)}")
        for name in RELOAD_WRAPPERS:
            function = vars(module)[name]
            if self._patched(function):
                return redundant(f"{name} already calls {self.marker.calls} (patched on disk)")
            first = _parameters(function)[0] if _parameters(function) else None
            if first is None or not (first.name == "model" or first.kind is first.VAR_POSITIONAL):
                return drifted(f"{name}{tuple(p.name for p in _parameters(function))} no longer takes the model first")
        return needed("vLLM's layerwise reload brackets every refit it runs")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        role = self.role_of(module)
        if role in DRAFTERS:
            owner = defined_in(module, [DRAFTERS[role]])
            yield owner, "load_weights", checked_load_weights
            return
        for name, wrapper in RELOAD_WRAPPERS.items():
            if name in vars(module):
                yield module, name, wrapper


FIX = VllmMtpDrafterLoadFix()
