"""Pipeline parallelism (PP) in the test bed: stage models that hold the PP1 model's weights, what each
stage's forward gets, and a step's gradients gathered from every stage.

megatron-core builds one model per pipeline stage: ``pre_process`` (the embedding) on the first,
``post_process`` (final norm, output layer, loss) on the last; HybridModel takes its stage's layers
from the pattern's ``|``-separated segments (``models/hybrid/hybrid_layer_allocation.py``
``select_pipeline_segment``; a pattern without ``|`` is split evenly, deprecated) and builds the MTP
block on the last stage only (``transformer/multi_token_prediction.py`` ``mtp_on_this_rank`` without
a custom layout), with its own copy of the word embeddings there: MTP embeds the input ids again.
That copy starts as the first stage's (zeroed, then all-reduced over the embedding group:
``models/common/language_module/language_module.py:279-284, 302-308``), and ``finalize_model_grads``
all-reduces the two copies' gradients (``distributed/finalize_model_grads.py``
``_allreduce_word_embedding_grads``). A stage numbers its decoder layers from 0; each layer's
``layer_number`` is global.

* `build_stage`: a stage model holding the PP1 model's weights: the PP1 model is built from the seed
  under a PP1 layout of the same ranks (same TP and CP ranks), and its weights are loaded into the
  stage by global parameter name, as a checkpoint load does. A stage built from the seed alone would
  draw its layers' weights from another point of the generator, and could not be compared with PP1.
* `global_names`: a stage's parameters under the PP1 model's names.
* `stage_keys`: the microbatch entries a stage's forward uses (Megatron-Bridge 0.6
  ``training/gpt_step.py:258-261``: the first stage and an MTP stage the token and position ids, the
  last stage the labels and the loss mask; packed-sequence parameters everywhere).
* `gather_stages`: every stage's ``(global name, tensor)`` pairs on every rank, in stage order (the
  PP1 model's parameter order); a parameter held by two stages (the embedding copy) once, after
  checking that both copies agree.
* `ForwardFailures`: a stage whose forward raises (a stock crash, a fix's refusal: on the MTP stage
  in the parity table's cases) still takes its part in the schedule's exchanges, with a stand-in
  output of the right shape; after the schedule every stage raises the error of the first stage that
  had one. Without it the other stages would wait for that stage's activations or gradients forever.

Call inside ``run_ranks`` workers (model parallelism initialised with ``pp``).
"""

import contextlib

INPUT_KEYS = ("input_ids", "position_ids")  # the first stage's, and the MTP stage's
LOSS_KEYS = ("labels", "loss_mask", "mtp_loss_mask")  # the last stage's


def size():
    """The pipeline-parallel world size."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def stage():
    """``{"pre_process": first stage, "post_process": last stage}``: a stage model's constructor flags."""
    from megatron.core import parallel_state

    return dict(pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage())


def stage_keys(model):
    """The microbatch keys this stage's forward uses (``model``: the stage's megatron-core model)."""
    flags = stage()
    keys = set()
    if flags["pre_process"] or getattr(model, "mtp_process", False):
        keys.update(INPUT_KEYS)
    if flags["post_process"]:
        keys.update(LOSS_KEYS)
    return keys


@contextlib.contextmanager
def pp1_layout():
    """Inside the block the ranks' model parallelism is the same TP and CP (and EP) without pipeline
    stages (the rest data parallel); the pipelined layout is initialised again after it.

    A collective over every rank (new process groups). Groups held by models built before stay usable.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    layout = dict(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    pipelined = parallel_state.get_pipeline_model_parallel_world_size()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=1, **layout)
    try:
        if (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank()) != (
            tp_rank, cp_rank
        ):
            raise RuntimeError(
                f"without pipeline stages this rank is TP rank {parallel_state.get_tensor_model_parallel_rank()}, "
                f"CP rank {parallel_state.get_context_parallel_rank()}, not {tp_rank}, {cp_rank}: its "
                "PP1 weights would be another rank's shard"
            )
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pipelined, **layout)


def build_stage(build, full_kwargs, stage_kwargs):
    """``build(**stage_kwargs)`` on this stage, holding the weights of ``build(**full_kwargs)`` at PP1.

    ``build`` makes a megatron-core model from ``parallel_state`` (its stage flags from `stage`);
    ``full_kwargs`` build the whole model (e.g. the hybrid pattern without ``|``), ``stage_kwargs``
    this stage's. Every parameter of the stage must exist, with its shape, in the PP1 model.
    """
    import torch

    with pp1_layout():
        full = {name: param.detach().clone() for name, param in build(**full_kwargs).named_parameters()}
    model = build(**stage_kwargs)
    with torch.no_grad():
        for name, param in global_names(model):
            if name not in full or full[name].shape != param.shape:
                found = "missing" if name not in full else f"of shape {tuple(full[name].shape)}"
                raise ValueError(
                    f"stage parameter {name!r} of shape {tuple(param.shape)} has no PP1 counterpart ({found}): "
                    "the stage and full builds must describe the same model"
                )
            param.copy_(full[name])
    return model


def global_names(model):
    """``(name, parameter)`` of ``model`` (a stage's megatron-core model) under the PP1 model's names:
    ``decoder.layers.<i>.*`` numbered by the layer's global ``layer_number`` (1-based)."""
    layers = getattr(getattr(model, "decoder", None), "layers", ())
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(layers[int(parts[2])].layer_number - 1)
        yield ".".join(parts), param


def gather_stages(named):
    """Every stage's ``named`` ``[(global name, tensor)]`` on every rank, in stage order (a collective
    over the pipeline group); a name two stages hold comes once, at its first stage.

    Tensors must be CPU tensors. RuntimeError if two stages' copies of a parameter differ (for
    gradients: ``finalize_model_grads`` did not all-reduce the embedding copies).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    stages = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, [(name, tensor.numpy()) for name, tensor in named], group=group)
    merged, where = {}, {}
    for index, pairs in enumerate(stages):
        for name, array in pairs:
            if name in merged:
                if not (merged[name] == array).all():
                    difference = float(abs(merged[name].astype("float64") - array).max())
                    raise RuntimeError(
                        f"pipeline stages {where[name]} and {index} hold different copies of {name!r} "
                        f"(max |difference| {difference:.3g})"
                    )
                continue
            merged[name], where[name] = array, index
    return [(name, torch.from_numpy(array)) for name, array in merged.items()]


def broadcast_from_last_stage(value):
    """``value`` of the last pipeline stage on every stage (a picklable object; a collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return holder[0]


class ForwardFailures:
    """Forward failures of one pipelined step, raised on every stage once the schedule is through.

    ``run(forward, loss_mask, full_shape)`` returns ``forward()``; if it raises, the error is kept
    and a stand-in output returned: on the last stage zeros shaped like ``loss_mask`` (per-token
    losses), elsewhere zeros shaped like the activations the next stage receives ([seq / CP (/ TP
    under SP), mbs, hidden] of the microbatch's ``full_shape`` [mbs, seq]); both depend on the
    stage's input activations, so a zero gradient travels back. `raise_first` (a collective over the
    pipeline group) then raises the error of the first stage that had one, on every stage (on the
    others with a note naming that stage).
    """

    def __init__(self, language_model):
        self.language_model = language_model
        self.config = language_model.config
        self.error = None

    def run(self, forward, loss_mask, full_shape):
        import torch
        from megatron.core import parallel_state

        try:
            return forward()
        except Exception as error:  # noqa: BLE001 - re-raised on every stage by raise_first
            self.error = self.error or error
        received = getattr(getattr(self.language_model, "decoder", None), "input_tensor", None)
        link = 0.0 if received is None else 0.0 * received.sum()
        if stage()["post_process"]:
            return torch.zeros_like(loss_mask, dtype=torch.float32) + link
        split = parallel_state.get_context_parallel_world_size()
        if self.config.sequence_parallel:
            split *= parallel_state.get_tensor_model_parallel_world_size()
        mbs, seq = full_shape
        shape = (seq // split, mbs, self.config.hidden_size)
        device = loss_mask.device if received is None else received.device
        return torch.zeros(shape, dtype=self.config.pipeline_dtype, device=device, requires_grad=received is None) + link

    def raise_first(self):
        import pickle

        import torch.distributed as dist
        from megatron.core import parallel_state

        error = self.error
        if error is not None:
            try:
                pickle.dumps(error)
            except Exception:  # noqa: BLE001 - an error type that does not travel: its text does
                error = RuntimeError(f"{type(error).__name__}: {error}")
        group = parallel_state.get_pipeline_model_parallel_group()
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        for index, found in enumerate(errors):
            if found is None:
                continue
            if index == dist.get_rank(group):
                raise self.error
            found.add_note(f"(raised on pipeline stage {index})")
            raise found


def language_model_of(model):
    """The megatron-core language model inside DDP and wrappers (``.module``, ``.llava_model`` of
    Megatron-Bridge's NemotronVLModel, ``.language_model``)."""
    while any(hasattr(model, name) for name in ("module", "llava_model", "language_model")):
        model = next(getattr(model, name) for name in ("module", "llava_model", "language_model")
                     if hasattr(model, name))
    return model
