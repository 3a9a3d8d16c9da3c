"""A tiny stock-megatron-core GPTModel with MTP, its batches, and one measured training step.

Call these inside ``run_ranks`` workers (model parallelism initialised; on CPU the shims installed).
Weights are built on the CPU from one seed (``use_cpu_initialization``), so TP1, TP2 and CP2 runs
hold identical full weights and their losses can be compared; under pipeline parallelism each rank
builds its stage holding the PP1 model's weights (`pipeline.build_stage`).
"""

import dataclasses
import math

from ..runtime.device import rank_device
from . import pipeline

GROUPS = ("embedding", "decoder", "mtp", "output_layer")


def build_tiny_gpt(
    *,
    seed=1234,
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    max_sequence_length=64,
    mtp_num_layers=1,
    sequence_parallel=False,
    scatter_embedding_sequence_parallel=True,
    **config_overrides,
):
    """A GPTModel (local spec, RoPE, no dropout) with ``mtp_num_layers`` MTP layers.

    TP, CP and PP sizes come from ``parallel_state`` (under PP: this rank's stage, ``num_layers``
    split evenly, MTP on the last stage). ``config_overrides`` go to TransformerConfig
    (e.g. ``mtp_detach_heads=True``, ``calculate_per_token_loss=True``; ``num_moe_experts`` also
    makes every MLP, the MTP layer's included, a local-spec MoE); ``scatter_embedding_sequence_parallel``
    goes to GPTModel.
    """
    arguments = dict(
        seed=seed, num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        vocab_size=vocab_size, max_sequence_length=max_sequence_length, mtp_num_layers=mtp_num_layers,
        sequence_parallel=sequence_parallel, scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
        **config_overrides,
    )
    if pipeline.size() == 1:
        return _gpt(**arguments)
    return pipeline.build_stage(_gpt, arguments, arguments)


def _gpt(*, seed, num_layers, hidden_size, num_attention_heads, vocab_size, max_sequence_length, mtp_num_layers,
         sequence_parallel, scatter_embedding_sequence_parallel, **config_overrides):
    """The GPTModel of this rank's pipeline stage (all of it without PP), built from ``seed``."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        mtp_num_layers=mtp_num_layers or None,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if pipeline.size() > 1:
        settings.update(pipeline_model_parallel_size=pipeline.size(), pipeline_dtype=torch.float32)
    config = TransformerConfig(**{**settings, **config_overrides})
    layer_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    mtp_spec = None
    if mtp_num_layers:
        mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
        scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
        mtp_block_spec=mtp_spec,
        **pipeline.stage(),
    )
    return model.to(rank_device())


def make_batch(*, batch_size=2, seq_length=32, vocab_size=128, seed=0):
    """A full-length batch, identical on every rank: seeded random tokens, next-token labels.

    Keys: ``input_ids``, ``labels`` (input shifted left by one, from the same random text),
    ``position_ids`` and ``loss_mask`` (all ones, float), all [batch_size, seq_length] on the CPU.
    """
    import torch

    for name, value in (("batch_size", batch_size), ("seq_length", seq_length), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab_size, (batch_size, seq_length + 1), generator=generator)
    return {
        "input_ids": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_length).repeat(batch_size, 1),
        "loss_mask": torch.ones(batch_size, seq_length),
    }


def cp_slice(batch):
    """This CP rank's share of ``batch`` (a dict of [b, s, ...] tensors, or one such tensor).

    Upstream's own load-balanced layout (``megatron.core.utils.get_batch_on_this_cp_rank``): the
    sequence is cut into 2*cp chunks, rank r keeps chunks r and 2*cp-1-r. None values pass through.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if isinstance(batch, torch.Tensor):
        return cp_slice({"tensor": batch})["tensor"]
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict of tensors or a tensor, got {type(batch).__name__}")
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return dict(batch)
    for key, value in batch.items():
        if value is not None and (value.dim() < 2 or value.size(1) % (2 * cp)):
            raise ValueError(
                f"batch[{key!r}] must be [batch, seq, ...] with seq divisible by 2*cp={2 * cp}, "
                f"got shape {tuple(value.shape)}"
            )
    return get_batch_on_this_cp_rank(
        dict(batch), is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group()
    )


@dataclasses.dataclass(frozen=True)
class StepResult:
    """Plain numbers from one ``train_step``, identical on every rank.

    lm_loss: mean LM loss over the batch's ``loss_mask`` tokens of the whole (CP-gathered) sequence.
    mtp_losses, mtp_tokens, mtp_acceptance: per MTP depth, what Megatron logs from its
      MTPLossLoggingHelper tracker (`logged_mtp_metrics`): the loss (under CP, stock megatron-core
      logs the mean of the CP ranks' own means, Megatron-LM PR #7498; mtp-cp-loss-scale makes it the
      whole sequence's mean), the valid positions, the acceptance rate in percent (empty when the
      tracker recorded nothing).
    grad_norm, group_grad_norms: L2 norm of the finalized gradients (TP shards gathered), for the
      whole model and per top-level module (embedding, decoder, mtp, output_layer).
    zero_grad_params: names of parameters whose gradient is missing or all zero on every TP rank.
    """

    lm_loss: float
    mtp_losses: tuple
    mtp_tokens: tuple
    mtp_acceptance: tuple
    grad_norm: float
    group_grad_norms: dict
    zero_grad_params: tuple

    @property
    def mtp_loss(self):
        """The first MTP depth's loss."""
        return self.mtp_losses[0]


def train_step(model, batch, **forward_kwargs):
    """One forward+backward of ``model`` on ``batch``, the way Megatron's schedule drives it.

    ``batch``: the full-length batch (``make_batch``), sliced here for CP. The forward gets
    input_ids, position_ids, labels, loss_mask (this rank's slices), attention_mask=None, then
    ``forward_kwargs`` verbatim (not CP-sliced: use ``cp_slice``); e.g. ``labels=None`` (the model
    returns logits and the LM loss is computed here from them against ``batch["labels"]``, as an RL
    trainer does) or another ``loss_mask`` (what MTP trains on). The LM loss always uses
    ``batch["loss_mask"]``.

    Gradients follow Megatron: the MTP loss scale is ``config.mtp_grad_scale_func()`` or 1; each
    rank back-propagates its local mean LM loss (local sum with ``calculate_per_token_loss``);
    gradients are summed over data+context parallel ranks, then divided by their number (by the
    global LM token count with ``calculate_per_token_loss``); sequence-parallel parameters' grads are
    summed over TP. Returns a StepResult.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    config = model.config
    device = next(model.parameters()).device
    local = {key: value.to(device) for key, value in cp_slice(batch).items()}
    inputs = dict(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        attention_mask=None,
        labels=local["labels"],
        loss_mask=local["loss_mask"],
    )
    # tensors given verbatim go to the model's device too (a CPU mask for a CUDA model)
    inputs.update({key: value.to(device) if isinstance(value, torch.Tensor) else value
                   for key, value in forward_kwargs.items()})
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)

    model.zero_grad(set_to_none=True)
    MTPLossLoggingHelper.tracker.clear()  # fresh, sized by this model's MTP depth on first use
    output = model(**inputs)
    if inputs["labels"] is None:  # logits [b, s, v/tp]: the trainer's own loss
        output = model.compute_language_model_loss(local["labels"], output.transpose(0, 1).contiguous())
    mask = local["loss_mask"].float()
    local_sum, local_count = (output.float() * mask).sum(), mask.sum()
    lm_totals = torch.stack([local_sum.detach(), local_count])
    dist.all_reduce(lm_totals, group=dp_cp)

    scale_func = getattr(config, "mtp_grad_scale_func", None)
    previous_scale = MTPLossAutoScaler.main_loss_backward_scale
    mtp_scale = torch.as_tensor(scale_func() if scale_func else 1.0, device=device).float()
    MTPLossAutoScaler.set_loss_scale(mtp_scale)
    try:
        objective = local_sum if config.calculate_per_token_loss else local_sum / local_count.clamp(min=1)
        objective.backward()
    finally:
        MTPLossAutoScaler.set_loss_scale(previous_scale)
    divisor = lm_totals[1].clamp(min=1) if config.calculate_per_token_loss else dist.get_world_size(dp_cp)
    finalize_grads(model, dp_cp, divisor)

    mtp = logged_mtp_metrics(1, dp_cp)
    grad_facts = _grad_facts(model)
    return StepResult(lm_loss=(lm_totals[0] / lm_totals[1].clamp(min=1)).item(), **mtp, **grad_facts)


def finalize_grads(model, dp_cp, divisor):
    """Megatron's grad finalisation for one model chunk: DP/CP reduction, SP norms over TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, group=dp_cp)
        param.grad /= divisor
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=tp_group)


def logged_mtp_metrics(num_microbatches, dp_cp_group):
    """What Megatron logs per MTP depth, and the valid positions behind it; cleans the tracker.

    mtp_losses and mtp_acceptance come from `mtp_overlay.mtp.mtp_metrics` (MTPLossLoggingHelper's own
    reduction: the loss averaged over the DP x CP ranks and microbatches, acceptance from the summed
    counts); mtp_tokens are the tracker's valid positions summed over DP x CP.
    """
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from ...mtp import mtp_metrics

    tracker = MTPLossLoggingHelper.tracker
    if "total_values" not in tracker:
        return dict(mtp_losses=(), mtp_tokens=(), mtp_acceptance=())
    tokens = tracker["total_values"].clone()
    torch.distributed.all_reduce(tokens, group=dp_cp_group)
    metrics = mtp_metrics(num_microbatches)
    depths = range(1, len(tokens) + 1)
    return dict(
        mtp_losses=tuple(metrics.get(f"mtp_{i}_loss", 0.0) for i in depths),
        mtp_tokens=tuple(tokens.tolist()),
        mtp_acceptance=tuple(metrics.get(f"mtp_{i}_acceptance_rate", 0.0) for i in depths),
    )


def _grad_facts(model):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    names = [name for name, _ in model.named_parameters()]
    # per parameter: squared norm if TP-sharded (summed over TP), else squared norm counted once;
    # and whether any TP rank holds a non-zero gradient
    sharded = torch.zeros(len(names), dtype=torch.float64)
    replicated = torch.zeros(len(names), dtype=torch.float64)
    nonzero = torch.zeros(len(names))
    for index, (name, param) in enumerate(model.named_parameters()):
        if param.grad is None:
            continue
        square = param.grad.detach().double().pow(2).sum().cpu()
        if getattr(param, "tensor_model_parallel", False):
            sharded[index] = square
        else:
            replicated[index] = square
        nonzero[index] = float(bool(param.grad.ne(0).any()))
    device = next(model.parameters()).device
    sharded, nonzero = sharded.to(device), nonzero.to(device)
    dist.all_reduce(sharded, group=tp_group)
    dist.all_reduce(nonzero, group=tp_group, op=dist.ReduceOp.MAX)
    squares = (sharded.cpu() + replicated).tolist()
    groups = {group: 0.0 for group in GROUPS}
    for name, square in zip(names, squares):
        top = name.split(".")[0]
        groups[top] = groups.get(top, 0.0) + square
    return dict(
        grad_norm=math.sqrt(sum(squares)),
        group_grad_norms={group: math.sqrt(square) for group, square in groups.items()},
        zero_grad_params=tuple(name for name, flag in zip(names, nonzero.tolist()) if not flag),
    )
