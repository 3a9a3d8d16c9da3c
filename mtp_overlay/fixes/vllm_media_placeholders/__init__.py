"""vllm-media-placeholders: literal media placeholders in a multimodal message's text are removed before
vLLM's chat parser and chat template render it.

vLLM 0.33.0's chat path (``renderers/chat_utils/chat_message.py``) parses each message with
``parse_chat_message_content`` (called by ``parse_chat_messages`` and its async twin, whatever renderer
asks). For a "string" template it joins the texts and adds one placeholder per item unless the text
already holds it (``get_full_multimodal_text_prompt``, ``:142``): a literal ``<image>`` beside one image
is taken as that image's placeholder, two are refused. For an "openai" (content list) template the parts
go to the template as they are, which for Nemotron Omni's rule renders the literal copies as the
placeholders. Either way the typed string, not the structured item, decides where an image goes
(vLLM #57740).

The hook wraps ``parse_chat_message_content``: a message that carries structured media parts gets the
model's own placeholder strings (``get_placeholder_str`` of vLLM's model class, for each modality it has,
at every index up to this request's items) removed from its text parts before vLLM parses it
(`media_placeholders.neutralise`); strict mode refuses it (`OverlayError`). The caller's message is left
as it was.
"""

import weakref

from ...calls import argument
from ...contract import Verdict, drifted, needed, redundant
from .. import Fix
from ..media_placeholders import MODALITIES, Tally, media_counts, neutralise
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

FUNCTION = "parse_chat_message_content"
JOIN = "get_full_multimodal_text_prompt"  # vLLM's join of a message's texts and placeholders ("string" templates)
PARAMETERS = ["message", "mm_tracker", "content_format"]
TALLY = Tally()
# a request's item tracker (one per parse_chat_messages call) -> the messages parsed with it so far: the
# index of the next one in the request, for strict mode's error
MESSAGES_SEEN: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def model_placeholders(message: object, tracker: "Any") -> "list[str]":
    """The model's placeholder strings for every modality it has, at the indexes this request reaches
    (vLLM numbers items from 1; most models ignore the index)."""
    media = media_counts(message)
    found = set()
    for modality in MODALITIES:
        for index in range(1, tracker.get_num_items(modality) + media[modality] + 2):
            try:
                placeholder = tracker.model_cls.get_placeholder_str(modality, index)
            except (ValueError, NotImplementedError):  # the model has no such modality
                break
            if isinstance(placeholder, str) and placeholder:
                found.add(placeholder)
    return sorted(found)


def parse_chat_message_content(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                               kwargs: "dict[str, Any]") -> "Any":
    message, tracker = argument(args, kwargs, 0, "message"), argument(args, kwargs, 1, "mm_tracker")
    index = MESSAGES_SEEN.get(tracker, 0)
    MESSAGES_SEEN[tracker] = index + 1
    if not media_counts(message):
        return wrapped(*args, **kwargs)
    (fixed,), changed = neutralise([message], model_placeholders(message, tracker), FIX.lifecycle.strict,
                                   f"mtp-overlay fix {DECLARATION.name!r}: ", first=index)
    return TALLY.call(wrapped, args, kwargs, "message", fixed, changed)


class VllmMediaPlaceholdersFix(Fix):
    declaration = DECLARATION

    def probe(self, module: "ModuleType") -> Verdict:
        import inspect

        from ...contract import defined_in

        function = defined_in(module, [FUNCTION])
        if function is None:
            return drifted(f"{module.__name__} defines no {FUNCTION}")
        parameters = list(inspect.signature(function).parameters)
        if parameters[:3] != PARAMETERS:
            return drifted(f"{FUNCTION}{tuple(parameters)} does not take {', '.join(PARAMETERS)} first")
        join = defined_in(module, [JOIN])
        if join is None:
            return drifted(f"{module.__name__} defines no {JOIN}")
        from vllm.exceptions import VLLMValidationError

        try:  # one image, its placeholder also written in the text: stock binds the image to the typed one
            joined = join({"<image>": ["<image>"]}, ["<image> what is this?"], False)
        except VLLMValidationError as exc:  # upstream refuses the literal (vLLM PR #57781's way)
            return redundant(f"{JOIN} refuses a literal placeholder beside a structured item: {exc}")
        if joined != "<image> what is this?":
            return redundant(f"{JOIN} no longer takes a literal placeholder for an item's: {joined!r}")
        return needed(f"{JOIN} takes a literal placeholder in a message's text for its structured item's "
                      f"(vLLM #57740); content-list templates get the literal copies as they are")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        yield module, FUNCTION, parse_chat_message_content

    def details(self) -> "dict[str, Any]":
        return dict(TALLY.details())


FIX = VllmMediaPlaceholdersFix()
