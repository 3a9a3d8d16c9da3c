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

A prompt tokenized by the caller (``prompt_token_ids`` with ``multi_modal_data``) never passes the chat
parser. vLLM's processor binds each item to the first of its placeholder token sequences it finds
(``BaseMultiModalProcessor._maybe_apply_prompt_updates``) and ``_validate_mm_placeholders`` then compares
the items bound with the items given, never with the placeholders the prompt holds: 2 placeholders and
1 image bind the first silently, the second stays in the prompt as text. The second hook, on
``_maybe_apply_prompt_updates``, counts the placeholders vLLM's own matching (``_plan_prompt_updates``,
on the model's own prompt update targets) would bind had it an item for each, and refuses a prompt that
holds more than its items with vLLM's ``VLLMValidationError`` naming the modality and both counts (what
vLLM PR #57781 proposes), strict or not: binding the wrong span silently is never the lesser evil.
"""

import functools
import threading
import weakref
from collections import Counter

from ...calls import argument, original
from ...contract import Verdict, drifted, needed, redundant
from .. import Fix
from ..media_placeholders import MODALITIES, Tally, media_counts, neutralise
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from types import ModuleType
    from typing import Any

FUNCTION = "parse_chat_message_content"
JOIN = "get_full_multimodal_text_prompt"  # vLLM's join of a message's texts and placeholders ("string" templates)
PARAMETERS = ["message", "mm_tracker", "content_format"]
TALLY = Tally()
# a request's item tracker (one per parse_chat_messages call) -> the messages parsed with it so far: the
# index of the next one in the request, for strict mode's error
MESSAGES_SEEN: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
PROCESSOR, APPLY = "BaseMultiModalProcessor", "_maybe_apply_prompt_updates"  # where vLLM binds items to placeholders
PLAN, MATCHES = "_plan_prompt_updates", "iter_token_matches"  # vLLM's matching of the items' targets in a prompt
REFUSED: "Counter[str]" = Counter()  # modality -> prompts refused for surplus placeholders, in this process
REFUSED_LOCK = threading.Lock()


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


def bindable(processor: "ModuleType", prompt: "list[int]", updates: "Any",
             items: "Mapping[str, int]") -> "Counter[str]":
    """modality -> how many placeholders vLLM's matching would bind in ``prompt`` had it an item for each
    (``updates``: the items' resolved prompt updates, vLLM's ``MultiModalPromptUpdates``; ``items``: the
    count of each modality's items). Empty when no modality's targets occur more often than its items: one
    scan of the prompt per target, the common case; vLLM's planner runs only for a prompt with a surplus."""
    occurrences: "Counter[str]" = Counter()
    for modality, per_item in updates.items():
        targets = {tuple(update.target) for alternatives in per_item for update in alternatives
                   if isinstance(update.target, list)}  # a PromptIndex (start, prefix, end) is no placeholder
        occurrences[modality] = sum(sum(1 for _ in getattr(processor, MATCHES)(prompt, list(target)))
                                    for target in targets)
    if not any(occurrences[modality] > items.get(modality, 0) for modality in occurrences):
        return Counter()
    # the last item's updates repeated, one per occurrence: vLLM's own planner decides which would bind
    extended = {modality: list(per_item) + [per_item[-1]] * occurrences[modality]
                for modality, per_item in updates.items() if per_item}
    planned, _ = getattr(processor, PLAN)(prompt, extended)
    return Counter(matched.update.modality for matched in planned)


def maybe_apply_prompt_updates(processor: "ModuleType", wrapped: "Callable[..., Any]", instance: "Any",
                               args: "tuple[Any, ...]", kwargs: "dict[str, Any]") -> "Any":
    """vLLM's binding of items to placeholders, after refusing a prompt with more placeholders than items
    (``processor``: vLLM's module, bound at install)."""
    items = argument(args, kwargs, 0, "mm_items").get_all_counts()
    result = argument(args, kwargs, 1, "mm_res")
    bound = bindable(processor, result.prompt_ids, result.prompt_updates, items)
    for modality, placeholders in sorted(bound.items()):
        if placeholders > items.get(modality, 0):
            with REFUSED_LOCK:
                REFUSED[modality] += 1
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(
                f"mtp-overlay fix {DECLARATION.name!r}: the prompt holds {placeholders} {modality} placeholder(s) "
                f"for {items.get(modality, 0)} {modality} item(s): vLLM would bind each item to the first placeholder "
                f"it finds, whoever wrote it, and leave the others as text (vLLM #57740); remove the extra "
                f"placeholder tokens from the prompt or pass an item for each", parameter="prompt_token_ids")
    return wrapped(*args, **kwargs)


class VllmMediaPlaceholdersFix(Fix):
    declaration = DECLARATION

    def probe(self, module: "ModuleType") -> Verdict:
        if self.role_of(module) == "processor":
            return self.probe_processor(module)
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

    def probe_processor(self, module: "ModuleType") -> Verdict:
        """Runs the stock binding on a prompt of 2 placeholder tokens (id 7) and 1 image item: needed when
        it binds and accepts, redundant when vLLM refuses the surplus itself."""
        import inspect
        from types import SimpleNamespace

        from ...contract import defined_in

        processor = defined_in(module, [PROCESSOR])
        apply = original(vars(processor).get(APPLY)) if processor is not None else None
        needs = {f"{PROCESSOR}.{APPLY}": apply, **{name: vars(module).get(name) for name in (PLAN, MATCHES)}}
        missing = [name for name, found in needs.items() if not callable(found)]
        if missing or apply is None:
            return drifted(f"{module.__name__} defines no {', '.join(missing)}")
        parameters = list(inspect.signature(apply).parameters)
        if parameters[:3] != ["self", "mm_items", "mm_res"]:
            return drifted(f"{PROCESSOR}.{APPLY}{tuple(parameters)} does not take self, mm_items, mm_res first")
        from vllm.exceptions import VLLMValidationError

        bare: "Any" = object.__new__(type("SurplusProbe", (processor,), dict.fromkeys(processor.__abstractmethods__)))
        update = module.ResolvedPromptUpdate("image", 0, module.UpdateMode.REPLACE, [7],
                                             module.PromptUpdateDetails.from_seq([7, 7, 7]))
        result = module.MultiModalProcessingResult([7, 1, 7], {"image": [None]}, {}, {"image": [[update]]})
        try:
            prompt, placeholders = apply(bare, SimpleNamespace(get_all_counts=lambda: {"image": 1}), result)
        except VLLMValidationError as exc:  # vLLM PR #57781's way
            return redundant(f"{PROCESSOR}.{APPLY} refuses more placeholder tokens than items: {exc}")
        counted = bindable(module, result.prompt_ids, result.prompt_updates, {"image": 1})
        if counted != {"image": 2}:
            return drifted(f"vLLM's matching ({PLAN}) counts {dict(counted)} placeholders in {result.prompt_ids}, "
                           f"not the 2 it holds: the count the hook refuses by does not hold here")
        spans = [(p.start_idx, p.length) for p in placeholders.get("image", [])]
        return needed(f"{PROCESSOR}.{APPLY} binds 1 image to the first of 2 placeholders and accepts the prompt "
                      f"({[7, 1, 7]} -> {prompt}, image at (offset, length) {spans}; vLLM #57740)")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        if self.role_of(module) == "processor":
            yield getattr(module, PROCESSOR), APPLY, functools.partial(maybe_apply_prompt_updates, module)
        else:
            yield module, FUNCTION, parse_chat_message_content

    def details(self) -> "dict[str, Any]":
        details = dict(TALLY.details())
        if REFUSED:
            refused = ", ".join(f"{n} {modality}" for modality, n in sorted(REFUSED.items()))
            note = f"prompt(s) with more placeholders than items refused: {refused}"
            details.update(prompts_refused=dict(REFUSED), note="; ".join(filter(None, [details.get("note"), note])))
        return details


FIX = VllmMediaPlaceholdersFix()
