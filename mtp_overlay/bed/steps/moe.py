"""MoE layers in the test bed: which routers sit in the MTP block, what their aux loss trains and logs.

What a check of the MTP block's MoE router needs (megatron-core 0.17-0.19.x build the hybrid MTP
block's MoE layers without ``is_mtp_layer``: ``models/hybrid/hybrid_block.py:183-191``, the MOE
branch of ``HybridStack.__init__``, omits the flag its attention branches pass; Megatron-LM PR #6748
passes it on main):

* `mtp_moe_layers` / `backbone_moe_layers`: the ``MoELayer`` instances of a built model, by name.
* `flag_mtp_moe_layers`: the reference semantics, set by hand on the instances: every MoE layer in
  the MTP block, its ``MoETransformerLayer`` and its router get ``is_mtp_layer=True``, as PR #6748's
  build would give them. ``router.py:575-581`` then divides the load-balancing loss of a repeated
  MTP layer by ``mtp_num_layers`` (it is applied once per depth), and ``router.py:591-592`` logs it
  in slot ``layer_number + num_layers``.
* `aux_loss_gradients`: one step of Megatron's own training step (`megatron_step.MegatronStep`,
  ``aux_loss_only=True``: the LM loss times 0 and the MTP loss scale 0, so only
  ``MoEAuxLossAutoScaler`` injects gradient) and what it gives: every router's finalized gradient
  (the aux loss's alone) and the per-layer logged aux losses.
* `logged_moe_metrics`: megatron-core's per-layer MoE logging slots (``moe_logging``'s tracker,
  reduced the way its ``report`` reduces them), read and cleared.
* `FunctionCalls`: which functions of a folder ran in a block, and how often (a hook that acts at
  build time and in logging only shows up per build and per logging call, nothing per token).

The MTP router's aux-loss gradient alone is linear in the aux loss's scale at each application and
no backbone aux loss reaches it (the MTP block runs after the backbone), so stock's MTP router
gradient is exactly ``mtp_num_layers`` times the flagged model's; backbone routers also receive the
MTP aux loss's gradient through the hidden states, so they differ too, by no fixed factor.
"""

import dataclasses
import sys

from ..models.pipeline import language_model_of


def moe_layers(model):
    """``[(name, MoELayer)]`` of every megatron-core MoE layer in ``model``, in module order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoELayer)]


def mtp_moe_layers(model):
    """The MoE layers inside the MTP block (``mtp.``), by name."""
    return [(name, layer) for name, layer in moe_layers(language_model_of(model)) if name.startswith("mtp.")]


def backbone_moe_layers(model):
    """The MoE layers of the backbone (everything outside the MTP block), by name."""
    return [(name, layer) for name, layer in moe_layers(language_model_of(model)) if not name.startswith("mtp.")]


def flag_mtp_moe_layers(model):
    """Set ``is_mtp_layer=True`` on every MTP-block MoE layer, its ``MoETransformerLayer`` and its
    router (the reference semantics, module docstring); returns their names. ValueError if the
    model has no MoE layer in its MTP block."""
    language_model = language_model_of(model)
    layers = mtp_moe_layers(language_model)
    if not layers:
        raise ValueError("model has no MoE layer in its MTP block (an 'E' in the MTP pattern)")
    for name, layer in layers:
        owner = language_model.get_submodule(name.rpartition(".")[0])  # the MoETransformerLayer
        for module in (owner, layer, layer.router):
            module.is_mtp_layer = True
    return [name for name, _ in layers]


def router_gradients(model):
    """``{name: numpy}`` of every MoE router weight's finalized gradient (DDP's ``main_grad``, else
    ``grad``; zeros if none). Router weights are replicated over TP and EP, so every rank holds the
    whole gradient once ``finalize_model_grads`` has run."""
    import torch

    grads = {}
    for name, layer in moe_layers(language_model_of(model)):
        weight = layer.router.weight
        grad = getattr(weight, "main_grad", None)
        grad = weight.grad if grad is None else grad
        grad = torch.zeros_like(weight) if grad is None else grad
        grads[f"{name}.router.weight"] = grad.detach().float().cpu().numpy().copy()
    return grads


def fresh_moe_tracker():
    """Drop megatron-core's MoE metrics tracker: the next record sizes a new one by the model that
    records (the tracker keeps its first size, ``num_layers + mtp_num_layers``, for the process'
    life). No-op on releases without ``moe_logging``."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:
        return
    destroy_moe_metrics_tracker()


def logged_moe_metrics(num_microbatches):
    """``{metric: (per-slot values)}`` of megatron-core's MoE tracker, then cleared.

    Reduced the way ``MoEMetricsTracker.report`` reduces them (``moe_logging.py`` ``_sync_metrics``:
    summed over each entry's reduce group, averaged over its average group and, if it asks, over
    data parallel ranks) and scaled by ``1 / num_microbatches``, as its per-layer logging writes them.
    Slot ``i`` is layer number ``i + 1``; MTP layers, when the router knows it is one, log at
    ``layer_number + num_layers``. ``{}`` without MoE metrics (or on releases without the tracker).
    """
    import torch

    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return {}
    from megatron.core import parallel_state

    tracker = get_moe_metrics_tracker()
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    metrics = {}
    for name, entry in tracker.metrics.items():
        values = entry.values.detach().clone()
        if entry.reduce_group is not None:
            torch.distributed.all_reduce(values, group=entry.reduce_group)
        if entry.avg_group is not None:
            torch.distributed.all_reduce(values, group=entry.avg_group, op=torch.distributed.ReduceOp.AVG)
        if entry.needs_dp_avg:
            torch.distributed.all_reduce(values, group=dp_group, op=torch.distributed.ReduceOp.AVG)
        metrics[name] = tuple((values / num_microbatches).tolist())
    tracker.clear()
    return metrics


@dataclasses.dataclass(frozen=True)
class AuxLossGradients:
    """What the MoE aux loss alone trained and logged in one step (`aux_loss_gradients`).

    mtp, backbone: ``{router weight name: numpy}`` of the finalized aux-loss gradient of the MTP
      block's routers and of the backbone's. slots: ``{metric: per-slot values}`` of the logged aux
      losses (`logged_moe_metrics`: ``"load_balancing_loss"`` for ``aux_loss`` routing,
      ``"seq_load_balancing_loss"`` for ``seq_aux_loss``, ...). step: the `MegatronStepResult`.
    """

    mtp: dict
    backbone: dict
    slots: tuple
    step: object


def aux_loss_gradients(step, microbatches, **step_kwargs):
    """One `MegatronStep` step with ``aux_loss_only=True`` (no optimizer update); its AuxLossGradients.

    ``step``: a `megatron_step.MegatronStep` around a model with MoE layers; ``step_kwargs`` go to
    ``step.step`` (``loss``, ``labels``, ...). Call on every rank.
    """
    result = step.step(microbatches, aux_loss_only=True, update=False, **step_kwargs)
    mtp_names = {f"{name}.router.weight" for name, _ in mtp_moe_layers(step.language_model)}
    grads = result.router_grads
    return AuxLossGradients(
        mtp={name: grad for name, grad in grads.items() if name in mtp_names},
        backbone={name: grad for name, grad in grads.items() if name not in mtp_names},
        slots=result.moe_metrics,
        step=result,
    )


class FunctionCalls:
    """``{function name: calls}`` of the functions defined under ``folder`` while the block runs
    (``sys.setprofile``: this thread only)."""

    def __init__(self, folder):
        self.folder, self.calls = str(folder), {}

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(self.folder):
            self.calls[frame.f_code.co_name] = self.calls.get(frame.f_code.co_name, 0) + 1
