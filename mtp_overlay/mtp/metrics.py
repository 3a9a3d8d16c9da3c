"""MTP metrics: per-layer loss and acceptance on the train side, per-position acceptance at rollout.

Train side: megatron-core 0.19+ accumulates ``loss_values``, ``correct_values`` and ``total_values``
([mtp_num_layers] tensors) in ``MTPLossLoggingHelper``'s tracker over the microbatches of a step.
Releases before 0.19 keep only ``values`` (no acceptance counts) and train no MTP loss without
labels: not read here. Rollout side: vLLM's scheduler counts drafts and accepted draft tokens per
position (``SpecDecodingStats``); nothing collected them for RL, so a drafter left stale by a refit
showed up only as "acceptance is low". Names follow NeMo-RL's ``mtp/`` convention (`with_prefix`).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only
    from collections.abc import Mapping, Sequence
    from typing import Protocol, TypeAlias, TypeVar

    Value = TypeVar("Value")

    class SpecDecodingCounts(Protocol):
        """What is read of a vLLM ``SpecDecodingStats`` (``vllm.v1.spec_decode.metrics``)."""

        @property
        def num_drafts(self) -> int: ...
        @property
        def num_accepted_tokens(self) -> int: ...
        @property
        def num_accepted_tokens_per_pos(self) -> Sequence[int]: ...

    # one entry per rollout worker: its stats, or a list of its scheduler steps' stats
    WorkerStats: TypeAlias = "Sequence[SpecDecodingCounts | Sequence[SpecDecodingCounts]]"

METRICS_PREFIX = "mtp/"


def mtp_metrics(num_microbatches: int) -> dict[str, float]:
    """``{"mtp_{i}_loss": ..., "mtp_{i}_acceptance_rate": ...}`` for layers i = 1..N, then clean.

    loss = loss_values[i-1] / num_microbatches; acceptance_rate = 100 * correct / max(total, 1).
    Reduces the tracker first (a collective over the groups megatron-core recorded: call it on
    every rank of the last pipeline stage, like Megatron's own ``track_mtp_metrics``) and cleans it
    after. An empty tracker (nothing recorded since the last clean) gives ``{}``.
    """
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return {}
    MTPLossLoggingHelper.reduce_metrics_in_tracker()
    losses = (tracker["loss_values"].double() / num_microbatches).tolist()
    correct = tracker["correct_values"].double().tolist()
    total = tracker["total_values"].double().tolist()
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    if not any(losses) and not any(total):
        return {}
    metrics: dict[str, float] = {}
    for i, (loss, right, count) in enumerate(zip(losses, correct, total), start=1):
        metrics[f"mtp_{i}_loss"] = loss
        metrics[f"mtp_{i}_acceptance_rate"] = 100.0 * right / max(count, 1.0)
    return metrics


def with_prefix(metrics: Mapping[str, Value], prefix: str = METRICS_PREFIX) -> dict[str, Value]:
    """``metrics`` with every name under ``prefix`` (NeMo-RL logs MTP metrics under ``mtp/``)."""
    return {prefix + name: value for name, value in metrics.items()}


_STATS_FIELDS = ("num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def rollout_mtp_metrics(worker_stats: WorkerStats, *,
                        drafter_refits_behind: int | Sequence[int | None] | None = None) -> dict[str, float]:
    """``{"rollout_acceptance_pos_{k}": ..., "rollout_mean_acceptance_length": ...}`` over rollout workers.

    ``worker_stats``: one entry per rollout worker, each a vLLM ``SpecDecodingStats``
    (``vllm.v1.spec_decode.metrics``; any object with ``num_drafts``, ``num_accepted_tokens`` and
    ``num_accepted_tokens_per_pos``) or a list of them (the worker's scheduler steps). Counts are
    summed over every worker and step, then, as vLLM's own spec-decode log does:
    acceptance at position k (from 1) = 100 * accepted_per_pos[k-1] / drafts (percent, like the
    train side's ``mtp_{k}_acceptance_rate``; position k counts only drafts accepted up to k), mean
    acceptance length = 1 + accepted / drafts (the bonus token included). No drafts at all gives no
    acceptance keys. A count is any integer scalar: an int, a numpy integer, a 0-dim integer tensor or
    array (what a gather of the stats through numpy or torch hands back; a tensor on a device is read
    with one host transfer), ``num_accepted_tokens_per_pos`` any sequence of them (a 1-D array or
    tensor too). ValueError, naming the worker and step, for an empty list, positions that differ
    between entries, a missing (None) or non-sequence per-position field, negative, boolean or
    non-integer counts, or counts that contradict each other.

    ``drafter_refits_behind``: how many target refits each worker's drafter is behind, from
    vllm-mtp-drafter-load (``llm.collective_rpc(refits_behind)``, `refits_behind` of
    ``mtp_overlay.fixes.vllm_mtp_drafter_load``; None for a worker whose drafter it does not know), or
    one int. Adds ``"rollout_drafter_refits_behind"``: the largest (0: every drafter got the last
    refit), logged next to acceptance so a falling rate has its cause beside it; also without drafts.
    """
    stale = _refits_behind(drafter_refits_behind)
    if isinstance(worker_stats, (str, bytes)) or not isinstance(worker_stats, (list, tuple)) or not worker_stats:
        raise ValueError(f"worker_stats must be a non-empty list (one entry per rollout worker), got {worker_stats!r:.200}")
    positions, drafts, accepted = None, 0, 0
    per_pos: list[int] = []  # summed per position, from the first entry on
    for worker, entry in enumerate(worker_stats):
        steps = entry if isinstance(entry, (list, tuple)) else [entry]
        if not steps:
            raise ValueError(f"worker_stats[{worker}] is an empty list: expected SpecDecodingStats (or a list of them)")
        for step, stats in enumerate(steps):
            where = f"worker_stats[{worker}]" + (f"[{step}]" if steps is entry else "")
            counts = _spec_decode_counts(stats, where)
            if positions is None:
                positions, per_pos = len(counts[2]), [0] * len(counts[2])
            elif len(counts[2]) != positions:
                raise ValueError(f"{where}.num_accepted_tokens_per_pos has {len(counts[2])} positions, the first "
                                 f"entry {positions}: every worker must run the same num_speculative_tokens")
            drafts += counts[0]
            accepted += counts[1]
            per_pos = [a + b for a, b in zip(per_pos, counts[2])]
    metrics: dict[str, float] = {}
    if drafts:
        metrics.update({f"rollout_acceptance_pos_{k}": 100.0 * count / drafts for k, count in enumerate(per_pos, start=1)})
        metrics["rollout_mean_acceptance_length"] = 1.0 + accepted / drafts
    if stale is not None:
        metrics["rollout_drafter_refits_behind"] = float(stale)
    return metrics


def _refits_behind(value: int | Sequence[int | None] | None) -> int | None:
    """The largest count of ``drafter_refits_behind`` (None: none given, or no worker's drafter known)."""
    if value is None:
        return None
    entries = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple)):
        raise ValueError(f"drafter_refits_behind must be an int or a list of them (one per worker), got {value!r:.200}")
    known: list[int] = []
    for index, entry in enumerate(entries):
        if entry is None:
            continue
        if isinstance(entry, bool) or not isinstance(entry, int) or entry < 0:
            raise ValueError(f"drafter_refits_behind[{index}] must be a non-negative int or None, got {entry!r}")
        known.append(entry)
    return max(known) if known else None


def _spec_decode_counts(stats: object, where: str) -> tuple[int, int, list[int]]:
    missing = [name for name in _STATS_FIELDS if not hasattr(stats, name)]
    if missing:
        raise ValueError(f"{where} must be a vLLM SpecDecodingStats (with {', '.join(_STATS_FIELDS)}), "
                         f"got {type(stats).__name__} without {', '.join(missing)}")
    drafts = _count(getattr(stats, "num_drafts"), f"{where}.num_drafts")
    accepted = _count(getattr(stats, "num_accepted_tokens"), f"{where}.num_accepted_tokens")
    name, given = f"{where}.num_accepted_tokens_per_pos", getattr(stats, "num_accepted_tokens_per_pos")
    try:
        if isinstance(given, (str, bytes)) or getattr(given, "ndim", 1) != 1:
            raise TypeError
        values = list(given)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of non-negative ints, one per speculative position, "
                         f"got {given!r:.200}") from None
    per_pos = [_count(value, f"{name}[{i}]") for i, value in enumerate(values)]
    if not per_pos:
        raise ValueError(f"{where}.num_accepted_tokens_per_pos is empty: expected one count per speculative position")
    if any(later > earlier for earlier, later in zip([drafts, *per_pos], per_pos)):
        raise ValueError(f"{where}: accepted counts per position {per_pos} must not increase and not exceed "
                         f"num_drafts={drafts} (position k is accepted only after position k-1)")
    if sum(per_pos) != accepted:
        raise ValueError(f"{where}.num_accepted_tokens={accepted} is not the sum of num_accepted_tokens_per_pos {per_pos}")
    return drafts, accepted, per_pos


def _count(value: object, name: str) -> int:
    """``value`` as an int when it is an integer count (int, numpy integer, 0-dim integer tensor or
    array); ValueError naming ``name`` otherwise. Booleans are refused: ``True`` is no count."""
    import operator

    boolean = isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")
    if not boolean and getattr(value, "ndim", 0) == 0:
        try:
            count = operator.index(value)  # type: ignore[arg-type]  # the TypeError is the answer
        except TypeError:
            pass
        else:
            if count >= 0:
                return count
    raise ValueError(f"{name} must be a non-negative int (or integer scalar), got {value!r:.200}")


def acceptance_gap(train_metrics: dict[str, float], rollout_metrics: dict[str, float]) -> dict[str, float]:
    """``{"acceptance_gap_1": train depth-1 acceptance - rollout position-1 acceptance}`` (percentage points).

    From `mtp_metrics` and `rollout_mtp_metrics` (names with or without the ``mtp/`` prefix). Under
    greedy verification both measure how often the depth-1 draft is the target's token; a drafter
    left stale by a refit keeps the old head, so the gap grows while the trainer's rate climbs
    (sampling-based verification adds an offset: watch the trend). {} when either side is empty.
    """
    train, rollout = _unprefixed(train_metrics, "train_metrics"), _unprefixed(rollout_metrics, "rollout_metrics")
    if not train or not rollout:
        return {}
    for metrics, key, argument in ((train, "mtp_1_acceptance_rate", "train_metrics"),
                                   (rollout, "rollout_acceptance_pos_1", "rollout_metrics")):
        if key not in metrics:
            raise ValueError(f"{argument} has no {key!r} (got {sorted(metrics)}): pass the output of "
                             f"{'mtp_metrics' if argument == 'train_metrics' else 'rollout_mtp_metrics'}")
    return {"acceptance_gap_1": train["mtp_1_acceptance_rate"] - rollout["rollout_acceptance_pos_1"]}


def _unprefixed(metrics: dict[str, float], argument: str) -> dict[str, float]:
    if not isinstance(metrics, dict):
        raise ValueError(f"{argument} must be a dict of metric name -> value, got {type(metrics).__name__}")
    return {name.removeprefix(METRICS_PREFIX): value for name, value in metrics.items()}
