"""What `vllm serve` does before it builds its chat consumers, done inside their constructors.

Loaded on the first hooked construction, never by ``import mtp_overlay``. Three steps, all before the
upstream constructor runs, so bad input raises with nothing built:

1. ``chat_template``: a path (str or os.PathLike) becomes the file's text through vLLM's own loader,
   as the CLI's ``load_chat_template(args.chat_template)``, read at each construction: `vllm serve`
   reads the file at each start, while ``load_chat_template`` is an ``lru_cache`` by path that would
   serve a rewritten file's old text to the next server built in the same process. Jinja text
   passes through it unchanged.
2. ``default_chat_template_kwargs``: the legacy spelling ``chat_template_kwargs`` is renamed to it;
   when both are given the native one wins (OverlayWarning); absent is ``{}``.
3. One server, one value: consumers built on the same vLLM renderer share the template and the kwargs
   (see `ServerDefaults`), until they are gone and the server is rebuilt.
"""

import gc
import importlib
import inspect
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path

from ...contract import OverlayWarning

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

NATIVE, LEGACY = "default_chat_template_kwargs", "chat_template_kwargs"
LOADER_MODULES = ("vllm.renderers.chat_utils", "vllm.entrypoints.chat_utils")  # vLLM 0.33.0, 0.25.1
UNCACHED_LOADER = "_load_chat_template"


def vllm_loader() -> "Callable[[str | Path | None], str | None] | None":
    """vLLM's chat-template loader without its cache: ``_load_chat_template``, the body of the
    ``load_chat_template`` its CLI calls (``_cached_load_chat_template = lru_cache(_load_chat_template)``:
    vLLM 0.33.0 ``renderers/chat_utils/chat_template.py:56,104``, 0.25.1 ``entrypoints/chat_utils.py:1284,1332``),
    from the module that defines it; None when no module has both."""
    for name in LOADER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        loader = getattr(module, "load_chat_template", None)
        if loader is not None:
            home = sys.modules.get(getattr(loader, "__module__", ""), module)
            uncached: "Any" = getattr(home, UNCACHED_LOADER, None)
            return uncached if callable(uncached) else None
    return None


def _brief(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_template(value: object, consumer: str) -> "str | None":
    """The template text ``value`` stands for, as `vllm serve` resolves ``--chat-template``.

    A str goes to vLLM's loader as it is (a readable file is read, Jinja text comes back unchanged,
    a bare name is looked up among vLLM's built-in templates); an os.PathLike is always a file. What
    the loader cannot read is a ValueError naming ``chat_template``, chained to the loader's error.
    """
    source: "str | Path | None"
    if value is None or isinstance(value, str):
        source = value
    elif isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
        source = Path(os.fspath(value))
    else:
        raise TypeError(
            f"{consumer}: chat_template must be Jinja text (str), the path of a template file (str or "
            f"os.PathLike[str]) or None, got {type(value).__name__}: {_brief(value)}"
        )
    from vllm.exceptions import VLLMValidationError  # no ValueError from vLLM 0.27 on

    try:
        return vllm_loader()(source)  # type: ignore[misc]  # found: vLLM imported just above
    except UnicodeDecodeError as exc:
        reason = f"its bytes are not {exc.encoding} text ({exc.reason} at byte {exc.start})"
        raise ValueError(_load_failure(consumer, value, reason)) from exc
    except (OSError, ValueError, VLLMValidationError) as exc:
        raise ValueError(_load_failure(consumer, value, f"{type(exc).__name__}: {exc}")) from exc


def _load_failure(consumer: str, value: object, reason: str) -> str:
    return (
        f"{consumer}: chat_template={value!r} cannot be loaded: {reason}; expected Jinja text or the path "
        "of a readable UTF-8 template file"
    )


def template_kwargs(native: object, legacy: object, consumer: str) -> "dict[str, Any] | None":
    """The default template kwargs given as ``default_chat_template_kwargs`` (``native``) or its legacy
    spelling ``chat_template_kwargs``, as a new dict; None when neither carries a value."""
    name, value = NATIVE, native
    if value is None:
        name, value = LEGACY, legacy
    elif legacy is not None:
        warnings.warn(OverlayWarning(
            f"mtp-overlay fix 'vllm-chat-template': {consumer}: both {NATIVE}={_brief(value)} and its legacy spelling {LEGACY}={_brief(legacy)} "
            f"were given; {NATIVE} wins (drop {LEGACY})"), stacklevel=4)
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise TypeError(
            f"{consumer}: {name} must be a mapping of template variable names (str) to values, or None; "
            f"got {type(value).__name__}: {_brief(value)}"
        )
    return dict(value)


class _Server:
    """One server's values ({name: (value, consumer that fixed it)}) and its live consumers."""

    __slots__ = ("values", "consumers")

    def __init__(self) -> None:
        self.values: "dict[str, tuple[Any, str]]" = {}
        self.consumers: "weakref.WeakSet[Any]" = weakref.WeakSet()


class ServerDefaults:
    """The chat template and default template kwargs of each server, keyed by its vLLM renderer.

    `vllm serve` hands every consumer one resolved template and one kwargs dict. In vLLM's object
    graph the renderer (``engine_client.renderer``, or ``renderer_from_config`` in the render-only
    server) is what every consumer of one server holds: OnlineRenderer and OnlineDerenderer take it,
    ServingTokenization, OpenAIServingChat and OpenAIServingResponses reach it through their
    ``online_renderer``, and it owns the tokenizer the template is applied with. The model config
    is shared too but may back several renderers; render-only servers have no engine client.

    The first consumer built on a renderer fixes its values (a value it was not given: the model's
    own template, ``{}``). A later consumer that is given none inherits them; one given a different
    value is refused while any consumer built with the old ones is alive: two templates on one
    server is the bug, not a choice to honour silently. Once they are all gone the server is gone,
    and the next consumer on that renderer (a server rebuilt in-process on a live engine, as RL
    frameworks do between runs) fixes new values, as a new `vllm serve` would. "Gone" is known by
    weak references; before refusing, the garbage collector runs once, since consumers hold
    reference cycles (OnlineDerenderer's bound methods in ``make_async``) only it frees. `reset`
    forgets a server whose old consumers are still referenced somewhere.
    Construction holds ``lock``, so resolving, building and recording are one step per consumer.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._servers: "weakref.WeakKeyDictionary[Any, _Server]" = weakref.WeakKeyDictionary()  # renderer -> _Server

    def _server(self, renderer: "Any", create: bool = False) -> "_Server | None":
        """The live server on ``renderer`` (a new one with ``create``), or None (``renderer`` not weakly
        referenceable, e.g. None: there can be none)."""
        try:
            server = self._servers.get(renderer)
            if create and (server is None or not server.consumers):
                server = self._servers[renderer] = _Server()
        except TypeError:
            return None
        return server if server is not None and (create or server.consumers) else None

    def resolve(self, renderer: "Any", consumer: str, template: "str | None",
                kwargs: "dict[str, Any] | None") -> "tuple[Any, ...]":
        """The (template, kwargs) ``consumer`` must be built with; None means "not given"."""
        server = self._server(renderer)
        if server is not None and self._conflict(server, template, kwargs):
            gc.collect()  # consumers hold reference cycles: only the collector knows whether they are gone
            server = self._server(renderer)
        fixed = server.values if server is not None else {}
        resolved: "list[Any]" = []
        for name, value, default in (("chat_template", template, None), (NATIVE, kwargs, {})):
            if name not in fixed:
                resolved.append(default if value is None else value)
                continue
            was, owner = fixed[name]
            if value is not None and value != was:
                assert server is not None  # ``fixed`` holds its values
                alive = ", ".join(sorted(type(each).__name__ for each in server.consumers))
                raise ValueError(
                    f"{consumer}: {name}={_brief(value)} differs from {_brief(was)}, which {owner} was "
                    f"built with on the same vLLM renderer, and consumers built with it are alive ({alive}); "
                    f"one server renders every route with one value, as `vllm serve` does: pass the same "
                    f"{name} to each consumer, or None to inherit it; to rebuild the server with another "
                    f"value, drop its old consumers first, or {RESET}"
                )
            resolved.append(was)
        return tuple(resolved)

    @staticmethod
    def _conflict(server: _Server, template: "str | None", kwargs: "dict[str, Any] | None") -> bool:
        given = {"chat_template": template, NATIVE: kwargs}
        return any(given[name] is not None and given[name] != was for name, (was, _) in server.values.items())

    def commit(self, renderer: "Any", instance: object, template: "str | None",
               kwargs: "dict[str, Any] | None") -> None:
        """Record the values consumer ``instance`` was built with, unless its server has them already."""
        server = self._server(renderer, create=True)
        if server is None:
            return
        consumer = type(instance).__name__
        server.values.setdefault("chat_template", (template, consumer))
        server.values.setdefault(NATIVE, (kwargs, consumer))
        try:
            server.consumers.add(instance)
        except TypeError:  # not weakly referenceable: it cannot keep the server alive
            pass

    def reset(self, renderer: "Any" = None) -> None:
        """Forget the values of the server on ``renderer`` (of every server when None)."""
        with self.lock:
            if renderer is None:
                self._servers.clear()
                return
            try:
                self._servers.pop(renderer, None)
            except TypeError:
                pass


RESET = "call mtp_overlay.fixes.vllm_chat_template.reset(renderer) to forget its values"
SERVERS = ServerDefaults()


def server_renderer(bound: "inspect.BoundArguments", parameter: str) -> "Any":
    """The vLLM renderer a consumer's server is keyed by: its ``renderer`` argument, or its
    ``online_renderer``'s renderer."""
    value = bound.arguments.get(parameter)
    return value if parameter == "renderer" else getattr(value, "renderer", None)


def construct(wrapped: "Callable[..., Any]", instance: object, args: "tuple[Any, ...]", kwargs: "dict[str, Any]",
              parameter: str) -> "Any":
    """Build one consumer (``wrapped`` is its bound ``__init__``) the way `vllm serve` would."""
    consumer = type(instance).__name__
    kwargs = dict(kwargs)
    legacy = kwargs.pop(LEGACY, None)
    try:
        bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # the constructor's own error for a call it cannot take
    if "chat_template" not in kwargs:
        return wrapped(*args, **kwargs)  # a required keyword: the constructor's own TypeError
    renderer = server_renderer(bound, parameter)
    template = load_template(kwargs["chat_template"], consumer)
    given = template_kwargs(kwargs.get(NATIVE), legacy, consumer)
    with SERVERS.lock:
        template, defaults = SERVERS.resolve(renderer, consumer, template, given)
        kwargs["chat_template"], kwargs[NATIVE] = template, defaults
        result = wrapped(*args, **kwargs)
        SERVERS.commit(renderer, instance, template, defaults)
    return result
