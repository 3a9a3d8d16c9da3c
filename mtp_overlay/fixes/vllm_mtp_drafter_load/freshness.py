"""Drafter freshness: a target refit that never refreshes the MTP drafter is reported.

In vLLM 0.33.0 a target weight-update session, ``reload_weights`` and the layerwise reload of the
target replace the target's weights only (``Worker.finish_weight_update``, ``v1/worker/gpu_worker.py``;
``GPUModelRunner.reload_weights`` reloads ``get_model()``): the drafter keeps the MTP head it had,
while the embedding and LM head it shares with the target move (NemotronHMTP takes both from the
target, ``nemotron_h_mtp.py:420-424``). Its own session, ``Worker.start_draft_weight_update`` (vLLM PR
#46725), or a direct ``load_weights`` of the drafter refreshes it. Users met the silent version:
verl #6947 ("saved MTP weights remain unchanged"), vime PR #351 (target-only updates: ~0 % acceptance,
-26 % throughput; with the draft session 58.6 %, +50 %). Three of vLLM's engines cannot update a
drafter at all (``supports_draft_weight_update = False``: m2n, sharded RDT, sparse NCCL).

Per drafter and the target it drafts for (one model runner: `Freshness`) the fix counts target
refits and remembers at which one the drafter was last refreshed. A target refit is counted once
whichever way it came: ``Worker.finish_weight_update`` of a non-draft session, either runner's
``reload_weights``, or a finished layerwise reload of the target outside both (each of the first two
runs the third inside: an open boundary keeps it from counting twice; 0.25.1's Model Runner V2
``reload_weights`` runs V1's, also counted once). The drafter is refreshed by a refit of it (the
accounting's refit end, or a call outside any boundary) that loaded any of its parameters.

When the target is ahead, the next target session start (``Worker.start_weight_update``) or the first
``GPUModelRunner.execute_model`` after the refit says so, once per stale interval (strict mode:
OverlayError, raised before vLLM's method runs, at every start and step until the drafter is
refreshed). A target refit that raises after vLLM's layerwise reload of the target began (a session
whose ``update_weights`` meets one wrong-shaped tensor) has changed the target: it counts. The step's
own cost is one test of a module-level integer (`_due`, nonzero only while a report is owed); no
device work, no lookup. An engine that
cannot update the drafter is named at the first refit through it (a notice: a trainer may refresh
the drafter another way). vLLM 0.25.1 has no draft sessions: the report says to load the drafter.

Pairing: a runner's ``get_model()`` and ``get_draft_model()`` (0.25.1: its proposer's ``model``); a
target met only through a layerwise reload is paired with the drafter that shares its LM head or
embedding by identity (vLLM's ``load_eagle_model`` shares them).
"""

from .tables import is_drafter, life, lock, notice, say, table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_due = 0  # how many drafters owe a staleness report: the only thing a step reads


class Freshness:
    """One MTP drafter and the target it drafts for: target refits counted, the one at which the
    drafter was last refreshed, whether a report is owed for the stale interval, the open target refit
    boundaries, how the last target refit came, and what the worker's engine can do for the drafter."""

    __slots__ = ("drafter", "target", "refits", "refreshed_at", "due", "depth", "reloading", "last", "engine",
                 "sessions", "told", "__weakref__")

    def __init__(self, drafter: "Any") -> None:
        self.drafter: str = type(drafter).__name__  # class names: the tables hold the models weakly
        self.target: "str | None" = None
        self.refits = self.refreshed_at = self.depth = 0
        self.due = self.reloading = False  # reloading: vLLM's layerwise reload of the target began, uncounted
        self.last: "str | None" = None
        self.engine: "str | None" = None
        # "draft": the engine can; "engine cannot"; "none": the release has no draft sessions
        self.sessions: "str | None" = None
        self.told: "set[str | None]" = set()  # engines named in a notice

    @property
    def behind(self) -> int:
        return self.refits - self.refreshed_at

    def as_dict(self) -> "dict[str, object]":
        return {"drafter": self.drafter, "target": self.target, "target_refits": self.refits,
                "refreshed_at_target_refit": self.refreshed_at, "refits_behind": self.behind,
                "last_target_refit": self.last, "engine": self.engine}


# --- pairing ---------------------------------------------------------------------------------------
def drafter_of(runner: "Any") -> "Any":
    """The hooked MTP drafter of a vLLM model runner, or None: ``get_draft_model()`` where the runner
    has it (0.33.0), else its proposer's (V1 ``drafter``, V2 ``speculator``) ``model``, unwrapped."""
    try:
        get = getattr(runner, "get_draft_model", None)
        if get is not None:
            drafter = get()
        else:
            proposer = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
            drafter = getattr(proposer, "model", None)
            unwrap = getattr(drafter, "unwrap", None)
            drafter = unwrap() if callable(unwrap) else drafter
    except (AttributeError, ValueError):  # a runner whose models are not loaded yet
        return None
    return drafter if drafter is not None and is_drafter(drafter) else None


def _paired(target: "Any", drafter: "Any") -> Freshness:
    """The Freshness of ``drafter`` (made when it has none), now known to draft for ``target``."""
    drafters, target_models = table("drafters"), table("targets")
    record: "Freshness | None" = drafters.get(drafter)
    if record is None:
        record = drafters[drafter] = Freshness(drafter)
    record.target = type(target).__name__
    target_models[target] = record
    return record


def of_runner(runner: "Any") -> "Freshness | None":
    """The Freshness of ``runner``'s drafter and target (paired on first use); None without a drafter."""
    try:
        target = runner.get_model()
    except (AttributeError, ValueError):
        return None
    with lock:
        record: "Freshness | None" = table("targets").get(target)
        if record is not None:
            return record
        drafter = drafter_of(runner)
        return None if drafter is None else _paired(target, drafter)


def of_target(target: "Any") -> "Freshness | None":
    """The Freshness of ``target``: known, or paired with a drafter the fix has met that shares the
    target's LM head or embedding (by identity); None otherwise."""
    with lock:
        record: "Freshness | None" = table("targets").get(target)
        if record is not None:
            return record
        for drafter in list(table("drafters").keys()):
            if _shares(drafter, target):
                return _paired(target, drafter)
    return None


def _shares(drafter: "Any", target: "Any") -> bool:
    for path in (("lm_head",), ("model", "embed_tokens")):
        ours, theirs = drafter, target
        for step in path:
            ours, theirs = getattr(ours, step, None), getattr(theirs, step, None)
        if ours is not None and ours is theirs:
            return True
    return False


# --- the two generations ---------------------------------------------------------------------------
def target_refitted(record: Freshness, via: str) -> None:
    """A target refit counted: a stale interval that begins here owes a report."""
    global _due
    with lock:
        record.refits += 1
        record.reloading = False
        record.last = f"#{record.refits}, {via}"
        if record.behind == 1 and not record.due:
            record.due = True
            _due += 1


def drafter_refreshed(drafter: "Any") -> None:
    """The drafter loaded (part of) a new head: fresh against every target refit counted so far."""
    global _due
    with lock:
        drafters = table("drafters")
        record = drafters.get(drafter)
        if record is None:
            record = drafters[drafter] = Freshness(drafter)
        record.refreshed_at = record.refits
        if record.due:
            record.due = False
            _due -= 1


def target_reload_began(model: "Any") -> None:
    """vLLM's layerwise reload of ``model`` began: from here the target's weights are being replaced (its
    layers sit on the meta device until each is loaded), so a refit that raises later has changed it."""
    record = of_target(model)
    if record is not None:
        record.reloading = True


def target_reloaded(model: "Any") -> None:
    """vLLM's layerwise reload of ``model`` finished: a target refit unless a Worker / runner boundary
    around it counts it (or ``model`` drafts for nothing the fix knows)."""
    record = of_target(model)
    if record is not None and record.depth == 0:
        target_refitted(record, "vLLM layerwise reload (finalize_layerwise_reload)")


def _boundary(record: Freshness, via: str, wrapped: "Callable[..., Any]", args: "tuple[Any, ...]",
              kwargs: "dict[str, Any]") -> "Any":
    """Run ``wrapped`` as one target refit of ``record``: counted when the outermost boundary returns."""
    with lock:
        record.depth += 1
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        with lock:
            record.depth -= 1
            changed = record.depth == 0 and record.reloading
        if changed:
            target_refitted(record, f"{via}, which raised after vLLM began replacing the target's weights")
        raise
    with lock:
        record.depth -= 1
        outermost = record.depth == 0
    if outermost:
        target_refitted(record, via)
    return result


# --- what is said ----------------------------------------------------------------------------------
def check(record: Freshness, where: str) -> None:
    """Report a stale drafter if a report is owed: a warning once per stale interval; in strict mode an
    OverlayError at every target session start and step until the drafter is refreshed (a retry must
    not get past it)."""
    global _due
    with lock:
        if not record.due:
            return
        if not life().strict:
            record.due = False
            _due -= 1
    say(stale_message(record, where), stacklevel=5)


def _release_sessions() -> "str | None":
    """"none" when the installed vLLM's Worker has no draft sessions (0.25.1), else None (unknown)."""
    import sys

    worker = getattr(sys.modules.get("vllm.v1.worker.gpu_worker"), "Worker", None)
    return "none" if worker is not None and not hasattr(worker, "start_draft_weight_update") else None


def stale_message(record: Freshness, where: str) -> str:
    refits = "refit" if record.behind == 1 else "refits"
    sessions = record.sessions or _release_sessions()
    text = (f"vLLM MTP drafter {record.drafter} is {record.behind} target {refits} behind {record.target} (seen at "
            f"{where}; last target refit {record.last}; the drafter was last refreshed at target refit "
            f"#{record.refreshed_at}): speculative decoding drafts with the old MTP head and acceptance falls "
            "(vLLM PR #46725; verl #6947). ")
    if sessions == "none":
        return text + ("This vLLM has no draft sessions: after each target refit load the MTP head with the "
                       "drafter's own load_weights (the runner's drafter.model), inside "
                       "mtp_overlay.fixes.vllm_mtp_drafter_load.drafter_refit(drafter).")
    if sessions == "engine cannot":
        return text + (f"The weight-transfer engine {record.engine} cannot update the drafter "
                       "(supports_draft_weight_update = False): load the MTP head with the drafter's own "
                       "load_weights (Worker.get_draft_model()) after each refit, or use an engine that can.")
    return text + ("After each target refit call Worker.start_draft_weight_update(), send the MTP head with "
                   "update_weights(...), then finish_weight_update().")


def _engine(record: Freshness, worker: "Any") -> None:
    """Record what ``worker``'s engine can do for the drafter; name an engine that cannot, once."""
    engine = vars(worker).get("weight_transfer_engine")
    record.engine = type(engine).__name__ if engine is not None else None
    if not hasattr(type(worker), "start_draft_weight_update"):
        record.sessions = "none"
        return
    if engine is None:
        return
    can = getattr(engine, "supports_draft_weight_update", True)
    record.sessions = "draft" if can else "engine cannot"
    if not can and record.engine not in record.told:
        record.told.add(record.engine)
        notice(f"the weight-transfer engine {record.engine} cannot update vLLM's MTP drafter {record.drafter} "
               "(supports_draft_weight_update = False: Worker.start_draft_weight_update refuses it), so every "
               "target refit through it leaves the drafter one refit further behind; refresh the drafter with "
               "its own load_weights after each refit, or use an engine that can", stacklevel=5)


# --- the wrappers ----------------------------------------------------------------------------------
def _worker_record(worker: "Any") -> "Freshness | None":
    runner = vars(worker).get("model_runner")
    return None if runner is None else of_runner(runner)


def on_target_session_start(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                            kwargs: "dict[str, Any]") -> "Any":
    """``Worker.start_weight_update``: a stale drafter is reported before the next target refit begins."""
    record = _worker_record(instance)
    if record is not None:
        _engine(record, instance)
        if record.due:
            check(record, "Worker.start_weight_update")
    return wrapped(*args, **kwargs)


def on_session_finish(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                      kwargs: "dict[str, Any]") -> "Any":
    """``Worker.finish_weight_update``: the end of a non-draft session is a target refit."""
    own = vars(instance)
    if own.get("_weight_update_is_draft") is True or own.get("_weight_update_active") is not True:
        return wrapped(*args, **kwargs)  # the drafter's session (its refit end counts), or vLLM's own error
    record = _worker_record(instance)
    if record is None:
        return wrapped(*args, **kwargs)
    _engine(record, instance)
    return _boundary(record, f"Worker.finish_weight_update ({record.engine})", wrapped, args, kwargs)


def on_update_weights(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                      kwargs: "dict[str, Any]") -> "Any":
    """``Worker.update_weights``: a target session that raises here (one wrong-shaped tensor) ends
    there, vLLM's layerwise reload of the target begun and never finished: a target refit, since the
    target's weights were being replaced."""
    try:
        return wrapped(*args, **kwargs)
    except BaseException:
        record = _worker_record(instance)
        if record is not None and record.reloading and record.depth == 0:
            target_refitted(record, f"Worker.update_weights ({record.engine}), which raised after vLLM began "
                                    "replacing the target's weights")
        raise


def on_reload_weights(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                      kwargs: "dict[str, Any]") -> "Any":
    """A model runner's ``reload_weights``: a target refit."""
    record = of_runner(instance)
    if record is None:
        return wrapped(*args, **kwargs)
    return _boundary(record, f"{type(instance).__name__}.reload_weights", wrapped, args, kwargs)


def on_execute_model(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                     kwargs: "dict[str, Any]") -> "Any":
    """A model runner's ``execute_model``: the first step after a target refit that left the drafter
    stale reports it. The per-step cost is the one test of `_due`."""
    if _due:
        record = of_runner(instance)
        if record is not None and record.due:
            check(record, f"{type(instance).__name__}.execute_model")
    return wrapped(*args, **kwargs)


# --- asking ----------------------------------------------------------------------------------------
def record_of(subject: "Any") -> "Freshness | None":
    """The Freshness of a vLLM Worker, model runner, target model or drafter (None if unknown)."""
    with lock:
        try:
            record: "Freshness | None" = table("drafters").get(subject) or table("targets").get(subject)
        except TypeError:  # not weakly referenceable: no model
            record = None
    if record is not None:
        return record
    runner = getattr(subject, "model_runner", None)  # a Worker, or vLLM's wrapper forwarding to it
    if runner is not None:
        return of_runner(runner)
    return of_runner(subject) if callable(getattr(subject, "get_model", None)) else None


def refits_behind(subject: "Any") -> "int | None":
    """How many target refits the drafter of ``subject`` (a vLLM Worker, model runner, target model or
    drafter) is behind: 0 when fresh, None when the fix knows no drafter and target pair for it (on a
    vLLM patched on disk, its ``MTPDrafterRefits`` answers). Callable as
    ``llm.collective_rpc(refits_behind)`` (vLLM hands each worker in)."""
    record = record_of(subject)
    if record is None:  # a vLLM carrying the source patch counts by itself (the hooks stood down)
        import sys

        patched: "Any" = getattr(sys.modules.get("vllm.model_executor.models.utils"), "MTPDrafterRefits", None)
        return patched.refits_behind(subject) if hasattr(patched, "refits_behind") else None
    return None if record.target is None else record.behind


def staleness() -> "list[dict[str, object]]":
    """One dict per drafter of this process whose target the fix knows (`Freshness.as_dict`)."""
    with lock:
        return [record.as_dict() for record in list(table("drafters").values()) if record.target is not None]
