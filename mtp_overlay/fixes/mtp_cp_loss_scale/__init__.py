"""mtp-cp-loss-scale: the MTP loss is normalised by the whole sequence's token counts under CP.

megatron-core 0.19.x ``process_mtp_loss`` divides each context-parallel rank's MTP loss by that
rank's own rolled token count (``roll_tensor`` returns the local sum) and, with
``calculate_per_token_loss``, rescales it by the rank's own original token count. DDP then averages
(or sums) the gradients over DP x CP, so at CP > 1 a token's MTP weight depends on how many MTP
tokens its CP rank holds: the MTP gradient is a mean of per-rank means, and a rank without original
(LM) tokens drops its MTP gradient altogether. The logged ``mtp_{i}_loss`` is the mean of per-rank
means too. Upstream: Megatron-LM PR #7498 (open), issue #7452 (the same across DP), PR #3959 (closed).

The hook reduces the counts over the CP group, one all-reduce of two scalars per MTP depth, as #7498
does, and leaves everything else to upstream's own code:

* ``roll_tensor``: the rolled loss mask's count, inside ``process_mtp_loss``, becomes the CP-global
  count N (reduced together with this rank's original count: O is their CP sum);
* ``process_mtp_loss`` runs with a config view whose MTP loss scale carries the correction: both
  modes take upstream's plain branch, ``scale * loss / N``, with scale x CP (DDP averages over CP)
  or, with ``calculate_per_token_loss``, scale x O (finalize_model_grads divides by the global LM
  count), which is upstream's per-token weight O/N with global counts;
* ``MTPLossLoggingHelper.save_metrics_to_tracker``: the logged loss, ``sum / N`` on each rank,
  is multiplied by CP, so the tracker's average over DP x CP gives the whole sequence's mean.

CP = 1, evaluation (no grad or not training) and a call without ``cp_group`` pass through untouched.
The main LM loss, the MoE aux loss and the schedule's scales are not touched. No host read: the
counts stay on the device. Before its first all-reduce on a CP group it checks that every rank of
the group runs it (`mtp_overlay.fixes.peers`): a rank without it would leave the all-reduce
unmatched (a gloo abort at depth 1, a hang at depth 2).
"""

import contextvars

from ...calls import argument, original, positions, with_argument
from ...contract import Marker, Verdict, drifted, needed, redundant
from .. import Fix, peers
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

# target roles: "mtp", the module defining process_mtp_loss; "gpt_model" and "hybrid_model", the
# model modules that bind it by name (`from ...multi_token_prediction import process_mtp_loss`)
DEFINES = "mtp"
PROCESS, ROLL, LOG = "process_mtp_loss", "roll_tensor", "save_metrics_to_tracker"
PARAMETERS = ("labels", "loss_mask", "is_training", "config", "cp_group", "input_ids")
ROLL_PARAMETERS = ("tensor", "shifts", "dims", "cp_group", "packed_seq_params")
# every global/attribute name process_mtp_loss uses in megatron-core 0.19.0-0.19.2 and Megatron-LM main
# (d98e8a64): any other name means its arithmetic changed, and the hook no longer knows what it adds to
KNOWN_NAMES = frozenset({
    "MTPLossAutoScaler", "MTPLossLoggingHelper", "_compute_mtp_acceptance_counts", "apply",
    "calculate_per_token_loss", "chunk", "clamp", "clone", "detach", "dtype", "get_data_parallel_group",
    "mtp_detach_heads", "mtp_loss_scaling_factor", "mtp_num_layers", "ones_like", "parallel_state", "range",
    "roll_tensor", "save_metrics_to_tracker", "sum", "to", "torch", "weight",
})
REQUIRED_NAMES = ("roll_tensor", "calculate_per_token_loss", "mtp_loss_scaling_factor", "save_metrics_to_tracker")

_counts: "contextvars.ContextVar[_Counts | None]" = contextvars.ContextVar("mtp_cp_loss_scale_counts", default=None)


def stock_process_mtp_loss(module: "ModuleType") -> "Callable[..., Any] | None":
    """The upstream ``process_mtp_loss`` bound in ``module``, seen through every wrapper, or None."""
    function = vars(module).get(PROCESS)
    return None if function is None else original(function)


def _names(code: "Any") -> "set[str]":
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def probe_target(module: "ModuleType", marker: Marker) -> Verdict:
    """The verdict for the module defining ``process_mtp_loss`` (read from its code, not run)."""
    import inspect

    process, roll = stock_process_mtp_loss(module), vars(module).get(ROLL)
    helper = getattr(module, "MTPLossLoggingHelper", None)
    if process is None or roll is None:
        return drifted(f"{module.__name__} has no {PROCESS if process is None else ROLL}")
    names = _names(process.__code__)
    if marker.in_function(process):
        return redundant(f"{marker} (Megatron-LM PR #7498 or patched on disk)")
    parameters = inspect.signature(process).parameters
    missing = [name for name in PARAMETERS if name not in parameters]
    if missing:
        return drifted(f"{PROCESS} has no parameter(s) {missing}: the hook fits megatron-core 0.19's signature")
    roll_parameters = tuple(inspect.signature(original(roll)).parameters)
    if roll_parameters[: len(ROLL_PARAMETERS)] != ROLL_PARAMETERS:
        return drifted(f"{ROLL}{roll_parameters} does not start with {ROLL_PARAMETERS}")
    if helper is None or LOG not in vars(helper):
        return drifted(f"MTPLossLoggingHelper has no {LOG}")
    absent = [name for name in REQUIRED_NAMES if name not in names]
    unknown = sorted(names - KNOWN_NAMES)
    if absent or unknown:
        changes = ([f"no {absent}"] if absent else []) + ([f"new names {unknown}"] if unknown else [])
        return drifted(
            f"{PROCESS} changed shape ({'; '.join(changes)}): it may normalise the MTP loss differently; "
            "check it against Megatron-LM PR #7498 and update the hook"
        )
    return needed(f"{PROCESS} divides each CP rank's MTP loss by its own token counts")


def probe_alias(module: "ModuleType", target: "ModuleType", marker: Marker) -> Verdict:
    """The verdict for a model module that binds ``process_mtp_loss`` by name: the target's."""
    function = stock_process_mtp_loss(module)
    if function is None:
        return drifted(f"{module.__name__} does not import {PROCESS}")
    if function is not stock_process_mtp_loss(target):
        return drifted(f"{module.__name__}.{PROCESS} is not {target.__name__}.{PROCESS}")
    return probe_target(target, marker)


class _Counts:
    """This ``process_mtp_loss`` call's loss-mask lineage and its CP-reduced token counts."""

    __slots__ = ("group", "size", "mask", "derive", "original", "original_total", "per_token")

    def __init__(self, group: "Any", mask: "Any", derive: bool, per_token: bool) -> None:
        self.group, self.size, self.mask = group, group.size(), mask
        self.derive = derive  # labels=None: the first roll of the mask makes the original count
        self.original: "Any" = None if derive else mask.sum()
        self.original_total: "Any" = None
        self.per_token = per_token


_view_class = None


def _config_view(config: "Any", counts: _Counts) -> "Any":
    """``config`` with upstream's plain normalisation branch and the CP correction in the MTP scale."""
    global _view_class
    if _view_class is None:
        import wrapt

        class CountedConfig(wrapt.ObjectProxy):
            def __init__(self, config: "Any", counts: "Any") -> None:
                super().__init__(config)
                self._self_counts = counts

            @property
            def calculate_per_token_loss(self) -> bool:
                return False

            @property
            def mtp_loss_scaling_factor(self) -> "Any":
                counts = self._self_counts
                factor = self.__wrapped__.mtp_loss_scaling_factor
                return factor * (counts.original_total if counts.per_token else counts.size)

        _view_class = CountedConfig
    return _view_class(config, counts)


class CPLossScaleFix(Fix):
    declaration = DECLARATION

    def probe(self, module: "ModuleType") -> Verdict:
        import importlib

        if self.role_of(module) == DEFINES:
            return probe_target(module, self.marker)
        return probe_alias(module, importlib.import_module(self.target(DEFINES)), self.marker)

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        import torch

        peers.forget()  # installed (again): its groups agree afresh
        stock = stock_process_mtp_loss(module)
        assert stock is not None, "probed first"
        at = positions(stock)

        def process_mtp_loss(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                             kwargs: "dict[str, Any]") -> "Any":
            def read(name: str, default: "Any" = None) -> "Any":
                return argument(args, kwargs, at.get(name), name, default)

            group, labels = read("cp_group"), read("labels")
            source = labels if labels is not None else read("input_ids")
            if (_counts.get() is not None or group is None or group.size() == 1 or source is None
                    or not read("is_training", False) or not torch.is_grad_enabled()):
                return wrapped(*args, **kwargs)
            peers.agree(FIX, group)
            mask = read("loss_mask")
            if mask is None:  # upstream's own default: ones shaped like the (derived) labels
                mask = torch.ones_like(source)
            config = read("config")
            counts = _Counts(group, mask, labels is None, bool(config.calculate_per_token_loss))
            args, kwargs = with_argument(args, kwargs, at.get("loss_mask"), "loss_mask", mask)
            args, kwargs = with_argument(args, kwargs, at.get("config"), "config", _config_view(config, counts))
            token = _counts.set(counts)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _counts.reset(token)

        yield module, PROCESS, process_mtp_loss
        if self.role_of(module) != DEFINES:
            return

        def roll_tensor(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                        kwargs: "dict[str, Any]") -> "Any":
            counts = _counts.get()
            tensor = argument(args, kwargs, 0, "tensor", None)
            if counts is None or tensor is not counts.mask:
                return wrapped(*args, **kwargs)
            rolled, count = wrapped(*args, **kwargs)
            counts.mask = rolled
            if count is None:
                return rolled, count
            if counts.derive:  # labels=None: upstream counts this roll's result as the original tokens
                counts.derive, counts.original = False, count
                return rolled, count
            totals = torch.stack([counts.original.to(count.dtype), count])
            torch.distributed.all_reduce(totals, group=counts.group)
            counts.original_total, total = totals.unbind()
            return rolled, total

        def save_metrics_to_tracker(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                    kwargs: "dict[str, Any]") -> "Any":
            counts = _counts.get()
            if counts is None:
                return wrapped(*args, **kwargs)
            args, kwargs = with_argument(args, kwargs, 0, "loss", argument(args, kwargs, 0, "loss") * counts.size)
            return wrapped(*args, **kwargs)

        yield module, ROLL, roll_tensor
        yield module.MTPLossLoggingHelper, LOG, save_metrics_to_tracker


FIX = CPLossScaleFix()
