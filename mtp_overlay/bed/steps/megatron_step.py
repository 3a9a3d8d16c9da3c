"""Megatron's own training step around a built model: DDP, the schedule, finalize_model_grads, an optimizer.

``tiny_gpt.train_step`` imitates Megatron's gradient arithmetic by hand; this step *is* Megatron's:

* the model is wrapped in megatron-core's ``DistributedDataParallel`` (grad buffers, bucketed
  data+context-parallel reduction with its own scaling factor);
* microbatches go through ``get_forward_backward_func()`` (loss-function shapes, the MTP/MoE loss
  scales, microbatch averaging, the per-token token counter are the schedule's own);
* ``finalize_model_grads`` is ``config.finalize_model_grads_func`` (DP/CP sync, sequence-parallel
  norm grads over TP, per-token division);
* megatron-core's ``get_megatron_optimizer`` (Adam, FP32, no gradient clipping: Megatron's clipping
  asserts CUDA tensor types) steps the weights.

Loss functions are shaped like Megatron-LM's ``pretrain_gpt.loss_func``:

* ``"3-output"``: ``(loss sum, token count, {"lm loss": [sum, count]})``; the schedule divides by the
  rank's own count (``calculate_per_token_loss=False``) or finalize_model_grads by the global count.
* ``"2-output"``: the legacy shape, ``(CP-global mean, {"lm loss": [sum, count]})``: the value is the
  mean over the whole sequence, its gradient flows through this rank's tokens only; the schedule
  multiplies it by the CP size and DDP averages over DP x CP (``calculate_per_token_loss=False``).
* ``"nemo-rl"``: NeMo-RL's per-token flow (``calculate_per_token_loss=True``): each rank's loss sum
  over the step's global valid-token count, multiplied by num_microbatches / CP size to undo the
  schedule's 2-output scaling; DDP sums, finalize_model_grads divides by 1 (a 2-output loss counts
  no tokens).

Microbatches are BSHD ([mbs, seq], CP-sliced with upstream's ``get_batch_on_this_cp_rank``) or packed
THD rows as NeMo-RL sends them (one [1, T] row with its ``packed_seq_params``, each padded sequence
CP-sharded in the 2*CP-chunk layout by ``mtp_overlay.mtp.cp_shard``). A model that slices CP itself
(``model_slices_context_parallel_inputs``, the Nemotron Omni contract) gets the full rows.

A multimodal microbatch also holds ``images`` (LLaVAModel's ``[num_images, 3, h, w]``) and optionally
``num_image_tiles`` (LLaVAModel's ``[num_images]`` int tensor): the model (megatron-core's ``LLaVAModel``,
Megatron-Bridge's ``NemotronVLModel`` / ``NemotronOmniModel`` around one, or
``tiny_llava.CombinedIdsReference``) gets the full-length text rows with their image placeholders, the
images and their tile counts, builds the combined (text + image) sequence,
slices it for CP/SP itself and returns ``(output, combined loss mask)``
(``models/multimodal/llava_model.py:1278``): the loss function gets that mask.

Under pipeline parallelism (the model is this rank's stage, `pipeline`) the schedule is
``forward_backward_pipelining_without_interleaving``: activations travel between the stages over
point-to-point exchanges of [seq / CP (/ TP under SP), mbs, hidden] tensors in ``config.pipeline_dtype``
(shapes exchanged per microbatch with ``config.variable_seq_lengths``: packed rows of different
lengths). Every stage reads each microbatch from the data iterator, and its forward gets what it uses
(`pipeline.stage_keys`): token and position ids on the first stage and the MTP stage, labels and
masks on the last, ``packed_seq_params`` everywhere; the loss function and the RL LM loss run on the
last stage, the others hand their hidden states on. ``finalize_model_grads`` all-reduces the word
embedding copies' gradients between the first and the last stage. The result's losses come from the
last stage, its gradients from every stage (`pipeline.gather_stages`), under the PP1 model's names. A
forward that raises on one stage raises on every stage once the schedule is through
(`pipeline.ForwardFailures`).

Call inside ``run_ranks`` workers (model parallelism initialised; on CPU the shims installed). The
model is any built megatron-core language model with MTP (GPTModel, HybridModel, or a wrapper around
one in ``.language_model``, or Bridge's VL wrapper around such a wrapper in ``.llava_model``): the step
only calls its forward and ``compute_language_model_loss``.
"""

import contextlib
import dataclasses
import functools
import math
import re

LOSS_SHAPES = ("2-output", "3-output", "nemo-rl")
OPTIMIZERS = ("megatron", None)
MASK_ROUTES = ("explicit", "scoped")
GLOBAL_VALID_TOKENS = "global-valid-tokens"
MICROBATCH_KEYS = ("input_ids", "labels", "position_ids", "loss_mask")
PACKED = "packed_seq_params"
IMAGES = "images"
IMAGE_TILES = "num_image_tiles"


@dataclasses.dataclass(frozen=True)
class MegatronStepResult:
    """Plain numbers from one `MegatronStep.step`, identical on every rank.

    lm_loss: token-weighted LM loss over the step (all microbatches, DP x CP), from the loss
      function's "lm loss" reports.
    mtp_losses, mtp_acceptance: per MTP depth, what Megatron logs (`mtp_overlay.mtp.mtp_metrics`
      over MTPLossLoggingHelper's tracker): ``mtp/mtp_{i}_loss`` and the acceptance rate in percent.
    mtp_tokens: per depth, the tracker's valid MTP positions summed over DP x CP.
    grads: ``{"mtp": ..., "lm": ...}``: the finalized gradients (DDP's ``main_grad``, TP shards
      gathered to full tensors, every pipeline stage's under the PP1 model's names) of the MTP block
      and of the rest of the language model, flattened in parameter order into float32 numpy arrays
      (numpy, not torch: torch tensors cross process boundaries through shared memory that dies with
      the rank): comparable across TP/CP/PP layouts. A model with parameters outside its language
      model (LLaVAModel's vision tower and projector) also has ``"encoder"``: those.
    grad_names: the parameter names behind ``grads``, per part, in order.
    grad_norm, group_grad_norms: L2 norms of those gradients, whole model and per top-level module.
    zero_grad_params: parameters whose gradient is all zero.
    update_norm: L2 norm of the optimizer's weight update (None without an optimizer step).
    moe_metrics: per MoE metric (``"load_balancing_loss"``, ...), megatron-core's per-layer logged
      values of the step (`moe.logged_moe_metrics`); empty without MoE layers.
    router_grads: every MoE router weight's finalized gradient (`moe.router_gradients`), by name.
    """

    lm_loss: float
    mtp_losses: tuple
    mtp_tokens: tuple
    mtp_acceptance: tuple
    grads: dict
    grad_names: dict
    grad_norm: float
    group_grad_norms: dict
    zero_grad_params: tuple
    update_norm: float | None
    moe_metrics: dict = dataclasses.field(default_factory=dict)
    router_grads: dict = dataclasses.field(default_factory=dict)

    @property
    def mtp_loss(self):
        """The first MTP depth's logged loss."""
        return self.mtp_losses[0]

    def relative_error(self, reference, part):
        """``|g - g_ref| / |g_ref|`` of gradient ``part`` ("mtp" or "lm") against ``reference``."""
        return relative_error(self.grads[part], reference.grads[part])


def relative_error(gradient, reference):
    """``|gradient - reference| / |reference|`` of two flat arrays, in float64 (the absolute
    difference when the reference is zero)."""
    import numpy

    gradient, reference = numpy.asarray(gradient, dtype=numpy.float64), numpy.asarray(reference, dtype=numpy.float64)
    if gradient.shape != reference.shape:
        raise ValueError(f"gradients of different shapes: {gradient.shape} vs {reference.shape}")
    scale = float(numpy.linalg.norm(reference))
    difference = float(numpy.linalg.norm(gradient - reference))
    return difference / scale if scale else difference


class MegatronStep:
    """A built model wrapped for Megatron's training step; `step` runs one.

    ``model``: a megatron-core language model, or a multimodal model around one (LLaVAModel; see the
    module docstring) (its config's ``calculate_per_token_loss`` is fixed from here on: DDP derives
    its gradient scaling from it). ``optimizer``: "megatron" (megatron-core's
    Adam through ``get_megatron_optimizer``) or None (gradients only). ``ddp_config``: a
    ``DistributedDataParallelConfig`` (default: megatron-core's defaults). ``schedule_scope``: a
    callable returning a context manager that each step's forward+backward (the schedule call,
    nothing before or after it) runs in: ``lambda: counter`` counts its host reads
    (`mtp_overlay.bed.runtime.syncs.SyncCounter`).
    """

    def __init__(self, model, *, optimizer="megatron", lr=1e-3, ddp_config=None):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        from ..models.pipeline import language_model_of

        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        self.config = model.config
        self.model = DistributedDataParallel(self.config, ddp_config or DistributedDataParallelConfig(), model)
        self.language_model = language_model_of(self.model)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.schedule_scope = contextlib.nullcontext
        self.optimizer = None
        if optimizer == "megatron":
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            settings = OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0, bf16=False, fp16=False)
            self.optimizer = get_megatron_optimizer(settings, [self.model])

    def step(self, microbatches, *, loss="3-output", labels=True, mtp_grad_scale=None, update=True,
             mtp_mask="explicit", aux_loss_only=False):
        """One training step over ``microbatches``; returns a MegatronStepResult.

        microbatches: this data-parallel rank's microbatches, each a dict of full-length [mbs, seq]
          tensors (CP-sliced here): ``input_ids``, ``labels``, ``position_ids``, ``loss_mask``
          (label-aligned: the LM loss's mask; with labels also Megatron's MTP mask) and, for
          ``labels=False`` only, an optional ``mtp_loss_mask`` (input_ids-aligned, passed to the
          model as ``loss_mask``: the RL convention). A packed (THD) microbatch also holds
          ``packed_seq_params`` (megatron's PackedSeqParams, qkv_format "thd", full-row boundaries)
          and its tensors are one [1, T] row laid out on the padded boundaries. Microbatches may
          differ in shape without pipeline stages, or with ``config.variable_seq_lengths``. A
          multimodal microbatch also holds ``images`` (module docstring; labels=True, 2- or 3-output loss).
        loss: one of LOSS_SHAPES (module docstring).
        labels: True: the model computes the LM loss from ``labels`` (SFT / pretraining). False: the
          RL forward: the model gets no labels, returns logits, and the LM loss is computed here
          with the model's ``compute_language_model_loss``; Megatron derives the MTP labels.
        mtp_grad_scale: None, a positive number (a constant ``config.mtp_grad_scale_func``), or
          "global-valid-tokens" (NeMo-RL: ``1 / global valid LM tokens`` of the step, summed over
          microbatches and data-parallel ranks). Set for this step only, reset after.
        update: run the optimizer step (and zero the gradient buffers first in every case).
        mtp_mask: how ``mtp_loss_mask`` reaches the model: "explicit" (as its ``loss_mask``) or
          "scoped" (``mtp_overlay.mtp.loss_mask_scope`` around the forward, no ``loss_mask``: the
          route of fix mtp-loss-mask; stock megatron-core ignores the scope).
        aux_loss_only: only the MoE auxiliary losses train: the loss function's loss is multiplied by
          0 and the MTP loss scale is 0 (``config.mtp_grad_scale_func``), so the one gradient left
          is what ``MoEAuxLossAutoScaler`` injects, at the schedule's own MoE loss scale; the
          reported losses are the step's as usual. Needs a model with MoE layers.
        """
        import torch
        from megatron.core import parallel_state

        from ... import mtp
        from ..models import pipeline

        per_token = bool(self.config.calculate_per_token_loss)
        staged = pipeline.size() > 1
        check_step_arguments(microbatches, loss, labels, mtp_grad_scale, per_token, update, self.optimizer, mtp_mask,
                             variable_shapes=not staged or bool(self.config.variable_seq_lengths))
        experts = getattr(self.config, "num_moe_experts", None)
        if aux_loss_only and (not experts or mtp_grad_scale is not None):
            raise ValueError(
                "aux_loss_only=True needs a model with MoE layers (config.num_moe_experts) and mtp_grad_scale=None "
                f"(it sets the MTP loss scale to 0), got num_moe_experts={experts!r}, mtp_grad_scale={mtp_grad_scale!r}"
            )
        cp_group = parallel_state.get_context_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        device = next(self.model.parameters()).device

        valid_tokens = None  # NeMo-RL's normaliser: the step's LM tokens over all data-parallel ranks
        if loss == "nemo-rl" or mtp_grad_scale == GLOBAL_VALID_TOKENS:
            valid_tokens = sum(batch["loss_mask"].double().sum() for batch in microbatches).to(device)
            torch.distributed.all_reduce(valid_tokens, group=dp_group)
            valid_tokens = max(valid_tokens.item(), 1.0)
        loss_function = {
            "3-output": three_output_loss,
            "2-output": functools.partial(two_output_loss, cp_group),
            "nemo-rl": functools.partial(
                nemo_rl_loss, valid_tokens, len(microbatches), torch.distributed.get_world_size(cp_group)
            ),
        }[loss]
        if aux_loss_only:
            loss_function = functools.partial(_zero_loss, loss_function)
        language_model = self.language_model
        last_stage = pipeline.stage()["post_process"]
        uses = pipeline.stage_keys(language_model) | {PACKED, IMAGES, IMAGE_TILES}  # a multimodal model is never staged
        failures = pipeline.ForwardFailures(language_model)

        def forward_step(data_iterator, model):
            inputs, local, full_shape = next(data_iterator)
            inputs = {key: value if key in uses else None for key, value in inputs.items()}
            call = dict(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], attention_mask=None)
            for key in (PACKED, IMAGES, IMAGE_TILES):
                if inputs.get(key) is not None:
                    call[key] = inputs[key]
            scope = contextlib.nullcontext()
            if labels:
                call.update(labels=inputs["labels"], loss_mask=inputs["loss_mask"])
            else:
                call.update(labels=None)
                if inputs.get("mtp_loss_mask") is not None:
                    if mtp_mask == "explicit":
                        call.update(loss_mask=inputs["mtp_loss_mask"])
                    else:
                        scope = mtp.loss_mask_scope(inputs["mtp_loss_mask"])

            returned = []  # what the model hands back beside its output (a CP-slicing or multimodal model's mask)

            def forward():
                with scope:
                    output, mask = mtp.split_output(model(**call))
                returned.append(mask)
                if not labels and last_stage:  # logits [b, s, v/tp]: the trainer's own LM loss
                    output = language_model.compute_language_model_loss(
                        local["labels"], output.transpose(0, 1).contiguous()
                    )
                return output

            output = failures.run(forward, local["loss_mask"], full_shape) if staged else forward()
            mask = local["loss_mask"]
            if inputs.get(IMAGES) is not None:  # the combined (text + image) sequence's mask, as the model sliced it
                mask = returned[0]
                if mask is None or mask.shape != output.shape:
                    shape = None if mask is None else tuple(mask.shape)
                    raise ValueError(
                        "a multimodal model must return (output, combined loss mask of the output's shape), as "
                        f"LLaVAModel.forward does; got mask {shape} for output {tuple(output.shape)}"
                    )
            return output, functools.partial(loss_function, mask)

        slices_cp = mtp.model_slices_context_parallel(self.model)
        prepared = [(*_prepare(batch, device, slices_cp), tuple(batch["input_ids"].shape)) for batch in microbatches]
        previous_scale = self.config.mtp_grad_scale_func
        scale = 0.0 if aux_loss_only else mtp_grad_scale
        if scale == GLOBAL_VALID_TOKENS:
            scale = 1.0 / valid_tokens
        if scale is not None:
            self.config.mtp_grad_scale_func = lambda: float(scale)
        try:
            return self.run(forward_step, iter(prepared), num_microbatches=len(prepared),
                            seq_length=microbatches[0]["input_ids"].shape[1],
                            micro_batch_size=microbatches[0]["input_ids"].shape[0], update=update,
                            failures=failures if staged else None)
        finally:
            self.config.mtp_grad_scale_func = previous_scale
        if staged:
            failures.raise_first()

    def run(self, forward_step_func, data_iterator, *, num_microbatches, seq_length, micro_batch_size, update=True,
            failures=None):
        """One training step of Megatron's schedule with any forward step; returns a MegatronStepResult.

        ``forward_step_func(data_iterator, model)`` is what the schedule calls per microbatch (`step`'s
        own, or a trainer's: Megatron-Bridge's ``gpt_step.forward_step`` with its state bound); it
        must return (output, loss function) with the loss function reporting ``{"lm loss": [sum,
        count]}`` as pretrain_gpt's does. ``data_iterator`` yields its ``num_microbatches``
        microbatches; ``seq_length`` is the full (not CP-local) sequence length, ``micro_batch_size``
        the rows per microbatch (the pipeline schedule sizes its exchanges from them).
        update: run the optimizer step (the gradient buffers are zeroed first in every case).
        failures: a `pipeline.ForwardFailures` whose first stage failure is raised on every stage
        once the schedule is through.
        """
        import torch
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        from . import moe
        from ..models import pipeline
        from ..models.tiny_gpt import logged_mtp_metrics

        if update and self.optimizer is None:
            raise ValueError("update=True needs an optimizer: build MegatronStep(model, optimizer='megatron')")
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        device = next(self.model.parameters()).device
        self.model.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        MTPLossLoggingHelper.tracker.clear()  # fresh, sized by this model's MTP depth on first use
        moe.fresh_moe_tracker()  # likewise, by this model's layers
        with self.schedule_scope():
            reports = get_forward_backward_func()(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=[self.model],
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=False,
            )
        if failures is not None:
            failures.raise_first()
        lm_totals = torch.zeros(2, dtype=torch.float64, device=device)  # the last stage's reports
        if reports:
            lm_totals = torch.stack([report["lm loss"].double() for report in reports]).sum(0)
        torch.distributed.all_reduce(lm_totals, group=dp_cp_group)
        losses = (lm_totals[0] / lm_totals[1].clamp(min=1)).item(), logged_mtp_metrics(num_microbatches, dp_cp_group)
        if pipeline.size() > 1:
            losses = pipeline.broadcast_from_last_stage(losses if pipeline.stage()["post_process"] else None)
        lm_loss, metrics = losses
        grads = _finalized_grads(self.language_model, _encoder_parameters(self.model.module, self.language_model))
        moe_facts = dict(moe_metrics=moe.logged_moe_metrics(num_microbatches),
                         router_grads=moe.router_gradients(self.language_model))
        update_norm = None
        if update:
            update_norm = self._optimizer_step()
        return MegatronStepResult(lm_loss=lm_loss, update_norm=update_norm, **metrics, **grads, **moe_facts)

    def _optimizer_step(self):
        """megatron-core's optimizer step; the L2 norm of the full (TP-gathered) weight update."""
        model = self.language_model
        before = dict(_full_flat(model, lambda param: param.detach().clone()))
        succeeded, _, _ = self.optimizer.step()
        if not succeeded:
            raise RuntimeError("megatron-core's optimizer step did not succeed")
        after = _full_flat(model, lambda param: param)
        return math.sqrt(sum((flat - before[name]).double().pow(2).sum().item() for name, flat in after))


def _zero_loss(loss_function, *args):
    """``loss_function(*args)`` with its loss (the first output) times 0: no gradient, same reports."""
    loss, *rest = loss_function(*args)
    return (loss * 0, *rest)


def three_output_loss(loss_mask, output_tensor):
    """pretrain_gpt's shape: (this rank's loss sum, its token count, {"lm loss": [sum, count]})."""
    import torch

    losses, mask = output_tensor.float().reshape(-1), loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask)
    count = mask.sum()
    return loss, count.detach().to(torch.int), {"lm loss": torch.stack([loss.detach(), count.detach()])}


def two_output_loss(cp_group, loss_mask, output_tensor):
    """The legacy 2-output shape: the CP-global mean, differentiable through this rank's tokens.

    The schedule multiplies a 2-output loss by the CP size and DDP averages over DP x CP, so the
    CP ranks' gradients add up to the gradient of the whole sequence's mean.
    """
    import torch

    losses, mask = output_tensor.float().reshape(-1), loss_mask.float().reshape(-1)
    local = torch.sum(losses * mask)
    totals = torch.stack([local.detach(), mask.sum()])
    torch.distributed.all_reduce(totals, group=cp_group)
    loss = (local - local.detach() + totals[0]) / totals[1].clamp(min=1)
    return loss, {"lm loss": torch.stack([local.detach(), mask.sum()])}


def nemo_rl_loss(global_valid_tokens, num_microbatches, cp_size, loss_mask, output_tensor):
    """NeMo-RL's per-token flow: loss sum over the step's global valid tokens, the schedule's
    2-output scaling (x CP / num_microbatches) undone."""
    import torch

    losses, mask = output_tensor.float().reshape(-1), loss_mask.float().reshape(-1)
    local = torch.sum(losses * mask)
    loss = local / global_valid_tokens * num_microbatches / cp_size
    return loss, {"lm loss": torch.stack([local.detach(), mask.sum()])}


def check_step_arguments(microbatches, loss, labels, mtp_grad_scale, per_token, update, optimizer, mtp_mask="explicit",
                         variable_shapes=False):
    """ValueError naming the argument for what `MegatronStep.step` cannot run. ``variable_shapes``:
    microbatches may differ in shape (the tensors of one microbatch never)."""
    import torch

    if loss not in LOSS_SHAPES:
        raise ValueError(f"loss must be one of {LOSS_SHAPES}, got {loss!r}")
    if loss == "2-output" and per_token:
        raise ValueError(
            "loss='2-output' needs calculate_per_token_loss=False: a 2-output loss counts no tokens, so "
            "finalize_model_grads would not normalise the step; use '3-output' or 'nemo-rl'"
        )
    if loss == "nemo-rl" and not per_token:
        raise ValueError("loss='nemo-rl' needs calculate_per_token_loss=True (NeMo-RL's per-token flow)")
    if not (mtp_grad_scale is None or mtp_grad_scale == GLOBAL_VALID_TOKENS
            or (isinstance(mtp_grad_scale, (int, float)) and not isinstance(mtp_grad_scale, bool) and mtp_grad_scale > 0)):
        raise ValueError(f"mtp_grad_scale must be None, a positive number or {GLOBAL_VALID_TOKENS!r}, got {mtp_grad_scale!r}")
    if mtp_mask not in MASK_ROUTES:
        raise ValueError(f"mtp_mask must be one of {MASK_ROUTES}, got {mtp_mask!r}")
    if mtp_mask == "scoped" and labels:
        raise ValueError("mtp_mask='scoped' needs labels=False: a mask is scoped for the RL forward only")
    if update and optimizer is None:
        raise ValueError("update=True needs an optimizer: build MegatronStep(model, optimizer='megatron')")
    if not isinstance(microbatches, (list, tuple)) or not microbatches:
        raise ValueError(f"microbatches must be a non-empty list of dicts, got {type(microbatches).__name__}")
    check_multimodal_microbatches(microbatches, loss, labels, mtp_grad_scale)
    first = None
    for index, batch in enumerate(microbatches):
        if not isinstance(batch, dict) or any(key not in batch for key in MICROBATCH_KEYS):
            raise ValueError(f"microbatches[{index}] must be a dict with keys {MICROBATCH_KEYS}")
        shape = None
        if labels and batch.get("mtp_loss_mask") is not None:
            raise ValueError(
                f"microbatches[{index}] has an mtp_loss_mask (input_ids-aligned, the RL convention) but "
                "labels=True: with labels Megatron's MTP loss uses the label-aligned loss_mask"
            )
        for key, value in batch.items():
            if value is None:
                continue
            if key == PACKED:
                check_packed_microbatch(batch, index)
                continue
            if key in (IMAGES, IMAGE_TILES):
                continue
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                raise ValueError(f"microbatches[{index}][{key!r}] must be a [micro_batch_size, seq] tensor")
            if shape is None:
                shape = tuple(value.shape)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"microbatches[{index}][{key!r}] has shape {tuple(value.shape)}, expected {shape} "
                    "(every tensor of a microbatch has the same shape)"
                )
        first = first or shape
        if not variable_shapes and shape != first:
            raise ValueError(
                f"microbatches[{index}] has shape {shape}, microbatches[0] {first}: under pipeline parallelism "
                "microbatches of different shapes need config.variable_seq_lengths=True (the schedule's "
                "point-to-point exchanges otherwise receive the first microbatch's shape)"
            )


def check_multimodal_microbatches(microbatches, loss, labels, mtp_grad_scale):
    """Microbatches with ``images``: all of them, BSHD, labels, a loss that needs no text-length token count."""
    import torch

    multimodal = [isinstance(batch, dict) and IMAGES in batch for batch in microbatches]
    if not any(multimodal):
        return
    if not all(multimodal):
        raise ValueError(f"microbatches: either every microbatch holds {IMAGES!r} or none does, got {multimodal}")
    if not labels or loss == "nemo-rl" or mtp_grad_scale == GLOBAL_VALID_TOKENS:
        raise ValueError(
            "multimodal microbatches need labels=True and loss '2-output' or '3-output' without "
            f"mtp_grad_scale={GLOBAL_VALID_TOKENS!r}: their loss mask is the combined one LLaVAModel returns "
            "(it returns none without labels), not the text-length mask a step-global token count would read"
        )
    for index, batch in enumerate(microbatches):
        images = batch[IMAGES]
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            raise ValueError(f"microbatches[{index}][{IMAGES!r}] must be a [num_images, channels, h, w] tensor")
        tiles = batch.get(IMAGE_TILES)
        if tiles is not None and (not isinstance(tiles, torch.Tensor) or tuple(tiles.shape) != (images.shape[0],)
                                  or tiles.dtype.is_floating_point):
            raise ValueError(f"microbatches[{index}][{IMAGE_TILES!r}] must be an integer tensor of shape "
                             f"[num_images] = ({images.shape[0]},), got {tiles!r:.80}")
        if batch.get(PACKED) is not None or batch.get("mtp_loss_mask") is not None:
            raise ValueError(f"microbatches[{index}]: a multimodal microbatch is BSHD, without an mtp_loss_mask")


def check_packed_microbatch(batch, index):
    """A packed microbatch: THD params whose padded boundaries cover its one [1, T] row exactly."""
    params = batch[PACKED]
    if getattr(params, "qkv_format", None) != "thd" or getattr(params, "cu_seqlens_q", None) is None:
        raise ValueError(
            f"microbatches[{index}][{PACKED!r}] must be a PackedSeqParams with qkv_format 'thd' and "
            f"cu_seqlens_q, got {params!r}"
        )
    shape = tuple(batch["input_ids"].shape)
    end = int(padded_boundaries(params)[-1])
    if len(shape) != 2 or shape[0] != 1 or shape[1] != end:
        raise ValueError(
            f"microbatches[{index}]: a packed microbatch is one [1, T] row with T the last padded boundary "
            f"({end}), got input_ids of shape {shape}"
        )


def padded_boundaries(packed_seq_params):
    """The boundaries a packed row is laid out on: ``cu_seqlens_q_padded``, else ``cu_seqlens_q``."""
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return packed_seq_params.cu_seqlens_q if padded is None else padded


def _prepare(batch, device, slices_cp):
    """(what the model gets, this CP rank's share for the loss) of one full-length microbatch."""
    from megatron.core import parallel_state

    from ...mtp import cp_shard
    from ..models.tiny_gpt import cp_slice

    if IMAGES in batch:  # the model combines text and images, then slices CP itself
        inputs = {key: value if key == PACKED or value is None else value.to(device) for key, value in batch.items()}
        return inputs, dict(inputs)
    tensors = {key: value for key, value in batch.items() if key != PACKED}
    params = batch.get(PACKED)
    if params is None:
        local = cp_slice(tensors)
    else:
        size = parallel_state.get_context_parallel_world_size()
        rank = parallel_state.get_context_parallel_rank()
        boundaries = padded_boundaries(params)
        local = {key: None if value is None else cp_shard(value, size, rank, boundaries) for key, value in tensors.items()}
    local = {key: None if value is None else value.to(device) for key, value in local.items()}
    inputs = {key: None if value is None else value.to(device) for key, value in tensors.items()} if slices_cp else dict(local)
    inputs[PACKED] = params
    return inputs, local


def _encoder_parameters(root, language_model):
    """(name, parameter) of ``root`` outside ``language_model`` (LLaVAModel's vision tower and projector)."""
    inside = {id(param) for param in language_model.parameters()}
    return [(name, param) for name, param in root.named_parameters() if id(param) not in inside]


def _full_flat(model, tensor_of, named=None):
    """[(name, flat float32 CPU tensor)] of every parameter of ``model`` (or of the ``named`` (name,
    parameter) pairs) in the order of the same model built at TP1 / EP1 / PP1: ``tensor_of(param)``
    (None: zeros), identical on every rank.

    TP shards are gathered to the full tensor over the parameter's own tensor-parallel group (the
    expert tensor-parallel group for experts), in its TP layout (`tp_layout.tp_unshard`). Under expert
    parallelism each rank holds only its experts (``...experts.local_experts.<i>...``, global expert
    ``ep_rank * local + i``): they are gathered over the expert-parallel group and listed in global
    expert order under their global names, where a TP1 / EP1 model lists them. Under pipeline
    parallelism every stage's parameters of ``model``, under the PP1 model's names and in its order.
    """
    import torch
    from megatron.core import parallel_state

    from ..models import pipeline
    from ..oracles.tp_layout import tp_unshard

    groups = {False: parallel_state.get_tensor_model_parallel_group(),
              True: parallel_state.get_expert_tensor_parallel_group()}
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_size = torch.distributed.get_world_size(ep_group)
    staged = pipeline.size() > 1 and named is None
    pairs = named if named is not None else pipeline.global_names(model) if staged else model.named_parameters()
    out, experts = [], {}  # experts: module prefix -> [(global index, position, name, flat)]
    for position, (name, param) in enumerate(pairs):
        tensor = tensor_of(param)
        tensor = torch.zeros_like(param, dtype=torch.float32) if tensor is None else tensor.detach().float()
        match = _EXPERT.match(name)
        group = groups[match is not None]
        tp_size = torch.distributed.get_world_size(group)
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(tensor) for _ in range(tp_size)]
            torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
            tensor = tp_unshard(shards, param)
        flat = tensor.reshape(-1).cpu()
        if match is None:
            out.append((name, flat))
            continue
        prefix, local = match["prefix"], int(match["index"])
        if prefix not in experts:
            experts[prefix] = []
            out.append((prefix, None))  # where this module's experts go
        parts = [flat]
        if ep_size > 1:
            parts = [torch.empty_like(flat) for _ in range(ep_size)]
            torch.distributed.all_gather(parts, flat.contiguous(), group=ep_group)
        count = model.config.num_moe_experts // ep_size  # every MoE layer of the model holds as many
        for ep_rank, part in enumerate(parts):
            index = ep_rank * count + local
            experts[prefix].append((index, position, f"{prefix}{index}{match['rest']}", part))
    listed = []
    for name, flat in out:
        if flat is not None:
            listed.append((name, flat))
        else:
            listed += [(global_name, part) for _, _, global_name, part in sorted(experts[name], key=lambda e: e[:2])]
    return pipeline.gather_stages(listed) if staged else listed


# a SequentialMLP expert's parameter: "<module>.experts.local_experts." + local index + the rest
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts\.local_experts\.)(?P<index>\d+)(?P<rest>\..+)$")


def _finalized_grads(model, encoder=()):
    """The finalized main_grads, TP shards (and pipeline stages) gathered, as flat "mtp" / "lm" vectors
    of ``model`` (and an "encoder" vector of the ``encoder`` (name, parameter) pairs, if any) and their
    names, with norms."""
    import torch

    parts, names = {"mtp": [], "lm": []}, {"mtp": [], "lm": []}
    group_squares, zero = {}, []
    def main_grad(param):
        return getattr(param, "main_grad", None)

    entries = [(name, "mtp" if name.split(".")[0] == "mtp" else "lm", flat)
               for name, flat in _full_flat(model, main_grad)]
    entries += [(name, "encoder", flat) for name, flat in _full_flat(None, main_grad, named=encoder)]
    for name, part, flat in entries:
        top = name.split(".")[0]
        parts.setdefault(part, []).append(flat)
        names.setdefault(part, []).append(name)
        group_squares[top] = group_squares.get(top, 0.0) + flat.double().pow(2).sum().item()
        if not flat.any():
            zero.append(name)
    grads = {part: (torch.cat(flats) if flats else torch.zeros(0)).numpy() for part, flats in parts.items()}
    return dict(
        grads=grads,
        grad_names={part: tuple(found) for part, found in names.items()},
        grad_norm=math.sqrt(sum(group_squares.values())),
        group_grad_norms={group: math.sqrt(square) for group, square in group_squares.items()},
        zero_grad_params=tuple(zero),
    )
