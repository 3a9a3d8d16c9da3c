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
(OpenAIServingChatBatch, CohereServingChatV2) go through their parent's. Each construction reads the
template file anew, as each `vllm serve` start does, and a server's consumers can be rebuilt on a
live engine with other values once the old ones are gone (`reset` when they are still referenced).
"""

from ...calls import original
from ...contract import Marker, Verdict, defined_in, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

# target role -> (the consumer class its module defines, the parameter through which that class
# reaches its server's vLLM renderer); AnthropicServingMessages is OpenAIServingChat's subclass, but
# vLLM 0.25.1 reads its own chat_template argument after super().__init__
CONSUMERS = {
    "online_renderer": ("OnlineRenderer", "renderer"),
    "online_derenderer": ("OnlineDerenderer", "renderer"),
    "tokenization": ("ServingTokenization", "online_renderer"),
    "chat": ("OpenAIServingChat", "online_renderer"),
    "responses": ("OpenAIServingResponses", "online_renderer"),
    "anthropic": ("AnthropicServingMessages", "online_renderer"),
}
LOADER = "load_chat_template"
PARAMETERS = ("chat_template", "default_chat_template_kwargs")
# where a vLLM carrying the fix's source patch keeps its servers' values (0.33, 0.25)
PATCHED_SERVERS = ("vllm.renderers.chat_utils.chat_template", "vllm.entrypoints.chat_utils")


def reset(renderer: "Any" = None) -> None:
    """Forget the chat template and template kwargs fixed for the server on ``renderer`` (a vLLM
    renderer: ``engine_client.renderer``, what its consumers share), or for every server when None:
    the next consumer built on it fixes new ones.

    A rebuild needs it only while the old consumers are still referenced (kept in an app state, a
    list, a traceback): once they are garbage, a rebuild with other values just works. The consumers
    already built keep what they were built with. Resets the runtime hook and, where vLLM carries the
    source patch (patches/vllm-chat-template/), the patched vLLM's own record; imports nothing.
    """
    import sys

    hooked = sys.modules.get(f"{__name__}.resolve")
    if hooked is not None:
        hooked.SERVERS.reset(renderer)
    for name in PATCHED_SERVERS:
        patched = getattr(sys.modules.get(name), "SERVER_CHAT_TEMPLATES", None)
        if patched is not None:
            patched.reset(renderer)


def consumer(module: "ModuleType", role: str) -> "tuple[type, str] | str":
    """``(class, renderer parameter)`` of the consumer of target ``role`` in ``module``, or a drift reason (str)."""
    import inspect

    class_name, parameter = CONSUMERS[role]
    owner = defined_in(module, [class_name])
    if not isinstance(owner, type) or "__init__" not in vars(owner):
        return f"{module.__name__} has no class {class_name} with its own __init__"
    found = inspect.signature(original(vars(owner)["__init__"])).parameters
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    missing = [name for name in (parameter, *PARAMETERS) if name not in found or found[name].kind not in keyword]
    if missing:
        return f"{class_name}.__init__{tuple(found)} takes no keyword {', '.join(missing)}"
    return owner, parameter


class VllmChatTemplateFix(Fix):
    declaration = DECLARATION  # one target per consumer class (CONSUMERS): its __init__

    def probe(self, module: "ModuleType") -> Verdict:
        from .resolve import LOADER_MODULES, UNCACHED_LOADER, vllm_loader

        found = consumer(module, self.role_of(module))
        if isinstance(found, str):
            return drifted(found)
        owner, _ = found
        if vllm_loader() is None:
            return drifted(f"none of {', '.join(LOADER_MODULES)} defines {LOADER} next to its uncached "
                           f"body {UNCACHED_LOADER}")
        init = vars(owner)["__init__"]
        if Marker(module.__name__, f"{owner.__name__}.__init__", LOADER).in_function(init):
            return redundant(f"{owner.__name__}.__init__ already calls {LOADER} (upstream, or patched on disk)")
        return needed(
            f"{owner.__name__}.__init__ stores chat_template as given: a path would be rendered as the template"
        )

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        from .resolve import construct

        found = consumer(module, self.role_of(module))  # probed first: a consumer of known shape
        assert not isinstance(found, str), found
        owner, parameter = found

        def server_constructor(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                               kwargs: "dict[str, Any]") -> "Any":
            return construct(wrapped, instance, args, kwargs, parameter)

        yield owner, "__init__", server_constructor


FIX = VllmChatTemplateFix()
