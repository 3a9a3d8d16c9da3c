"""vllm-media-placeholders on stock vLLM: a chat message with one structured image and two literal
``<image>`` renders two placeholders on vLLM's chat route; one image binds, the other stays in the prompt.
A tokenized prompt with two ``<image>`` and one image binds the first and is accepted."""

import tempfile
from pathlib import Path

from ..steps import media_placeholders as mp

FIX = "vllm-media-placeholders"


def reproduce():
    """The chat route (OpenAIServingChat, vLLM's renderer and LLaVA's processor) and vLLM's render of a
    tokenized prompt, with the fix off; the bug shows when a prompt holds more placeholders than images
    bound and is accepted."""
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-media-") as work:
        chat = mp.VllmChat(mp.write_processor(Path(work) / "processor"))
        with mp.fix_off(FIX):
            seen = chat.render(mp.conversation(1, mp.SEED_TEXTS))
            tokens = chat.render_tokens(mp.TYPED_PROMPT, 1)
    chat_shows = "error" in seen or seen["placeholders"] > seen["items"]
    tokens_show = "error" not in tokens and len(tokens["images"]) < mp.TYPED_PROMPT.count(mp.PLACEHOLDER)
    return chat_shows or tokens_show, (
        f"stock vLLM chat route, 1 structured image and two literal {mp.PLACEHOLDER}: " + (seen.get("error") or (
            f"{seen['placeholders']} placeholder(s) in the prompt, {seen['items']} image(s) bound, "
            f"{seen['image_tokens']} image token(s)"))
        + f"; tokenized prompt with 2 {mp.PLACEHOLDER} and 1 image: "
        + (tokens.get("error") or f"accepted, the image bound at (offset, length) {tokens['images']}"))
