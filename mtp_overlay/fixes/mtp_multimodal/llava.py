"""LLaVAModel (``models/multimodal/llava_model.py``, megatron-core 0.19.x): the probe and the wrappers.

* ``forward``: when the language model has MTP layers, opens a `combined_inputs.Combined` for the call;
* ``_preprocess_data``: after upstream's, the combined ids (`combined.place`: the text ids at their
  slots, `combined.fill_id` at image and padding slots) and the mask: with labels, upstream's own
  label-aligned ``new_loss_mask`` (0 at image slots and before each image, :706-725); without labels
  (RL), the caller's input-aligned ``loss_mask`` (or the `mtp_overlay.mtp.loss_mask_scope` mask; all
  ones without either) placed like the ids, 0 at image and padding slots;
* ``_process_embedding_token_parallel``: after upstream's, the ids (and a built mask) padded to the
  same multiple (the fill id, 0) and sliced for this CP rank by the same upstream function
  (``get_batch_on_this_cp_rank``, or TE's THD index); never scattered for SP (labels and mask are
  not either); with labels the mask is upstream's sliced ``new_loss_mask``;
* ``forward`` again, on the way out: without labels it returns the combined mask it built (this
  rank's slots, the logits' layout) where upstream returns None.

megatron-core 0.18.x has the same ``llava_model.py``, but its MTP ``roll_tensor`` refuses the
``position_ids=None`` LLaVAModel passes: the probe calls it on None and reports drift there.
"""

from ...calls import argument, original, positions
from ...contract import Verdict, defined_in, drifted, needed, redundant
from .combined import fill_id, pad_to_multiple, place, text_slots
from ..combined_inputs import Combined, of, opened
from .source import read_calls, verdict_parts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

MODEL = "LLaVAModel"
# the parameters each wrapped method must start with (megatron-core 0.18.0-0.19.2 alike)
PARAMETERS = {
    "forward": ("self", "images", "input_ids", "position_ids", "attention_mask", "labels", "loss_mask"),
    "_preprocess_data": ("self", "image_embeddings", "language_embeddings", "input_ids", "loss_mask", "labels",
                         "use_inference_kv_cache", "inference_context", "image_token_index", "num_image_tiles"),
    "_process_embedding_token_parallel": ("self", "combined_embeddings", "new_labels", "new_loss_mask",
                                          "packed_seq_params"),
}
KEYWORD_ONLY = {"_preprocess_data": ("is_packed_dynamic_res",)}
LANGUAGE_MODEL_CALL, SLICING_CALL = "self.language_model", "self._process_embedding_token_parallel"


def stock_methods(cls: type) -> "dict[str, Callable[..., Any] | None]":
    """The upstream methods this fix wraps, seen through every wrapper (None where missing)."""
    found = {}
    for name in PARAMETERS:
        method = vars(cls).get(name)
        found[name] = None if method is None else original(method)
    return found


def rolls_none() -> bool:
    """Whether megatron-core's MTP ``roll_tensor`` takes a None tensor (``(None, None)``), as the
    ``position_ids=None`` of ``LLaVAModel.forward`` needs: called, on a None only (no device)."""
    from megatron.core.transformer import multi_token_prediction

    try:
        return bool(multi_token_prediction.roll_tensor(None, shifts=-1, dims=-1) == (None, None))
    except (TypeError, AttributeError):
        return False


def probe(module: "ModuleType") -> Verdict:
    import inspect

    cls = defined_in(module, [MODEL])
    if cls is None:
        return drifted(f"{module.__name__} has no {MODEL}")
    methods = stock_methods(cls)
    forward = methods["forward"]
    read = None if forward is None else read_calls(forward, LANGUAGE_MODEL_CALL, SLICING_CALL)
    if read is None:
        return drifted(f"{MODEL}.forward makes no {LANGUAGE_MODEL_CALL}(...) call this fix can read")
    missing, unsliced = verdict_parts(*read)
    if not missing:
        call = read[0][0]
        if not unsliced:
            return redundant(f"{MODEL}.forward passes input_ids={call['input_ids']} (sliced for CP/SP with the "
                             f"embeddings) and loss_mask={call['loss_mask']} to its language model (upstream, or "
                             "patched on disk)")
        # Megatron-LM main since PR #6260: combined ids that CP/SP padding and slicing never reach
        return drifted(f"{MODEL}.forward passes input_ids={call['input_ids']} and loss_mask={call['loss_mask']} to "
                       f"its language model, but {SLICING_CALL} does not slice {', '.join(unsliced)} with the "
                       "embeddings (under CP/SP they would not line up): a partial upstream fix whose shape the hook "
                       "does not fit")
    if not rolls_none():
        return drifted("MTP's roll_tensor (transformer/multi_token_prediction.py) refuses None, so the "
                       f"position_ids=None that {MODEL}.forward passes crashes MTP with the ids given too "
                       "(megatron-core accepts it from 0.19.0): the hook's ids alone would not make MTP run")
    for name, expected in PARAMETERS.items():
        method = methods[name]
        if method is None:
            return drifted(f"{MODEL} has no {name}")
        parameters = inspect.signature(method).parameters
        if tuple(parameters)[: len(expected)] != expected:
            return drifted(f"{MODEL}.{name}{tuple(parameters)} does not start with {expected}")
        absent = [keyword for keyword in KEYWORD_ONLY.get(name, ()) if keyword not in parameters]
        if absent:
            return drifted(f"{MODEL}.{name} has no parameter(s) {absent}")
    return needed(f"{MODEL}.forward calls its language model without {' and '.join(missing)} (the MTP block "
                  "embeds the next positions' ids and weights its loss by the mask)")


def wrappers(module: "ModuleType", check: "Callable[[], None]") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
    """The three LLaVAModel wrappers; ``check`` raises unless the hook that injects is installed."""
    cls = defined_in(module, [MODEL])
    methods: "dict[str, Any]" = stock_methods(cls)  # probed first: every method is there
    preprocess_at = positions(methods["_preprocess_data"], method=True)
    parallel_at = positions(methods["_process_embedding_token_parallel"], method=True)
    forward_at = positions(methods["forward"], method=True)

    def forward(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                kwargs: "dict[str, Any]") -> "Any":
        language_model = getattr(instance, "language_model", None)
        if not getattr(language_model, "mtp_process", False):
            return wrapped(*args, **kwargs)
        check()
        with opened(instance, language_model) as combined:
            result = wrapped(*args, **kwargs)
        labels = argument(args, kwargs, forward_at["labels"], "labels", None)
        if labels is None and combined.built_mask and isinstance(result, tuple) and len(result) == 2:
            if result[1] is None:  # upstream returns no mask without labels: the combined one
                return result[0], combined.loss_mask
        return result

    def preprocess_data(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                        kwargs: "dict[str, Any]") -> "Any":
        result = wrapped(*args, **kwargs)
        combined = of(instance)
        if combined is not None:
            build(instance, combined, result, lambda name: argument(args, kwargs, preprocess_at.get(name), name, None))
        return result

    def process_embedding_token_parallel(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                         kwargs: "dict[str, Any]") -> "Any":
        result = wrapped(*args, **kwargs)
        combined = of(instance)
        if combined is not None and combined.ids is not None:
            packed = argument(args, kwargs, parallel_at.get("packed_seq_params"), "packed_seq_params", None)
            shard(module, instance, combined, packed)
            if not combined.built_mask:
                combined.loss_mask = result[2]  # upstream's sliced new_loss_mask
        return result

    yield cls, "forward", forward
    yield cls, "_preprocess_data", preprocess_data
    yield cls, "_process_embedding_token_parallel", process_embedding_token_parallel


def build(model: "Any", combined: "Combined", result: "tuple[Any, Any, Any]",
          read: "Callable[[str], Any]") -> None:
    """Fill ``combined`` with the ids and mask of ``model._preprocess_data``'s call (its ``result`` and
    its arguments, ``read`` by name), in the combined layout it returned."""
    from ... import mtp

    embeddings, labels, new_loss_mask = result
    if read("use_inference_kv_cache") or (embeddings is None and labels is None):
        return  # the KV cache already holds the images, or a middle pipeline stage: nothing combined
    if labels is not None:
        length = labels.shape[1]
    else:
        length = embeddings.shape[1 if model.context_parallel_lm > 1 else 0]  # [b, S, h] under CP, else [S, b, h]
    input_ids = read("input_ids")
    image_token_index = read("image_token_index")
    tokens_per_tile = 1 if read("is_packed_dynamic_res") else model.img_seq_len
    is_image, slot = text_slots(input_ids, image_token_index, read("num_image_tiles"), tokens_per_tile)
    combined.fill_id = fill_id(image_token_index, model.language_model.vocab_size)
    combined.ids = place(input_ids, is_image, slot, length, combined.fill_id)
    if labels is not None:
        combined.loss_mask = new_loss_mask  # label-aligned, 0 at image slots and before each image (:706-725)
        return
    caller = read("loss_mask")
    if caller is None:
        caller = mtp.scoped_loss_mask()
    if caller is None:
        import torch

        caller = torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    elif tuple(caller.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"loss_mask of a LLaVAModel forward without labels must be input-aligned, of input_ids' shape "
            f"{tuple(input_ids.shape)} (the text with its image placeholders), got {tuple(caller.shape)}"
        )
    combined.loss_mask = place(caller, is_image, slot, length, 0)
    combined.built_mask = True


def shard(module: "ModuleType", model: "Any", combined: "Combined", packed_seq_params: "Any") -> None:
    """Pad and CP-slice ``combined``'s ids (and a built mask) as ``model._process_embedding_token_parallel``
    pads and slices the labels and mask (:781-876): padded to the shard factor when this stage holds
    the embeddings, then this CP rank's part."""
    cp, tp, sequence_parallel = model.context_parallel_lm, model.tensor_model_parallel_size_lm, model.sequence_parallel_lm
    ids, mask = combined.ids, combined.loss_mask if combined.built_mask else None
    if model.pre_process:
        factor = 2 * cp * (tp if sequence_parallel else 1) if cp > 1 else (tp if sequence_parallel else 1)
        ids = pad_to_multiple(ids, factor, combined.fill_id)
        mask = None if mask is None else pad_to_multiple(mask, factor, 0)
    if cp > 1:
        tensors = {"ids": ids} if mask is None else {"ids": ids, "mask": mask}
        if packed_seq_params is None or packed_seq_params.qkv_format == "sbhd":
            from megatron.core.parallel_state import get_context_parallel_group
            from megatron.core.utils import get_batch_on_this_cp_rank

            tensors = get_batch_on_this_cp_rank(tensors, is_hybrid_cp=False, cp_group=get_context_parallel_group())
        else:  # THD: the index upstream takes from Transformer Engine (module global tex)
            index = module.tex.thd_get_partitioned_indices(
                packed_seq_params.cu_seqlens_q_padded, ids.shape[1], model.cp_group.size(), model.cp_group.rank())
            tensors = {key: value.index_select(1, index) for key, value in tensors.items()}
        ids, mask = tensors["ids"], tensors.get("mask")
    combined.ids = ids
    if mask is not None:
        combined.loss_mask = mask
