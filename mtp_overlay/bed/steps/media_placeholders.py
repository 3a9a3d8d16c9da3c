"""A tiny multimodal processor whose chat template applies Nemotron Super Omni's placeholder rule, and
renders of it through transformers' processor and vLLM's chat path: hf-media-placeholders' and
vllm-media-placeholders' test bed.

The template is a stand-in for Nemotron Omni's (which is not on this machine): like it, per message it
counts the structured image items and emits one ``<image>`` per item, unless the message's text already
holds a literal ``<image>``; then the structured count is zeroed and the literal strings become the
placeholders (NeMo-RL PR #3494). `seed_rule_placeholders` states the rule in Python; the tests hold the
template's renders to it. Everything else is real: the tiny LLaVA folder of `vllm_serving` (WordLevel
tokenizer with ``<image>`` as a special token, CLIP image processor, LlavaProcessor), loaded by
``AutoProcessor``, and vLLM's own renderer and chat route on CPU.
"""

import contextlib
import json
from pathlib import Path

from . import vllm_serving as vs

PLACEHOLDER = "<image>"
SEED_TEXTS = ["<image> what is in this <image> picture ?"]  # the seeds' 601-vs-600 rows: two literal, one image
# a tokenized prompt's words, 2 placeholders (the first typed in the question) for 1 image
TYPED_PROMPT = ("user", ":", "what", "is", "<image>", "in", "this", "<image>", "picture", "?")
# Nemotron Omni's rule, written for a tiny model (see the module docstring)
SEED_RULE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} :"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% set ns = namespace(images=0, text='') %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}{% set ns.images = ns.images + 1 %}"
    "{% elif c['type'] == 'text' %}{% set ns.text = ns.text + ' ' + c['text'] %}{% endif %}"
    "{% endfor %}"
    "{% if '<image>' in ns.text %}{% set ns.images = 0 %}{% endif %}"
    "{% for i in range(ns.images) %} <image>{% endfor %}{{ ns.text }}"
    "{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def seed_rule_placeholders(conversation):
    """How many ``<image>`` the seed's rule emits for ``conversation`` (the template's rule in Python)."""
    total = 0
    for message in conversation:
        content = message["content"]
        if isinstance(content, str):
            total += content.count(PLACEHOLDER)
            continue
        text = " ".join(part["text"] for part in content if part["type"] == "text")
        images = sum(part["type"] in ("image", "image_url") for part in content)
        total += text.count(PLACEHOLDER) if PLACEHOLDER in text else images
    return total


def write_processor(folder):
    """The tiny LLaVA folder (tokenizer, image processor, processor config) with the seed's rule as its
    chat template, for both the tokenizer and the processor; returned."""
    folder = vs.write_tiny_model(folder, multimodal=True)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": SEED_RULE_TEMPLATE}))
    (folder / "chat_template.jinja").write_text(SEED_RULE_TEMPLATE)
    return Path(folder)


def load_processor(folder):
    from transformers import AutoProcessor

    vs.offline_environment()
    return AutoProcessor.from_pretrained(str(folder))


def image_part():
    """A structured image item as transformers and vLLM both take it (a data URL: nothing is fetched)."""
    return {"type": "image_url", "image_url": {"url": vs.image_url()}}


def conversation(images, texts):
    """One user message: ``images`` structured image items, then one text part per item of ``texts``."""
    return [{"role": "user", "content": [image_part() for _ in range(images)]
             + [{"type": "text", "text": text} for text in texts]}]


def hf_placeholders(processor, messages):
    """Placeholders in transformers' render: ``<image>`` tokens of the processor's ``apply_chat_template``
    text, tokenized by its tokenizer."""
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids.count(processor.tokenizer.convert_tokens_to_ids(PLACEHOLDER))


class VllmChat:
    """vLLM's chat route (OpenAIServingChat on the real renderer) for the processor folder."""

    def __init__(self, folder):
        vs.offline_environment()
        server = vs.Server.for_model(folder)
        online = server.build("OnlineRenderer", chat_template=None)
        self.chat = server.build("OpenAIServingChat", online_renderer=online, chat_template=None)
        self.renderer = server.renderer
        self.placeholder_id = vs.WORDS.index(PLACEHOLDER)

    def render(self, messages):
        """``{"placeholders": <image> strings in the prompt, "items": images bound, "image_tokens": ...}``,
        or ``{"error": ...}`` when vLLM refuses the request."""
        try:
            prompt, ids, placeholders = vs.chat_render(self.chat, messages)
        except Exception as exc:  # vLLM's refusal is the observation
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"placeholders": prompt.count(PLACEHOLDER), "items": len(placeholders.get("image", [])),
                "image_tokens": ids.count(self.placeholder_id)}

    def render_tokens(self, words, images):
        """A tokenized prompt (the ids of ``words``) with ``images`` images, rendered by vLLM's renderer as
        ``LLM.generate`` passes it: ``{"ids": prompt token ids, "images": [(offset, length) of each image
        bound]}``, or ``{"error": ...}`` when vLLM refuses it."""
        from PIL import Image

        prompt = {"prompt_token_ids": [vs.WORDS.index(word) for word in words],
                  "multi_modal_data": {"image": [Image.new("RGB", (vs.IMAGE_SIDE,) * 2)] * images}}
        try:
            [rendered] = self.renderer.render_cmpl([prompt])
        except Exception as exc:  # vLLM's refusal is the observation
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"ids": list(rendered["prompt_token_ids"]),
                "images": [(p.offset, p.length) for p in rendered["mm_placeholders"].get("image", [])]}


@contextlib.contextmanager
def fix_off(name):
    """Fix ``name`` uninstalled for the block, installed again after unless it was disabled before."""
    from mtp_overlay import registry
    from mtp_overlay.contract import State

    was = registry.lifecycle(name).state()[0]
    registry.uninstall(only=[name])
    try:
        yield
    finally:
        if was != State.DISABLED:
            registry.install(only=[name])
