"""vllm-mtp-drafter-load: a refit that leaves vLLM's MTP drafter stale is reported, not silently accepted.

Two ways a drafter goes stale without a word, one promise: the fix says so.

1. A refit of the drafter that loads the wrong names (`accounting`). vLLM's MTP drafters skip every
   checkpoint name they do not recognise: ``NemotronHMTP.load_weights`` reads only ``mtp.*`` (after
   ``language_model.`` in 0.33.0, not at all in 0.25.1), ``DeepSeekMTP.load_weights`` only positional
   ``model.layers.<num_hidden_layers + i>.``. A refit whose MTP weights arrive in the other naming, or
   never arrive, returns normally and the drafter keeps its old head (vLLM #43456: 0% acceptance from a
   silent skip; NeMo-RL PR #3494). A tensor longer than its layer is narrowed to the parameter by vLLM's
   parallel loaders, also without a word. vLLM's own completeness checks do not cover refits: the
   initial load's "weights were not initialized" check runs only in ``DefaultModelLoader``, DeepSeek's
   per-call layer check is switched off by the weight-transfer engines (``disable_mtp_completeness_check``:
   a chunked refit fails it by design), and ``reload_weights`` warns only for the target model.

   The drafters' ``load_weights`` is wrapped; it observes the names and shapes of the stream as the
   drafter consumes it (no tensor is read or copied) and the parameters it returns. A refit ends with a
   report when some of the drafter's MTP parameters were never loaded, MTP checkpoint names (either
   naming, `mtp_overlay.mtp.refit.mtp_layer_of`) were dropped (skipped by the drafter's own rule,
   ``is_unused_checkpoint_weight`` / DeepSeek's ``get_spec_layer_idx_from_weight_name``, or, where it
   has none, nothing of their MTP layer was loaded), or an MTP tensor's shape is not its layer's. Where a
   refit begins and ends (vLLM calls ``load_weights`` once per chunk: NeMo-RL #2999): vLLM's layerwise
   reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` of the drafter: its draft
   sessions and, 0.25.1, ``reload_weights``), or `drafter_refit(drafter)` for trainers that call
   ``load_weights`` themselves. Outside both every call is judged at its end (dropped names, shapes;
   strict mode raises there, after vLLM loaded what it could) and the calls add up into an implicit
   refit for "never loaded", ended by a call that repeats a name an earlier call sent (one name twice in
   one call is one name).

2. A target refit that never reaches the drafter (`freshness`): vLLM 0.28+ refits the target only; the
   drafter needs its own session (``Worker.start_draft_weight_update``, vLLM PR #46725). Target refits
   and drafter refreshes are counted per model runner; when the target is ahead, the next target
   session start or the first ``execute_model`` after it says so, once per stale interval.
   `refits_behind` and `status()` give the number, `mtp_overlay.mtp.rollout_mtp_metrics` logs it.

A report is an OverlayWarning or, strict, an OverlayError; `last_refit_report` / `last_call_report`
return it either way. Parameters counted: every parameter of the drafter except its (shared or copied)
``embed_tokens`` and ``lm_head`` and quantization ``*_scale`` / ``zero_point`` parameters a checkpoint
need not carry.
"""

from ...contract import Marker, Verdict, defined_in, drifted, needed, redundant
from .. import Fix
from . import freshness
from .accounting import (
    FUSED,
    SHOWN,
    DrafterShape,
    RefitReport,
    begin_on_reload,
    begin_refit,
    checked_load_weights,
    counted,
    discard_refit,
    end_on_reload,
    end_refit,
    last_call_report,
    last_refit_report,
    shape_of,
    skip_rule,
)
from .declaration import DECLARATION
from .freshness import drafter_of, refits_behind, staleness
from .tables import is_drafter

TYPE_CHECKING = False
if TYPE_CHECKING:
    import inspect
    from collections.abc import Callable, Iterator
    from types import ModuleType, TracebackType
    from typing import Any, Literal

    from .accounting import RefitReport

__all__ = ["FIX", "FUSED", "SHOWN", "DrafterShape", "RefitReport", "begin_refit", "checked_load_weights", "counted",
           "discard_refit", "drafter_of", "drafter_refit", "end_refit", "is_drafter", "last_call_report",
           "last_refit_report", "refits_behind", "shape_of", "skip_rule", "staleness"]

# drafter target role -> the class its module defines, whose load_weights(self, weights) returns the
# names of the parameters it loaded: NemotronHMTP (mtp.* naming), DeepSeekMTP (positional naming)
DRAFTERS = {"drafter_nemotron_h": "NemotronHMTP", "drafter_deepseek": "DeepSeekMTP"}
# vLLM's layerwise reload, whose begin/end bracket a refit (where it is defined, and where it is bound by name)
BEGIN, END = "initialize_layerwise_reload", "finalize_layerwise_reload"
RELOAD_WRAPPERS = {BEGIN: begin_on_reload, END: end_on_reload}
RELOADS = ("reload_layerwise", "reload", "reload_inplace")
# the Worker's session methods, and the model runners' (V1 and Model Runner V2) refit and step
WORKER = {"start_weight_update": freshness.on_target_session_start, "finish_weight_update": freshness.on_session_finish}
RUNNER = {"reload_weights": freshness.on_reload_weights, "execute_model": freshness.on_execute_model}
RUNNERS = ("runner_v1", "runner_v2")
ENGINE_BASE = "vllm.distributed.weight_transfer.base"  # WeightTransferEngine.supports_draft_weight_update


class drafter_refit:
    """``with drafter_refit(drafter): ...`` makes the ``load_weights`` calls of the block one refit,
    reported when the block exits normally (an exception discards it: the refit already failed).

    Works with the runtime hook and with the source patch (vLLM's own ``MTPDrafterRefits``); a no-op
    when the fix is disabled. ``.report`` holds the RefitReport after the block (hook only).
    """

    def __init__(self, model: "Any") -> None:
        self._begin: "Callable[[Any], object]"
        self._end: "Callable[[Any], RefitReport | None]"
        self._discard: "Callable[[Any], object]"
        self.report: "RefitReport | None"
        self.model, self.report = model, None
        if is_drafter(model):
            self._begin, self._end, self._discard = begin_refit, end_refit, discard_refit
        elif FIX._patched(getattr(type(model), "load_weights", _no_code)):
            # a vLLM carrying the source patch only
            from vllm.model_executor.models.utils import MTPDrafterRefits  # type: ignore[attr-defined]

            self._begin, self._end, self._discard = MTPDrafterRefits.begin, MTPDrafterRefits.end, MTPDrafterRefits.discard
        elif type(model).__name__ in DRAFTERS.values():
            self._begin = self._end = self._discard = _no_code  # the fix is disabled
        else:
            raise TypeError(f"model must be a vLLM MTP drafter ({', '.join(DRAFTERS.values())}), got {type(model).__name__}")

    def __enter__(self) -> "drafter_refit":
        self._begin(self.model)
        return self

    def __exit__(self, kind: "type[BaseException] | None", value: "BaseException | None",
                 traceback: "TracebackType | None") -> "Literal[False]":
        if kind is None:
            self.report = self._end(self.model)
        else:
            self._discard(self.model)
        return False


def _no_code(*args: object) -> None:
    """The refit boundaries of a disabled fix, and what a class without load_weights offers."""
    return None


def _parameters(function: "Callable[..., Any]") -> "list[inspect.Parameter]":
    import inspect

    return list(inspect.signature(function).parameters.values())


class VllmMtpDrafterLoadFix(Fix):
    declaration = DECLARATION  # targets: the drafters (DRAFTERS), the layerwise reload, the Worker, the runners

    def _patched(self, function: "Any") -> bool:
        """Whether ``function`` calls the source patch's helper."""
        if not hasattr(function, "__code__"):
            return False
        return Marker(function.__module__, function.__qualname__, self.marker.calls).in_function(function)

    def probe(self, module: "ModuleType") -> Verdict:
        role = self.role_of(module)
        if role in DRAFTERS:
            return self._probe_drafter(module, DRAFTERS[role])
        if role in RELOADS:
            return self._probe_reload(module)
        if role == "worker":
            return self._probe_worker(module)
        return self._probe_methods(module, "GPUModelRunner", RUNNER, "a target refit that skips the drafter is counted "
                                   "here (reload_weights) and reported at the next step (execute_model)")

    def _probe_drafter(self, module: "ModuleType", name: str) -> Verdict:
        owner = defined_in(module, [name])
        if owner is None:
            return drifted(f"{module.__name__} has no {name}")
        method = vars(owner).get("load_weights")
        if method is None:
            return drifted(f"{owner.__name__} defines no load_weights")
        if self._patched(method):
            return redundant(f"{owner.__name__}.load_weights already calls {self.marker.calls} (patched on disk)")
        names = [p.name for p in _parameters(method)]
        if names != ["self", "weights"]:
            return drifted(f"{owner.__name__}.load_weights{tuple(names)} is no longer ('self', 'weights')")
        return needed(f"{owner.__name__}.load_weights skips unrecognised names without a word")

    def _probe_reload(self, module: "ModuleType") -> Verdict:
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

    def _probe_methods(self, module: "ModuleType", name: str, methods: "dict[str, Any]", why: str) -> Verdict:
        owner = defined_in(module, [name])
        if owner is None:
            return drifted(f"{module.__name__} has no {name}")
        missing = [method for method in methods if method not in vars(owner)]
        if missing:
            return drifted(f"{name} defines no {' nor '.join(missing)}")
        if any(self._patched(vars(owner)[method]) for method in methods):
            return redundant(f"{name}.{'/'.join(methods)} already call {self.marker.calls} (patched on disk)")
        return needed(why)

    def _probe_worker(self, module: "ModuleType") -> Verdict:
        verdict = self._probe_methods(module, "Worker", WORKER, "")
        if verdict.state != "needed":
            return verdict
        if not hasattr(vars(module)["Worker"], "start_draft_weight_update"):
            return needed("no draft sessions in this release: a target session never refreshes the MTP drafter, "
                          "only the drafter's own load_weights does")
        import importlib

        try:  # what the Worker itself imports: the engines' base, which says whether an engine can
            base = importlib.import_module(ENGINE_BASE)
        except ModuleNotFoundError:
            return drifted(f"Worker.start_draft_weight_update exists but {ENGINE_BASE} does not")
        if not hasattr(getattr(base, "WeightTransferEngine", None), "supports_draft_weight_update"):
            return drifted("Worker.start_draft_weight_update exists but WeightTransferEngine declares no "
                           "supports_draft_weight_update")
        return needed("a target session leaves the MTP drafter as it was (Worker.start_draft_weight_update "
                      "refreshes it, vLLM PR #46725; engines say if they can: supports_draft_weight_update)")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        role = self.role_of(module)
        if role in DRAFTERS:
            yield defined_in(module, [DRAFTERS[role]]), "load_weights", checked_load_weights
        elif role in RELOADS:
            for name, wrapper in RELOAD_WRAPPERS.items():
                if name in vars(module):
                    yield module, name, wrapper
        elif role == "worker":
            worker = vars(module)["Worker"]
            for name, wrapper in WORKER.items():
                yield worker, name, wrapper
            if "update_weights" in vars(worker):  # a target session raising halfway counts; the probe needs it not
                yield worker, "update_weights", freshness.on_update_weights
        elif role in RUNNERS:
            runner = vars(module)["GPUModelRunner"]
            for name, wrapper in RUNNER.items():
                yield runner, name, wrapper

    def details(self) -> "dict[str, Any]":
        """The staleness of every drafter met in this process (`staleness`), for `mtp_overlay.status`."""
        drafters = staleness()
        if not drafters:
            return {}
        said = [f"{row['drafter']} {row['refits_behind']} target refit(s) behind" for row in drafters]
        return {"drafters": drafters, "note": "; ".join(said)}


FIX = VllmMtpDrafterLoadFix()
