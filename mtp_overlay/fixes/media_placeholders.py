"""The one rule of hf-media-placeholders and vllm-media-placeholders: in a message that carries structured
media items, literal copies of the processor's own media placeholder strings in its text parts are removed,
so the structured items alone decide how many placeholders the chat template emits, and where.

Why removed, not replaced by visible text: any visible stand-in ("[image]") is text the model never saw
in training and may itself tokenize into a placeholder's pieces on some tokenizer; an empty string cannot.
This is what NeMo-RL does (``sanitize_image_placeholders``, PR #3494). A message without structured media
is left as it is: a text-only prompt may talk about "<image>". Strict mode refuses instead, naming the
message, the placeholder and the counts.
"""

import threading
from collections import Counter

from ..calls import with_argument
from ..contract import OverlayError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

# content part "type" -> modality, for the spellings transformers' processors and vLLM's chat parser take
MEDIA_PART_TYPES = {
    "image": "image", "image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
    "video": "video", "video_url": "video", "video_embeds": "video",
    "audio": "audio", "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio",
}
MODALITIES = ("image", "video", "audio")


def media_counts(message: object) -> "Counter[str]":
    """modality -> how many structured items ``message`` (a dict whose ``content`` is a list of parts) carries."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return Counter()
    return Counter(MEDIA_PART_TYPES[part["type"]] for part in content
                   if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES)


def literal_counts(message: object, placeholders: "Sequence[str]") -> "Counter[str]":
    """placeholder -> how many times it is written in the text parts of ``message``."""
    found: "Counter[str]" = Counter()
    content = message.get("content") if isinstance(message, dict) else None
    for part in content if isinstance(content, list) else ():
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if isinstance(text, str):
            for placeholder in placeholders:
                found[placeholder] += text.count(placeholder)
    return +found


def neutralise(conversation: "Sequence[Any]", placeholders: "Sequence[str]", strict: bool, where: str = "",
               first: int = 0) -> "tuple[list[Any], int]":
    """``(conversation with the literal placeholders removed, messages changed)``; the messages changed
    are copies, the caller's stay as they were. ``strict``: `OverlayError` naming the first such message
    (``where`` says whose rule and, for a batch, which conversation: "mtp-overlay fix 'x': conversation 1, ";
    ``first``: the index of ``conversation[0]`` in the whole conversation, for a caller that sees a part).

    Longer placeholders go first, so one that contains another ("<image>" in "<image><image>") is removed whole.
    """
    placeholders = sorted({p for p in placeholders if p}, key=len, reverse=True)
    result, changed = list(conversation), 0
    for index, message in enumerate(conversation):
        media = media_counts(message)
        literals = literal_counts(message, placeholders) if media else Counter()
        if not literals:
            continue
        if strict:
            placeholder, count = next(iter(literals.items()))
            items = ", ".join(f"{n} {modality}" for modality, n in sorted(media.items()))
            raise OverlayError(
                f"{where}message {first + index} writes the media placeholder {placeholder!r} {count} time(s) in its "
                f"text beside {items} structured item(s): the typed placeholders, not the items, would decide how many "
                f"placeholders the template emits and where; remove them from the text (or turn strict mode off to "
                f"have them removed)")
        result[index] = {**message, "content": [_without(part, placeholders) for part in message["content"]]}
        changed += 1
    return result, changed


def _without(part: object, placeholders: "Sequence[str]") -> object:
    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        return part
    text = part["text"]
    while any(placeholder in text for placeholder in placeholders):  # a removal can join one: "<<image>image>"
        for placeholder in placeholders:
            text = text.replace(placeholder, "")
    return {**part, "text": text}


def processor_placeholders(processor: object) -> "dict[str, str]":
    """modality -> the media placeholder string a transformers processor owns (its ``image_token``,
    ``video_token``, ``audio_token``, or else its tokenizer's: those it has)."""
    tokenizer = getattr(processor, "tokenizer", None)
    found = {modality: getattr(processor, f"{modality}_token", None) or getattr(tokenizer, f"{modality}_token", None)
             for modality in MODALITIES}
    return {modality: token for modality, token in found.items() if isinstance(token, str) and token}


class Tally:
    """How many messages a fix changed in this process (for its `status` details)."""

    def __init__(self) -> None:
        self.messages = 0
        self._lock = threading.Lock()

    def call(self, wrapped: "Callable[..., Any]", args: "tuple[Any, ...]", kwargs: "dict[str, Any]", name: str,
             fixed: object, changed: int) -> "Any":
        """``wrapped`` called with its first argument ``name`` replaced by ``fixed`` when ``changed``
        messages were (counted), else as it was called."""
        if changed:
            with self._lock:
                self.messages += changed
            args, kwargs = with_argument(args, kwargs, 0, name, fixed)
        return wrapped(*args, **kwargs)

    def details(self) -> "Mapping[str, Any]":
        if not self.messages:
            return {}
        return {"messages_changed": self.messages,
                "note": f"{self.messages} message(s) with structured media had literal media placeholders removed"}
