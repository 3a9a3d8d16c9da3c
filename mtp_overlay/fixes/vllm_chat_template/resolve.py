"""What `vllm serve` does before it builds its chat consumers, done inside their constructors.

Loaded on the first hooked construction, never by ``import mtp_overlay``. Three steps, all before the
upstream constructor runs, so bad input raises with nothing built:

1. ``chat_template``: a path (str or os.PathLike) becomes the file's text through vLLM's own
   ``load_chat_template``, as the CLI's ``load_chat_template(args.chat_template)``; Jinja text passes
   through it unchanged.
2. ``default_chat_template_kwargs``: the legacy spelling ``chat_template_kwargs`` is renamed to it;
   when both are given the native one wins (OverlayWarning); absent is ``{}``.
3. One server, one value: consumers built on the same vLLM renderer share the template and the kwargs
   (see `ServerDefaults`).
"""

import importlib
import inspect
import os
import threading
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path

from ...contract import OverlayWarning

NATIVE, LEGACY = "default_chat_template_kwargs", "chat_template_kwargs"
LOADER_MODULES = ("vllm.renderers.chat_utils", "vllm.entrypoints.chat_utils")  # vLLM 0.33.0, 0.25.1


def vllm_loader():
    """vLLM's ``load_chat_template`` (the function its CLI calls), or None when no module has it."""
    for name in LOADER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        loader = getattr(module, "load_chat_template", None)
        if loader is not None:
            return loader
    return None


def _brief(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_template(value, consumer):
    """The template text ``value`` stands for, as `vllm serve` resolves ``--chat-template``.

    A str goes to vLLM's loader as it is (a readable file is read, Jinja text comes back unchanged,
    a bare name is looked up among vLLM's built-in templates); an os.PathLike is always a file. What
    the loader cannot read is a ValueError naming ``chat_template``, chained to the loader's error.
    """
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
        return vllm_loader()(source)
    except UnicodeDecodeError as exc:
        reason = f"its bytes are not {exc.encoding} text ({exc.reason} at byte {exc.start})"
        raise ValueError(_load_failure(consumer, value, reason)) from exc
    except (OSError, ValueError, VLLMValidationError) as exc:
        raise ValueError(_load_failure(consumer, value, f"{type(exc).__name__}: {exc}")) from exc


def _load_failure(consumer, value, reason):
    return (
        f"{consumer}: chat_template={value!r} cannot be loaded: {reason}; expected Jinja text or the path "
        "of a readable UTF-8 template file"
    )


def template_kwargs(native, legacy, consumer):
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
    value is refused: two templates on one server is the bug, not a choice to honour silently.
    Construction holds ``lock``, so resolving, building and recording are one step per consumer.
    """

    def __init__(self):
        self.lock = threading.RLock()
        self._servers = weakref.WeakKeyDictionary()  # renderer -> {"chat_template"|NATIVE: (value, consumer)}

    def _entry(self, renderer, create=False):
        """{name: (value, consumer that fixed it)} of the server on ``renderer``: None when there is
        none (or, ``renderer`` not weakly referenceable, e.g. None, when there can be none)."""
        try:
            return self._servers.setdefault(renderer, {}) if create else self._servers.get(renderer)
        except TypeError:
            return None

    def resolve(self, renderer, consumer, template, kwargs):
        """The (template, kwargs) ``consumer`` must be built with; None means "not given"."""
        entry = self._entry(renderer) or {}
        resolved = []
        for name, value, default in (("chat_template", template, None), (NATIVE, kwargs, {})):
            if name not in entry:
                resolved.append(default if value is None else value)
                continue
            fixed, owner = entry[name]
            if value is not None and value != fixed:
                raise ValueError(
                    f"{consumer}: {name}={_brief(value)} differs from {_brief(fixed)}, which {owner} was "
                    f"built with on the same vLLM renderer; one server renders every route with one "
                    f"value, as `vllm serve` does: pass the same {name} to each consumer, or None to inherit it"
                )
            resolved.append(fixed)
        return tuple(resolved)

    def commit(self, renderer, consumer, template, kwargs):
        """Record the values a consumer was built with, unless its server has them already."""
        entry = self._entry(renderer, create=True)
        if entry is not None:
            entry.setdefault("chat_template", (template, consumer))
            entry.setdefault(NATIVE, (kwargs, consumer))


SERVERS = ServerDefaults()


def server_renderer(bound, parameter):
    """The vLLM renderer a consumer's server is keyed by: its ``renderer`` argument, or its
    ``online_renderer``'s renderer."""
    value = bound.arguments.get(parameter)
    return value if parameter == "renderer" else getattr(value, "renderer", None)


def construct(wrapped, instance, args, kwargs, parameter):
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
        SERVERS.commit(renderer, consumer, template, defaults)
    return result
