"""vLLM's OpenAI-server consumers on a CPU machine, built directly or the way `vllm serve` builds them.

What is real: a tiny LLaVA written locally (config, WordLevel ``tokenizer.json`` with its own chat
template, CLIP image processor; no weights, no hub; a tiny Llama for vLLM 0.25.1), vLLM's ModelConfig /
VllmConfig, the HfRenderer
with LLaVA's multimodal processor, InputProcessor, OnlineRenderer, OnlineDerenderer,
ServingTokenization, OpenAIServingChat, OpenAIServingResponses, vLLM's own ``make_arg_parser`` and
``init_app_state`` (the state `vllm serve` builds), the chat route's and ``/tokenize``'s renders.

The stand-ins, both for what needs a GPU:
- `EngineClientStandIn` for ``AsyncLLM`` (its engine core needs a GPU): it carries the real config,
  renderer and input processor, which is all the consumers' constructors and renders read.
- `parser_device_type`: the CUDA build on a CPU machine runs on ``UnspecifiedPlatform``, whose device
  type is empty, and vLLM's parser computes its defaults by building ``DeviceConfig("auto")``, which
  refuses that; the platform names the rank's device type while the parser is built, nothing else.

Works on the pinned vLLM (0.33) and 0.25.1 (where the server state lives in ``entrypoints/openai/api_server.py``).
"""

import asyncio
import base64
import contextlib
import importlib
import io
import json
import os
from pathlib import Path

from ..runtime.device import rank_device

SERVED_NAME = "tiny-llava"
WORDS = ("<unk>", "<s>", "</s>", "<image>", "user", "assistant", ":", "what", "is", "in", "this", "picture", "?",
         "/no_think", "model-default")
# The model's own template (tokenizer_config.json): what a server without --chat-template renders with.
MODEL_TEMPLATE = "model-default {% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
# The template file an RL framework passes: a thinking switch read from the default template kwargs.
FILE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% if enable_thinking is defined and not enable_thinking %}"
    " /no_think{% endif %}{% endif %}"
)
IMAGE_SIDE = 28  # CLIP image of 28x28 in patches of 14: 4 image tokens per <image>

# (module, class) of each consumer, by the name the tests use
CONSUMERS = {
    "OnlineRenderer": ("vllm.renderers.online_renderer", "OnlineRenderer"),
    "OnlineDerenderer": ("vllm.renderers.online_derenderer", "OnlineDerenderer"),
    "ServingTokenization": ("vllm.entrypoints.serve.tokenize.serving", "ServingTokenization"),
    "OpenAIServingChat": ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat"),
    "OpenAIServingResponses": ("vllm.entrypoints.openai.responses.serving", "OpenAIServingResponses"),
}


def write_tiny_model(folder, multimodal=True):
    """A model folder vLLM can render for, returned: a tiny LLaVA (config, tokenizer, CLIP image
    processor), or with ``multimodal=False`` the same tokenizer on a tiny Llama, whose conversations
    carry their ``<image>`` marker as text (vLLM 0.25.1's LLaVA module does not import on
    transformers 5.20: it asks for PixtralRotaryEmbedding, since renamed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<image>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "chat_template": MODEL_TEMPLATE,
        },
        "config.json": {
            "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "torch_dtype": "float32",
            "image_token_index": WORDS.index("<image>"), "vision_feature_select_strategy": "default",
            "vision_feature_layer": -1, "projector_hidden_act": "gelu",
            "text_config": {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
                            "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
                            "vocab_size": len(WORDS), "max_position_embeddings": 256},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                              "num_attention_heads": 2, "num_hidden_layers": 1, "image_size": IMAGE_SIDE,
                              "patch_size": 14, "projection_dim": 16},
        },
        "preprocessor_config.json": {
            "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": IMAGE_SIDE},
            "crop_size": {"height": IMAGE_SIDE, "width": IMAGE_SIDE}, "do_resize": True, "do_center_crop": True,
            "do_normalize": True, "do_rescale": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
        },
        "processor_config.json": {
            "processor_class": "LlavaProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
            "image_token": "<image>", "num_additional_image_tokens": 1,
        },
    }
    if not multimodal:
        files = {"tokenizer_config.json": files["tokenizer_config.json"],
                 "config.json": {"architectures": ["LlamaForCausalLM"], **files["config.json"]["text_config"]}}
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    return folder


def image_url():
    """A small PNG as a data URL (nothing is fetched)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_conversation(multimodal=True):
    """One user turn: an image and a question (the chat parser puts the image's ``<image>`` placeholder
    before the text), or for a text-only model the same turn with the placeholder written in."""
    if not multimodal:
        return [{"role": "user", "content": "<image>\nwhat is in this picture ?"}]
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url()}},
        {"type": "text", "text": "what is in this picture ?"},
    ]}]


def text_conversation():
    return [{"role": "user", "content": "what is in this picture ?"}]


class EngineClientStandIn:
    """Stand-in for vLLM's AsyncLLM engine client (its engine core needs a GPU).

    Carries the real VllmConfig, ModelConfig, renderer and InputProcessor: what the servings'
    constructors and the chat route's render read. Generation is never asked for.
    """

    errored = False
    dead_error = RuntimeError("the stand-in engine client runs no engine")

    def __init__(self, vllm_config, renderer):
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config, self.model_config, self.renderer = vllm_config, vllm_config.model_config, renderer
        self.input_processor = InputProcessor(vllm_config, renderer)

    def check_admission(self, n=1, request_id=None):
        """Every request is admitted: nothing queues on a stand-in."""


class Server:
    """One server's shared objects: configs, the vLLM renderer, the engine client and model list."""

    def __init__(self, model_config):
        from vllm.config import DeviceConfig, VllmConfig
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers import renderer_from_config

        self.model_config = model_config
        self.vllm_config = VllmConfig(model_config=model_config,
                                      device_config=DeviceConfig(device=rank_device().type))
        self.renderer = renderer_from_config(self.vllm_config)
        self.engine_client = EngineClientStandIn(self.vllm_config, self.renderer)
        self.models = OpenAIServingModels(
            self.engine_client, [BaseModelPath(name=SERVED_NAME, model_path=model_config.model)]
        )

    @classmethod
    def for_model(cls, model_dir):
        from vllm.config import ModelConfig

        return cls(ModelConfig(model=str(model_dir)))

    def build(self, name, online_renderer=None, **kwargs):
        """Construct consumer ``name`` directly, as an in-process RL server does; ``kwargs`` go as given."""
        module, class_name = CONSUMERS[name]
        owner = getattr(importlib.import_module(module), class_name)
        kwargs.setdefault("chat_template_content_format", "auto")
        if name in ("OnlineRenderer", "OnlineDerenderer"):
            return owner(self.model_config, self.renderer, request_logger=None, **kwargs)
        if name == "ServingTokenization":
            return owner(self.models, online_renderer, request_logger=None, **kwargs)
        if name == "OpenAIServingChat":
            return owner(self.engine_client, self.models, "assistant", online_renderer=online_renderer,
                         request_logger=None, **kwargs)
        return owner(self.engine_client, self.models, online_renderer, request_logger=None, **kwargs)

    def build_all(self, per_consumer=None, **kwargs):
        """Every consumer, in the order `vllm serve` builds them; ``per_consumer[name]`` adds to ``kwargs``."""
        per_consumer = per_consumer or {}
        built = {}
        for name in CONSUMERS:
            online = built.get("OnlineRenderer")
            built[name] = self.build(name, online_renderer=online, **{**kwargs, **per_consumer.get(name, {})})
        return built


def _result(response):
    if hasattr(response, "error"):  # vLLM's ErrorResponse
        raise RuntimeError(f"vLLM answered an error: {response.error}")
    return response


def chat_render(serving_chat, messages, **request):
    """The chat route's render (``OpenAIServingChat.render_chat_request``): (prompt text, token ids, placeholders)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    chat = ChatCompletionRequest(model=SERVED_NAME, messages=messages, **request)
    _, (engine_input,) = _result(asyncio.run(serving_chat.render_chat_request(chat)))
    placeholders = {
        modality: [(p.offset, p.length) for p in ranges]
        for modality, ranges in (engine_input.get("mm_placeholders") or {}).items()
    }
    return engine_input.get("prompt"), list(engine_input["prompt_token_ids"]), placeholders


def tokenize_render(serving_tokenization, messages, **request):
    """``/tokenize`` of a chat (``ServingTokenization.create_tokenize``): the token ids."""
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    tokenize = TokenizeChatRequest(model=SERVED_NAME, messages=messages, **request)
    return list(_result(asyncio.run(serving_tokenization.create_tokenize(tokenize, None))).tokens)


@contextlib.contextmanager
def parser_device_type():
    """Stand-in: the platform names the bed's device type (`device.rank_device`) while vLLM's argument parser is built (see module doc)."""
    from vllm.platforms import current_platform

    if current_platform.device_type:
        yield
        return
    current_platform.device_type = rank_device().type
    try:
        yield
    finally:
        del current_platform.device_type


def _first(*candidates):
    """The first ``(module, attribute)`` that exists: the pinned vLLM's (0.33) location, then 0.25.1's."""
    for module, attribute in candidates:
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ModuleNotFoundError, AttributeError):
            continue
    raise ImportError(f"none of {candidates} exists in this vLLM")


def cli_args(argv):
    """``argv`` parsed by vLLM's own `vllm serve` parser and checked by its own validation."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser = _first(("vllm.entrypoints.common.cli_args", "make_arg_parser"),
                             ("vllm.entrypoints.openai.cli_args", "make_arg_parser"))
    validate = _first(("vllm.entrypoints.common.cli_args", "validate_parsed_serve_args"),
                      ("vllm.entrypoints.openai.cli_args", "validate_parsed_serve_args"))
    with parser_device_type():
        parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(argv)
    validate(args)
    return args


def cli_state(argv):
    """What `vllm serve ARGV` builds: its engine args, model config, then vLLM's own ``init_app_state``
    (the stand-in engine client in place of AsyncLLM). Returns (server, the app state)."""
    from starlette.datastructures import State
    from vllm.engine.arg_utils import AsyncEngineArgs

    init_app_state = _first(("vllm.entrypoints.launchers.api_server.app_state", "init_app_state"),
                            ("vllm.entrypoints.openai.api_server", "init_app_state"))
    args = cli_args(argv)
    server = Server(AsyncEngineArgs.from_cli_args(args).create_model_config())
    state = State()
    asyncio.run(init_app_state(server.engine_client, state, args, supported_tasks=("generate",)))
    return server, state


def offline_environment():
    """Keep Hugging Face libraries off the network (the model folder is local)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
