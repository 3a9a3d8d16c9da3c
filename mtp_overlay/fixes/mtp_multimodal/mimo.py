"""MimoModel (``models/mimo/model/base.py``, megatron-core 0.19.x): the probe and the wrappers.

MimoModel's ``input_ids`` already have the combined length: one modality special token per modality
embedding (``align_embeddings_by_token_positions``, :144-210). Both of its language-model paths
(``_forward_all_modules`` :845-853, ``_forward_language_module`` :695-703, :725-733) still call the
language model with ``input_ids=None`` and no ``loss_mask``. So:

* ``forward``: when the language model has MTP layers, opens a `combined_inputs.Combined` holding the ids
  (``input_ids``; a special token that is no vocabulary id becomes 0, `combined.fill_id`'s rule) and
  the mask: the caller's ``loss_mask`` (without labels: input-aligned, or the
  `mtp_overlay.mtp.loss_mask_scope` mask, all ones without either), 0 at every modality slot and,
  with labels, wherever the label is a modality token: no modality slot is ever an MTP target;
* ``_shard_language_inputs``: after upstream's, the ids and mask go through the model's own
  ``partition_adapter.shard`` as labels and loss mask (CP-sliced exactly like them, never
  SP-scattered); without an adapter they stay whole, as the labels do.

The language model's forward (mtp-loss-mask's hook) injects them, as for LLaVAModel.
"""

from ...calls import argument, original, positions
from ...contract import Verdict, defined_in, drifted, needed, redundant
from ..combined_inputs import Combined, of, opened
from .source import missing_inputs, read_calls, verdict_parts

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

MODEL = "MimoModel"
PARAMETERS = {  # the parameters each method this fix wraps or reads must start with
    "forward": ("self", "input_ids", "position_ids", "attention_mask", "loss_mask", "labels"),
    "_shard_language_inputs": ("self", "embeddings", "labels", "loss_mask", "packed_seq_params"),
}
PATHS = ("_forward_all_modules", "_forward_language_module")  # the methods that call the language model
LANGUAGE_MODEL_CALL, SLICING_CALL = "self.language_model", "self._shard_language_inputs"


def probe(module: "ModuleType") -> Verdict:
    import inspect

    cls = defined_in(module, [MODEL])
    if cls is None:
        return drifted(f"{module.__name__} has no {MODEL}")
    calls, sliced = [], set()
    for name in PATHS:
        method = vars(cls).get(name)
        read = None if method is None else read_calls(original(method), LANGUAGE_MODEL_CALL, SLICING_CALL)
        if read is None:
            return drifted(f"{MODEL}.{name} is missing or makes no {LANGUAGE_MODEL_CALL}(...) call this fix can read")
        calls += read[0]
        sliced |= read[1]
    missing, unsliced = verdict_parts(calls, sliced)
    if not missing:
        if not unsliced:
            return redundant(f"every language-model call of {MODEL} passes input_ids (sliced with the labels) and "
                             "loss_mask (upstream, or patched on disk)")
        return drifted(f"{MODEL} passes input_ids {', '.join(unsliced)} that {SLICING_CALL} never slices: a "
                       "partial upstream fix whose shape the hook does not fit")
    for name, expected in PARAMETERS.items():
        method = vars(cls).get(name)
        if method is None:
            return drifted(f"{MODEL} has no {name}")
        parameters = tuple(inspect.signature(original(method)).parameters)
        if parameters[: len(expected)] != expected:
            return drifted(f"{MODEL}.{name}{parameters} does not start with {expected}")
    lacking = sum(1 for call in calls if missing_inputs(call))
    return needed(f"{MODEL} calls its language model without {' and '.join(missing)} ({lacking} of its {len(calls)} "
                  "calls; the MTP block embeds the next positions' ids and weights its loss by the mask)")


def wrappers(module: "ModuleType", check: "Callable[[], None]") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
    """The two MimoModel wrappers; ``check`` raises unless the hook that injects is installed."""
    from ...mtp import unwrap_model

    cls = defined_in(module, [MODEL])
    forward_at = positions(vars(cls)["forward"], method=True)
    shard_at = positions(vars(cls)["_shard_language_inputs"], method=True)

    def forward(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                kwargs: "dict[str, Any]") -> "Any":
        language_model = getattr(instance, "language_model", None)
        language_model = None if language_model is None else unwrap_model(language_model)
        if not getattr(language_model, "mtp_process", False):
            return wrapped(*args, **kwargs)
        check()
        inputs = [argument(args, kwargs, forward_at.get(name), name, None) for name in ("input_ids", "labels", "loss_mask")]
        with opened(instance, language_model) as combined:
            build(instance, language_model, combined, *inputs)
            return wrapped(*args, **kwargs)

    def shard_language_inputs(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                              kwargs: "dict[str, Any]") -> "Any":
        result = wrapped(*args, **kwargs)
        combined = of(instance)
        adapter = getattr(instance, "partition_adapter", None)
        if combined is not None and combined.ids is not None and adapter is not None:
            packed = argument(args, kwargs, shard_at.get("packed_seq_params"), "packed_seq_params", None)
            _, combined.ids, combined.loss_mask, _ = adapter.shard(
                embeddings=None, labels=combined.ids, loss_mask=combined.loss_mask, packed_seq_params=packed)
        return result

    yield cls, "forward", forward
    yield cls, "_shard_language_inputs", shard_language_inputs


def build(model: "Any", language_model: "Any", combined: "Combined", input_ids: "Any", labels: "Any",
          loss_mask: "Any") -> None:
    """Fill ``combined`` with the ids and mask of a MimoModel forward (full rows, sliced later)."""
    import torch

    from ... import mtp

    if input_ids is None:
        return
    vocab_size = language_model.vocab_size
    special = torch.zeros_like(input_ids, dtype=torch.bool)
    target = torch.zeros_like(input_ids, dtype=torch.bool)
    for token in model.special_token_ids.values():
        special |= input_ids == token
        if labels is not None:
            target |= labels == token
    out_of_vocab = (input_ids < 0) | (input_ids >= vocab_size)
    combined.ids = input_ids.masked_fill(special & out_of_vocab, 0)  # combined.fill_id's rule, per slot
    mask = loss_mask if loss_mask is not None or labels is not None else mtp.scoped_loss_mask()
    if mask is None:
        mask = torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    elif tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"loss_mask of a MimoModel forward must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(mask.shape)}")
    combined.loss_mask = mask.masked_fill(special | target, 0)
