"""hf-media-placeholders: literal media placeholders in a multimodal message's text are removed before a
transformers processor's chat template renders it.

transformers 5.20.2 ``ProcessorMixin.apply_chat_template`` (``processing_utils.py:1999``) hands the
conversation to the Jinja template as it is; a template that counts a message's structured items unless
its text already holds the placeholder (Nemotron Super Omni's) emits the literal copies as placeholders,
one more than the images there are. ``sanitize_control_tokens`` exists on the tokenizer's
``apply_chat_template`` only, and no flag can undo a template's own logic.

The hook wraps ``ProcessorMixin.apply_chat_template``: each message of the conversation (or of each
conversation of a batch) that carries structured media parts gets its text parts' literal copies of the
processor's ``image_token`` / ``video_token`` / ``audio_token`` (or its tokenizer's) removed
(`media_placeholders.neutralise`),
in a copy; the caller's conversation is left as it was. Strict mode refuses such a message instead
(`OverlayError` naming the conversation, the message, the placeholder and the counts). Subclasses that
override the method and call ``super()`` go through the hook; one that renders on its own does not.
"""

from ...calls import argument, original
from ...contract import Verdict, drifted, needed, redundant
from .. import Fix
from ..media_placeholders import Tally, neutralise, processor_placeholders
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

METHOD = "apply_chat_template"
TALLY = Tally()


def is_batched(conversation: object) -> bool:
    """transformers' own test (``processing_utils.py``): a list whose first item is a list or has ``content``."""
    return isinstance(conversation, (list, tuple)) and bool(conversation) and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "content"))


def sanitized(conversation: "Any", placeholders: "list[str]", strict: bool) -> "tuple[Any, int]":
    """``(conversation, messages changed)``: a batch conversation by conversation."""
    where = f"mtp-overlay fix {DECLARATION.name!r}: "
    if not placeholders or not isinstance(conversation, (list, tuple)):
        return conversation, 0
    if not is_batched(conversation):
        return neutralise(conversation, placeholders, strict, where)
    done, changed = [], 0
    for index, one in enumerate(conversation):
        fixed, count = neutralise(one, placeholders, strict, f"{where}conversation {index}, ")
        done.append(fixed)
        changed += count
    return done, changed


def apply_chat_template(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                        kwargs: "dict[str, Any]") -> "Any":
    conversation = argument(args, kwargs, 0, "conversation")
    fixed, changed = sanitized(conversation, list(processor_placeholders(instance).values()), FIX.lifecycle.strict)
    return TALLY.call(wrapped, args, kwargs, "conversation", fixed, changed)


class HfMediaPlaceholdersFix(Fix):
    declaration = DECLARATION

    def probe(self, module: "ModuleType") -> Verdict:
        import inspect

        from ...contract import defined_in

        mixin = defined_in(module, ["ProcessorMixin"])
        if not isinstance(mixin, type) or METHOD not in vars(mixin):
            return drifted(f"{module.__name__} has no ProcessorMixin with its own {METHOD}")
        parameters = list(inspect.signature(original(vars(mixin)[METHOD])).parameters)
        if parameters[:2] != ["self", "conversation"]:
            return drifted(f"ProcessorMixin.{METHOD}{tuple(parameters)} does not take the conversation first")
        marker = self.marker
        if marker.in_function(vars(mixin)[METHOD]):
            return redundant(f"ProcessorMixin.{METHOD} reads the processor's {marker.calls} (upstream handles "
                             f"literal placeholders in text)")
        return needed(f"ProcessorMixin.{METHOD} renders literal media placeholders in a message's text beside its "
                      f"structured media")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        yield vars(module)["ProcessorMixin"], METHOD, apply_chat_template

    def details(self) -> "dict[str, Any]":
        return dict(TALLY.details())


FIX = HfMediaPlaceholdersFix()
