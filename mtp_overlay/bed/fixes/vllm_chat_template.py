"""vllm-chat-template: stock vLLM renders a chat template path handed to OnlineRenderer as the template."""

import inspect
import tempfile
from pathlib import Path

from ..steps import vllm_serving as vs


def reproduce():
    """Build OnlineRenderer through its stock ``__init__`` (never the hooked one) with a template file,
    on a tiny local model, and render a chat whose user turn carries an ``<image>`` placeholder.

    The bug shows when the prompt is not the file's template applied (stock: the path itself).
    """
    import asyncio

    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer

    vs.offline_environment()
    with tempfile.TemporaryDirectory(prefix="mtp-overlay-chat-template-") as work:
        model = vs.write_tiny_model(Path(work) / "model", multimodal=False)
        template = Path(work) / "chat.jinja"
        template.write_text(vs.FILE_TEMPLATE)
        server = vs.Server(ModelConfig(model=str(model)))
        renderer = OnlineRenderer.__new__(OnlineRenderer)
        stock_init = inspect.unwrap(vars(OnlineRenderer)["__init__"])
        stock_init(renderer, server.model_config, server.renderer, request_logger=None,
                   chat_template=str(template), chat_template_content_format="auto")
        request = ChatCompletionRequest(model=vs.SERVED_NAME, messages=vs.image_conversation(multimodal=False))
        _, (engine_input,) = asyncio.run(renderer.render_chat(request))
        prompt = engine_input["prompt"].replace(work, "<tmp>")
    shows = "<image>" not in prompt
    return shows, (
        f"stock OnlineRenderer(chat_template=<template file>) renders a chat with an <image> placeholder "
        f"as {prompt!r}" + (": the path, the placeholder lost" if shows else ": the file's template applied")
    )
