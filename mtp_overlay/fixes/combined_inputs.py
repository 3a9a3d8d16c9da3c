"""Where one multimodal forward keeps the combined ids and mask until its language model is called.

``LLaVAModel.forward`` (wrapped) opens a `Combined` for its language model; ``_preprocess_data`` and
``_process_embedding_token_parallel`` (wrapped) fill it in; the GPTModel/HybridModel forward hook of
fix mtp-loss-mask calls `inject` first thing, which hands them to that language model's call when the
call carries none. One wrapper on the language model's forward, two reasons: mtp-multimodal declares
``requires=("mtp-loss-mask",)``. Shared by both fixes, so neither imports the other (fix-to-fix imports
follow the declarations' ``requires`` / ``reads``: `tests/contract/test_layers.py`). A ContextVar, so
threads and asyncio tasks each see their own; nothing here touches a tensor's values (no device sync).
"""

import contextlib
import contextvars

from ..calls import argument, with_argument

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from typing import Any


class Combined:
    """One multimodal forward's combined inputs for ``language_model``: ``ids`` and ``loss_mask``
    ([batch, this rank's combined length], None until built), ``fill_id`` (the id of image and
    padding slots), ``built_mask`` (the mask was built from the caller's input-aligned one: a forward
    without labels), ``injected`` (the language model got them)."""

    __slots__ = ("language_model", "ids", "loss_mask", "fill_id", "built_mask", "injected")

    def __init__(self, language_model: "Any") -> None:
        self.language_model = language_model
        self.ids: "Any" = None
        self.loss_mask: "Any" = None
        self.fill_id = 0
        self.built_mask = False
        self.injected = False


_current: "contextvars.ContextVar[tuple[Any, Combined] | None]" = contextvars.ContextVar(
    "mtp_multimodal_combined", default=None)


@contextlib.contextmanager
def opened(model: "Any", language_model: "Any") -> "Iterator[Combined]":
    """A `Combined` for ``model``'s forward (its ``language_model``), current for the block."""
    combined = Combined(language_model)
    token = _current.set((model, combined))
    try:
        yield combined
    finally:
        _current.reset(token)


def of(model: "Any") -> "Combined | None":
    """The `Combined` of ``model``'s forward under way in this context, or None."""
    current = _current.get()
    return current[1] if current is not None and current[0] is model else None


def inject(language_model: "Any", args: "tuple[Any, ...]", kwargs: "dict[str, Any]",
           at: "Mapping[str, int]") -> "tuple[tuple[Any, ...], dict[str, Any]]":
    """The call ``(args, kwargs)`` of ``language_model``'s forward, given the combined ``input_ids``
    and ``loss_mask`` where it carries none, when a multimodal forward built them for this model
    (``at``: parameter name -> position in ``args``). Anything else passes through unchanged."""
    current = _current.get()
    combined = None if current is None else current[1]
    if combined is None or combined.language_model is not language_model or combined.ids is None:
        return args, kwargs
    if argument(args, kwargs, at.get("input_ids"), "input_ids", None) is None:
        args, kwargs = with_argument(args, kwargs, at.get("input_ids"), "input_ids", combined.ids)
    if combined.loss_mask is not None and argument(args, kwargs, at.get("loss_mask"), "loss_mask", None) is None:
        args, kwargs = with_argument(args, kwargs, at.get("loss_mask"), "loss_mask", combined.loss_mask)
    combined.injected = True
    return args, kwargs
