"""What a refit (or one ``load_weights`` call) did to a vLLM MTP drafter: names consumed, parameters
loaded, MTP names dropped, tensors whose shape is not the drafter's.

The drafter's ``load_weights`` is wrapped: the stream is observed as the drafter consumes it (names
and shapes only: no tensor is read, touched or copied) and the set of parameters it returns is added
to the open refit. Inside a refit boundary (vLLM's layerwise reload, `drafter_refit`) the calls add up
and the refit is judged at its end. Outside any boundary each call is judged at its own end (MTP names
dropped, shapes), and the calls add up into an implicit refit for "parameters never loaded", which
ends when a call carries a name an earlier call of it carried (the trainer's next refit began).
"""

import re

from ...calls import argument, with_argument
from .freshness import drafter_refreshed, target_reload_began, target_reloaded
from .tables import is_drafter, lock, say, table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from typing import Any

    Shape = tuple[int, ...]
    MtpName = tuple[str, "int | None", bool]  # (checkpoint name, MTP layer, skipped by the drafter's rule)
    MisShaped = tuple[str, Shape, Shape]  # (checkpoint name, its shape, the drafter's)

SHOWN = 32  # names listed in a report's message; the report object holds them all
# vLLM parameters that stack checkpoint tensors, with the checkpoint names of their shards in order
# (the stacked_params_mapping of NemotronHMTP, DeepSeekMTP and the DeepSeek-style drafters)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
_IN_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_LAYER_PREFIX = re.compile(r"layers\.\d+\.")


class DrafterShape:
    """What a drafter loads: its counted parameters, the MTP layer (from 0) each belongs to, the
    drafter's own rule for the checkpoint names it skips (None where it has none to ask), and the
    full checkpoint shape of every tensor a linear layer of an MTP layer loads (`expected_shapes`)."""

    __slots__ = ("num_hidden_layers", "num_mtp_layers", "layer_of", "skips", "expected")

    def __init__(self, model: "Any") -> None:
        keys = sorted(int(key) for key in model.model.layers.keys())
        first = keys[0] if keys else 0
        self.num_hidden_layers = int(model.config.num_hidden_layers)
        self.num_mtp_layers = len(keys)
        self.layer_of: "dict[str, int | None]" = {}  # counted parameter -> MTP layer, None for one outside the layers
        for name, _ in model.named_parameters():
            if counted(name):
                match = _IN_LAYER.match(name)
                self.layer_of[name] = int(match.group(1)) - first if match else None
        self.skips = skip_rule(model)
        self.expected = expected_shapes(model, first)


def skip_rule(model: "Any") -> "Callable[[str], object] | None":
    """The drafter's own test for names it does not read: ``is_unused_checkpoint_weight`` (vLLM 0.33.0
    NemotronHMTP), else the ``get_spec_layer_idx_from_weight_name`` its module's loop asks (DeepSeekMTP:
    None means skipped); None when it has neither (vLLM 0.25.1 NemotronHMTP)."""
    import sys

    unused: "Callable[[str], object] | None" = getattr(model, "is_unused_checkpoint_weight", None)
    if unused is not None:
        return unused
    spec_layer = getattr(sys.modules.get(type(model).__module__), "get_spec_layer_idx_from_weight_name", None)
    if spec_layer is not None:
        return lambda name: spec_layer(model.config, name) is None
    return None


def expected_shapes(model: "Any", first: int) -> "dict[tuple[int | None, str], Shape]":
    """``{(MTP layer, name after its layers.<k>.): full checkpoint shape}`` for the weights and biases
    of the unquantized vLLM linear layers of the MTP layers (stacked ones per shard, `FUSED`).

    Why these: vLLM's column- and row-parallel loaders (``ColumnParallelLinear``, ``RowParallelLinear``,
    ``MergedColumnParallelLinear``, ``QKVParallelLinear``) narrow the checkpoint tensor to this rank's
    slice of the parameter and never look at the rest, so a tensor longer than the layer is loaded
    truncated without a word (replicated layers, norms and embeddings compare the whole shape and
    raise). The full shape is the layer's, not this rank's: ``input_size`` / ``output_size`` (and the
    shards' from ``output_sizes``, or QKV's total head counts, which also hold when KV heads are
    replicated across ranks). Quantized layers (packed weights) are not checked."""
    try:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    except ImportError:
        return {}
    found: "dict[tuple[int | None, str], Shape]" = {}
    for module_name, module in model.named_modules():
        parts = module_name.split(".")
        if (not isinstance(module, LinearBase) or type(getattr(module, "quant_method", None)) is not UnquantizedLinearMethod
                or parts[:2] != ["model", "layers"] or len(parts) < 4 or not parts[2].isdigit()):
            continue
        layer, path = int(parts[2]) - first, [part for part in parts[3:] if part != "mtp_block"]
        for kind, parameter in module.named_parameters(recurse=False):
            inputs = {"weight": (int(module.input_size),), "bias": ()}.get(kind)
            if inputs is None or parameter.dim() != len(inputs) + 1:
                continue
            shards = FUSED.get(path[-1])
            if shards is None:
                found[(layer, ".".join([*path, kind]))] = (int(module.output_size), *inputs)
                continue
            sizes = _shard_sizes(module, len(shards))
            for shard, size in zip(shards, sizes or ()):
                found[(layer, ".".join([*path[:-1], shard, kind]))] = (size, *inputs)
    return found


def _shard_sizes(module: "Any", count: int) -> "list[int] | None":
    """The full output size of each checkpoint shard of a stacked layer, or None when it is not one."""
    if hasattr(module, "total_num_heads"):  # QKVParallelLinear
        v_head = getattr(module, "v_head_size", module.head_size)
        sizes = [module.total_num_heads * module.head_size, module.total_num_kv_heads * module.head_size,
                 module.total_num_kv_heads * v_head]
    else:
        sizes = list(getattr(module, "output_sizes", None) or ())
    return [int(size) for size in sizes] if len(sizes) == count else None


def counted(parameter: str) -> bool:
    """Whether a refit must load ``parameter`` (not the shared embedding / head, not a quant scale)."""
    parts = parameter.split(".")
    last = parts[-1]
    return not ("embed_tokens" in parts or parts[0] == "lm_head" or last.endswith("_scale") or last in ("scale", "zero_point"))


def shape_of(model: "Any") -> DrafterShape:
    shapes = table("shapes")
    shape: "DrafterShape | None" = shapes.get(model)
    if shape is None:
        shape = shapes[model] = DrafterShape(model)
    return shape


class Call:
    """What one ``load_weights`` call consumed: names (a set: one name twice is one name), how many
    pairs, its MTP names ``(name, layer, skipped by the drafter's rule)``, its tensors of another
    shape than the drafter's ``(name, shape, expected)``."""

    __slots__ = ("names", "count", "mtp_names", "mis_shaped")

    def __init__(self) -> None:
        self.names: "set[str]" = set()
        self.count = 0
        self.mtp_names: "list[MtpName]" = []
        self.mis_shaped: "list[MisShaped]" = []


class Refit:
    """What one refit has done so far: calls, names (pairs) consumed, names seen by its earlier calls,
    MTP names and mis-shaped tensors not judged yet, parameters loaded."""

    __slots__ = ("boundary", "depth", "calls", "names", "seen", "mtp_names", "mis_shaped", "loaded")

    def __init__(self, boundary: "str | None") -> None:
        self.boundary = boundary  # None: implicit
        self.depth, self.calls, self.names = 1, 0, 0
        self.seen: "set[str]" = set()
        self.mtp_names: "list[MtpName]" = []
        self.mis_shaped: "list[MisShaped]" = []
        self.loaded: "set[str]" = set()

    def add(self, call: Call, loaded: "set[str]", judged: bool) -> None:
        """Count ``call`` in; its MTP names and shapes only when they were not ``judged`` already."""
        self.calls += 1
        self.names += call.count
        self.seen |= call.names
        self.loaded |= loaded
        if not judged:
            self.mtp_names.extend(call.mtp_names)
            self.mis_shaped.extend(call.mis_shaped)


class RefitReport:
    """The outcome of one refit of one drafter, or of one ``load_weights`` call outside any refit
    (``number`` None: names and shapes judged, "never loaded" left to its implicit refit); ``ok`` when
    nothing is missing, dropped or of another shape."""

    __slots__ = ("drafter", "number", "boundary", "calls", "names", "parameters", "missing", "dropped", "mis_shaped")

    def __init__(self, model: "Any", refit: Refit, number: "int | None", loaded: "set[str] | None" = None) -> None:
        shape = shape_of(model)
        self.drafter, self.number = type(model).__name__, number
        self.boundary = refit.boundary or ("load_weights calls" if number is not None else "one load_weights call")
        self.calls, self.names, self.parameters = refit.calls, refit.names, len(shape.layer_of)
        loaded = refit.loaded if loaded is None else loaded
        self.missing = [] if number is None else sorted(name for name in shape.layer_of if name not in loaded)
        loaded_layers = {shape.layer_of[name] for name in loaded if name in shape.layer_of}
        # "nothing of its layer loaded" needs the whole refit where the drafter has a rule of its own: one
        # chunk may carry only a name it maps outside the layer (DeepSeek's per-layer embed_tokens)
        by_layer = number is not None or shape.skips is None
        self.dropped = [name for name, layer, skipped in refit.mtp_names
                        if skipped or (by_layer and layer not in loaded_layers)]
        self.mis_shaped = list(refit.mis_shaped)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.dropped and not self.mis_shaped

    def message(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} of {self.parameters} MTP parameters never loaded: {_listed(self.missing)}")
        if self.dropped:
            parts.append(f"{len(self.dropped)} MTP checkpoint names dropped unrecognised: {_listed(self.dropped)}")
        if self.mis_shaped:
            shapes = [f"{name} {list(got)} for {list(expected)}" for name, got, expected in self.mis_shaped]
            parts.append(f"{len(shapes)} MTP tensors of another shape than the drafter's, which vLLM narrows to the "
                         f"parameter without a word: {_listed(shapes)}")
        where = (f"refit #{self.number} ({self.boundary}: {self.calls} load_weights call(s), {self.names} names)"
                 if self.number is not None else f"{self.boundary} outside any refit boundary ({self.names} names)")
        return (f"vLLM MTP drafter {self.drafter}, {where}: " + "; ".join(parts) + ". The drafter keeps (part of) "
                "its old MTP head and rollout acceptance falls (vLLM #43456, NeMo-RL PR #3494); the drafter reads "
                f"{_naming(self.drafter)}")

    def __repr__(self) -> str:
        return (f"RefitReport({self.drafter}, #{self.number}, missing={len(self.missing)}, dropped={len(self.dropped)}, "
                f"mis_shaped={len(self.mis_shaped)})")


def _listed(names: "list[str]") -> str:
    more = f" ... and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _naming(drafter: str) -> str:
    return {"NemotronHMTP": "mtp.layers.<i>.* names", "DeepSeekMTP": "model.layers.<num_hidden_layers + i>.* names"}.get(
        drafter, "its own checkpoint naming")


# --- refit boundaries ------------------------------------------------------------------------
def begin_refit(model: "Any", boundary: str = "drafter_refit()") -> None:
    """Open an explicit refit of ``model`` (an implicit one still open is closed and reported first)."""
    closed = None
    with lock:
        refit = table("refits").get(model)
        if refit is not None and refit.boundary is not None:
            refit.depth += 1
            return
        if refit is not None:
            closed = _close(model)
        table("refits")[model] = Refit(boundary)
    _emit(closed)


def end_refit(model: "Any") -> "RefitReport | None":
    """Close the refit of ``model`` (its outermost level) and report it; returns the RefitReport or None.
    A refit that loaded any of the drafter's parameters refreshed it (`freshness`)."""
    with lock:
        refit = table("refits").get(model)
        if refit is None:
            return None
        refit.depth -= 1
        if refit.depth > 0:
            return None
        report = _close(model)
        refreshed = any(name in shape_of(model).layer_of for name in refit.loaded)
    if refreshed:
        drafter_refreshed(model)
    return _emit(report)


def discard_refit(model: "Any") -> None:
    """Forget the open refit of ``model`` without a report (the refit itself failed)."""
    with lock:
        table("refits").pop(model, None)


def last_refit_report(model: "Any") -> "RefitReport | None":
    """The RefitReport of the last refit of ``model`` that ended (None before the first)."""
    report: "RefitReport | None" = table("reports").get(model)
    return report


def last_call_report(model: "Any") -> "RefitReport | None":
    """The RefitReport of the last ``load_weights`` call of ``model`` outside any refit boundary (each
    is judged at its end), None before the first."""
    report: "RefitReport | None" = table("calls").get(model)
    return report


def _close(model: "Any") -> "RefitReport":
    """Close the open refit of ``model``: its RefitReport (stored; not yet emitted)."""
    refit = table("refits").pop(model)
    counts = table("counts")
    number = counts[model] = counts.get(model, 0) + 1
    report = table("reports")[model] = RefitReport(model, refit, number)
    return report


def _emit(report: "RefitReport | None") -> "RefitReport | None":
    if report is not None and not report.ok:
        say(report.message())
    return report


# --- the wrapper -------------------------------------------------------------------------------
def _observed(model: "Any", call: Call, weights: "Iterable[Any]") -> "Iterator[Any]":
    """Yield the pairs of ``weights`` as they are, counting their names and checking the shapes of
    the MTP tensors the drafter reads into ``call``."""
    from ...mtp.refit import mtp_layer_of, strip_wrapper_prefix

    shape = shape_of(model)
    base, count, skips, expected = shape.num_hidden_layers, shape.num_mtp_layers, shape.skips, shape.expected
    for pair in weights:
        name = pair[0]
        call.names.add(name)
        call.count += 1
        if "mtp" in name or "layers." in name:
            found = mtp_layer_of(name, base, count)
            if found is not None:
                skipped = skips is not None and bool(skips(name))
                call.mtp_names.append((name, found[1], skipped))
                if not skipped and expected:
                    stripped = strip_wrapper_prefix(name)
                    layer = _LAYER_PREFIX.search(stripped)
                    wanted = expected.get((found[1], stripped[layer.end():])) if layer else None
                    got = getattr(pair[1], "shape", None)
                    if wanted is not None and got is not None and tuple(got) != wanted:
                        call.mis_shaped.append((name, tuple(got), wanted))
        yield pair


def checked_load_weights(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                         kwargs: "dict[str, Any]") -> "Any":
    """The drafter's ``load_weights`` on its stream as given; the call counted into the open refit."""
    try:
        weights = argument(args, kwargs, 0, "weights")
    except TypeError:
        return wrapped(*args, **kwargs)  # vLLM's own TypeError
    call = Call()
    try:
        args, kwargs = with_argument(args, kwargs, 0, "weights", _observed(instance, call, weights))
        loaded = wrapped(*args, **kwargs)
    except BaseException:
        with lock:
            if getattr(table("refits").get(instance), "boundary", "") is None:  # an implicit refit died with its call
                table("refits").pop(instance)
        raise
    reports, refreshed = _settle(instance, call, set(loaded or ()))
    if refreshed:
        drafter_refreshed(instance)
    for report in reports:
        _emit(report)
    return loaded


def _settle(model: "Any", call: Call, loaded: "set[str]") -> "tuple[list[RefitReport | None], bool]":
    """Count ``call`` (which loaded ``loaded``) into the refit of ``model``: the reports it makes now
    (an implicit refit it ended, its own judgement outside a boundary) and whether it refreshed the
    drafter (outside a boundary, by loading any of its parameters; inside, the refit's end decides)."""
    refits = table("refits")
    with lock:
        refit = refits.get(model)
        if refit is not None and refit.boundary is not None:
            refit.add(call, loaded, judged=False)
            return [], False
        closed = None
        if refit is not None and not refit.seen.isdisjoint(call.names):  # the next refit began with this call
            closed = _close(model)
            refit = None
        if refit is None:
            refit = refits[model] = Refit(None)
        judged = Refit(None)
        judged.add(call, loaded, judged=False)
        report = table("calls")[model] = RefitReport(model, judged, None, loaded)
        refit.add(call, loaded, judged=True)
        refreshed = any(name in shape_of(model).layer_of for name in loaded)
    return [closed, report], refreshed


def _model_argument(args: "tuple[Any, ...]", kwargs: "dict[str, Any]") -> "Any":
    return argument(args, kwargs, 0, "model", None)


def begin_on_reload(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                    kwargs: "dict[str, Any]") -> "Any":
    """vLLM's ``initialize_layerwise_reload``: a drafter's refit begins, or a target's weights start
    being replaced (`freshness.target_reload_began`)."""
    result = wrapped(*args, **kwargs)
    model = _model_argument(args, kwargs)
    if is_drafter(model):
        begin_refit(model, "vLLM layerwise reload")
    elif model is not None:
        target_reload_began(model)
    return result


def end_on_reload(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                  kwargs: "dict[str, Any]") -> "Any":
    """vLLM's ``finalize_layerwise_reload``: the drafter's refit ends and is reported; a target model's
    reload finished (`freshness.target_reloaded`)."""
    model = _model_argument(args, kwargs)
    drafter = is_drafter(model)
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        if drafter:
            discard_refit(model)
        raise
    if drafter:
        end_refit(model)
    elif model is not None:
        target_reloaded(model)
    return result
