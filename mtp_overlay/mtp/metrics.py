"""Per-layer MTP loss and acceptance rate from megatron-core's ``MTPLossLoggingHelper`` tracker.

megatron-core 0.19+ accumulates ``loss_values``, ``correct_values`` and ``total_values``
([mtp_num_layers] tensors) over the microbatches of a step. Releases before 0.19 keep only
``values`` (no acceptance counts) and train no MTP loss without labels: not read here.
"""

METRICS_PREFIX = "mtp/"


def mtp_metrics(num_microbatches):
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
    metrics = {}
    for i, (loss, right, count) in enumerate(zip(losses, correct, total), start=1):
        metrics[f"mtp_{i}_loss"] = loss
        metrics[f"mtp_{i}_acceptance_rate"] = 100.0 * right / max(count, 1.0)
    return metrics


def with_prefix(metrics, prefix=METRICS_PREFIX):
    """``metrics`` with every name under ``prefix`` (NeMo-RL logs MTP metrics under ``mtp/``)."""
    return {prefix + name: value for name, value in metrics.items()}
