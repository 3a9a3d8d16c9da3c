"""vllm-chat-template: a vLLM server built in-process gets the chat template and template kwargs `vllm serve` would.

`vllm serve` resolves ``--chat-template`` with ``load_chat_template`` and ``--default-chat-template-kwargs``
(``resolve_default_chat_template_kwargs`` in vLLM 0.33.0) before it builds OnlineRenderer,
OnlineDerenderer, ServingTokenization and the chat and Responses servings, and hands every one the
same values. The classes store ``chat_template`` as given. RL frameworks that build the server
in-process (NeMo-RL PR #3494, ``vllm_worker_async.py``) pass the path: it is rendered as the template
text, every multimodal placeholder is lost, and the consumers each keep their own kwargs, so
``/tokenize`` and ``/v1/chat/completions`` render one conversation differently. No vLLM release
resolves the template in the classes.

The hook wraps each class's ``__init__`` (`resolve.construct`); OpenAIServingChat's other subclasses
(OpenAIServingChatBatch, CohereServingChatV2) go through their parent's.
"""

from ...contract import Fix, Marker, Provenance, defined_in, drifted, needed, redundant

# the consumer class each target module defines (registry order), and the parameter through which it
# reaches its server's vLLM renderer; AnthropicServingMessages is OpenAIServingChat's subclass, but
# vLLM 0.25.1 reads its own chat_template argument after super().__init__
CONSUMERS = {
    "OnlineRenderer": "renderer",
    "OnlineDerenderer": "renderer",
    "ServingTokenization": "online_renderer",
    "OpenAIServingChat": "online_renderer",
    "OpenAIServingResponses": "online_renderer",
    "AnthropicServingMessages": "online_renderer",
}
LOADER = "load_chat_template"
PARAMETERS = ("chat_template", "default_chat_template_kwargs")


def consumer(module, class_name):
    """``(class, renderer parameter)`` of consumer ``class_name`` in ``module``, or a drift reason (str)."""
    import inspect

    owner, parameter = defined_in(module, [class_name]), CONSUMERS[class_name]
    if not isinstance(owner, type) or "__init__" not in vars(owner):
        return f"{module.__name__} has no class {class_name} with its own __init__"
    found = inspect.signature(inspect.unwrap(vars(owner)["__init__"])).parameters
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    missing = [name for name in (parameter, *PARAMETERS) if name not in found or found[name].kind not in keyword]
    if missing:
        return f"{class_name}.__init__{tuple(found)} takes no keyword {', '.join(missing)}"
    return owner, parameter


class VllmChatTemplateFix(Fix):
    name = "vllm-chat-template"
    summary = "In-process vLLM servers load a chat template path and share one template and kwargs, as `vllm serve`."
    distribution = "vllm"
    provenance = Provenance(
        origin="NeMo-RL PR #3494 (vllm_worker_async.py builds vLLM's OpenAI server in-process)",
        upstream_fix=None,
        first_fixed_release=None,
    )
    # on disk, the patched (or upstream-fixed) constructor loads the template itself
    marker = Marker("vllm.renderers.online_renderer", "OnlineRenderer.__init__", LOADER)
    families = {"0.25": ">=0.25.1,<0.26", "0.33": ">=0.33.0,<0.34"}

    def consumer_of(self, module):
        """The consumer class name target ``module`` defines (CONSUMERS is in the targets' order)."""
        return list(CONSUMERS)[self.targets.index(module.__name__)]

    def probe(self, module):
        from .resolve import LOADER_MODULES, vllm_loader

        found = consumer(module, self.consumer_of(module))
        if isinstance(found, str):
            return drifted(found)
        owner, _ = found
        if vllm_loader() is None:
            return drifted(f"none of {', '.join(LOADER_MODULES)} defines {LOADER}")
        init = vars(owner)["__init__"]
        if Marker(module.__name__, f"{owner.__name__}.__init__", LOADER).in_function(init):
            return redundant(f"{owner.__name__}.__init__ already calls {LOADER} (upstream, or patched on disk)")
        return needed(
            f"{owner.__name__}.__init__ stores chat_template as given: a path would be rendered as the template"
        )

    def wrappers(self, module):
        from .resolve import construct

        owner, parameter = consumer(module, self.consumer_of(module))  # probed first: a consumer of known shape

        def server_constructor(wrapped, instance, args, kwargs):
            return construct(wrapped, instance, args, kwargs, parameter)

        yield owner, "__init__", server_constructor


FIX = VllmChatTemplateFix()
