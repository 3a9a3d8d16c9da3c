"""vllm-media-placeholders on stock vLLM: a chat message with one structured image and two literal
``<image>`` renders two placeholders on vLLM's chat route; one image binds, the other stays in the prompt."""

import tempfile
from pathlib import Path

from ..steps import media_placeholders as mp

FIX = "vllm-media-placeholders"


def reproduce():
    """The chat route (OpenAIServingChat, vLLM's renderer and LLaVA's processor) with the fix off; the bug
    shows when the prompt holds more placeholders than images bound."""
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-media-") as work:
        chat = mp.VllmChat(mp.write_processor(Path(work) / "processor"))
        with mp.fix_off(FIX):
            seen = chat.render(mp.conversation(1, mp.SEED_TEXTS))
    if "error" in seen:
        return True, f"stock vLLM chat route, 1 structured image and two literal {mp.PLACEHOLDER}: {seen['error']}"
    return seen["placeholders"] > seen["items"], (
        f"stock vLLM chat route, 1 structured image and two literal {mp.PLACEHOLDER}: {seen['placeholders']} "
        f"placeholder(s) in the prompt, {seen['items']} image(s) bound, {seen['image_tokens']} image token(s)")
