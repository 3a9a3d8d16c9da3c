"""What vLLM's chat consumers do with the inputs an in-process RL server hands them: every case of the
vllm-chat-template fix, run on the installed vLLM with the fix off (stock) and on, and through the CLI.

`observe` returns plain data (JSON-able; the paths of the work folders and of vLLM written as ``<work>``,
``<public>`` and ``<vllm>``) so that the same observations can come from this process, from another vLLM release in a
subprocess (`observe_in_subprocess`), or from a vLLM carrying the fix's source patch; the tests assert
on them. Real vLLM objects throughout; the stand-ins are those of `vllm_serving`.
"""

import json
import os
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path

from . import vllm_serving as vs

NAME = "vllm-chat-template"
THINKING_OFF = {"enable_thinking": False}
OTHER_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
KWARGS_ATTRIBUTE = {"OpenAIServingResponses": "chat_template_kwargs"}  # the others: default_chat_template_kwargs
CLI_STATE = {  # consumer -> its attribute on the app state `vllm serve` builds
    "OnlineRenderer": "online_renderer",
    "OnlineDerenderer": "online_derenderer",
    "ServingTokenization": "serving_tokenization",
    "OpenAIServingChat": "openai_serving_chat",
    "OpenAIServingResponses": "openai_serving_responses",
}


class BytesPath:
    """An os.PathLike whose path is bytes (vLLM's loader takes only str paths)."""

    def __init__(self, path):
        self.path = os.fsencode(path)

    def __fspath__(self):
        return self.path

    def __repr__(self):
        return f"BytesPath({self.path!r})"


def switch(on):
    """The fix on (installed, or standing down on a patched vLLM) or off."""
    import mtp_overlay

    mtp_overlay.uninstall(only=[NAME])
    if on:
        mtp_overlay.install(only=[NAME])


def error(exc):
    return f"{type(exc).__name__}: {exc}"


def attempt(function, *args, **kwargs):
    """``{"value": ...}``, or ``{"error": "Type: message"}`` when it raises."""
    try:
        return {"value": function(*args, **kwargs)}
    except Exception as exc:
        return {"error": error(exc)}


def described(template):
    """A consumer's template: "FILE" (the template file's text), "OTHER", "MODEL" or its repr."""
    names = {vs.FILE_TEMPLATE: "FILE", OTHER_TEMPLATE: "OTHER", vs.MODEL_TEMPLATE: "MODEL"}
    return names.get(template, repr(template)) if isinstance(template, str) else repr(template)


def consumer_view(consumers):
    """Each consumer's template and default template kwargs as it stores them."""
    kwargs = {name: KWARGS_ATTRIBUTE.get(name, "default_chat_template_kwargs") for name in consumers}
    return {name: [described(each.chat_template), getattr(each, kwargs[name])] for name, each in consumers.items()}


def renders(consumers, multimodal):
    """One image chat and one text chat through the chat route, and the image chat through /tokenize."""
    image, text = vs.image_conversation(multimodal), vs.text_conversation()
    return {
        "chat_image": attempt(vs.chat_render, consumers["OpenAIServingChat"], image),
        "chat_text": attempt(vs.chat_render, consumers["OpenAIServingChat"], text),
        "tokenize_image": attempt(vs.tokenize_render, consumers["ServingTokenization"], image),
    }


def server_case(model_config, per_consumer=None, **kwargs):
    """Build every consumer on a new server; what they store and render, or the construction error."""
    server = vs.Server(model_config)
    multimodal = model_config.is_multimodal_model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            consumers = server.build_all(per_consumer, **kwargs)
        except Exception as exc:
            return {"error": error(exc)}
    raised = [f"{w.category.__name__}({issubclass(w.category, UserWarning)}): {w.message}" for w in caught
              if "chat_template" in str(w.message)]
    return {"consumers": consumer_view(consumers), "warnings": raised, **renders(consumers, multimodal)}


def bad_input_case(model_config, unprivileged=False, **kwargs):
    """OnlineRenderer given a bad input: its error (or what it stored); then, on the same server, a
    valid template file must still be accepted (the failed construction recorded nothing)."""
    server = vs.Server(model_config)

    def build():
        first = attempt(lambda: described(server.build("OnlineRenderer", **kwargs).chat_template))
        after = attempt(lambda: described(server.build("OnlineRenderer", chat_template=OTHER_TEMPLATE).chat_template))
        return {"first": first, "after": after}

    return as_unprivileged(build) if unprivileged else build()


def as_unprivileged(function):
    """``function()`` run as user nobody in a forked child (root reads any file); plain call otherwise."""
    if os.geteuid() != 0:
        return function()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, send the result, leave without cleanup handlers
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            payload = pickle.dumps({"value": function()})
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            payload = pickle.dumps({"error": error(exc)})
        with os.fdopen(write, "wb") as pipe:
            pipe.write(payload)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        result = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    if "error" in result:
        raise RuntimeError(f"unprivileged child failed: {result['error']}")
    return result["value"]


def bad_inputs(work, public):
    """name -> (constructor kwargs, run unprivileged); the files are written under ``work``, the
    unreadable one in ``public``, a folder every user may enter: only the file itself is closed."""
    non_utf8 = work / "latin1.jinja"
    non_utf8.write_bytes("{{ messages }} caf\xe9 au lait".encode("latin-1"))
    unreadable = public / "unreadable.jinja"
    unreadable.write_text(vs.FILE_TEMPLATE)
    unreadable.chmod(0)
    return {
        "directory": ({"chat_template": str(work)}, False),
        "directory_path": ({"chat_template": work}, False),
        "non_utf8": ({"chat_template": str(non_utf8)}, False),
        "unreadable": ({"chat_template": str(unreadable)}, True),
        "missing": ({"chat_template": str(work / "missing.jinja")}, False),
        "missing_path": ({"chat_template": work / "missing.jinja"}, False),
        "bytes_path": ({"chat_template": BytesPath("chat.jinja")}, False),
        "number": ({"chat_template": 7}, False),
        "kwargs_list": ({"chat_template": OTHER_TEMPLATE, "default_chat_template_kwargs": ["enable_thinking"]}, False),
        "kwargs_keys": ({"chat_template": OTHER_TEMPLATE, "chat_template_kwargs": {1: False}}, False),
    }


def cases(model_config, template, work, public):
    """Every in-process construction the fix is about, on a new server each."""
    first_only = {"OnlineRenderer": {"default_chat_template_kwargs": THINKING_OFF}}
    observed = {
        "path_str": server_case(model_config, first_only, chat_template=str(template)),
        "path_obj": server_case(model_config, first_only, chat_template=template),
        "literal": server_case(model_config, first_only, chat_template=vs.FILE_TEMPLATE),
        "legacy": server_case(model_config, chat_template=template, chat_template_kwargs=THINKING_OFF),
        "both": server_case(model_config, chat_template=template, default_chat_template_kwargs=THINKING_OFF,
                            chat_template_kwargs={"enable_thinking": True}),
        "absent": server_case(model_config, chat_template=None),
        "template_conflict": server_case(model_config, {"ServingTokenization": {"chat_template": OTHER_TEMPLATE}},
                                         chat_template=None),
        "kwargs_conflict": server_case(
            model_config, {"OnlineRenderer": {"default_chat_template_kwargs": THINKING_OFF},
                           "OpenAIServingChat": {"default_chat_template_kwargs": {"enable_thinking": True}}},
            chat_template=template),
        "subclasses": subclass_case(model_config, template),
        "reread": reread_case(model_config, work),
        "rebuild": rebuild_case(model_config, template),
    }
    observed["bad"] = {name: bad_input_case(model_config, unprivileged, **kwargs)
                       for name, (kwargs, unprivileged) in bad_inputs(work, public).items()}
    return observed


def reread_case(model_config, work):
    """A server built on a template file, the file rewritten, then a second server (a new engine) built
    on the same path, as an RL framework restarts its in-process server: what each stores and renders."""
    path = work / "rewritten.jinja"
    path.write_text(vs.FILE_TEMPLATE)
    first = server_case(model_config, chat_template=str(path))
    path.write_text(OTHER_TEMPLATE)
    return {"first": first, "second": server_case(model_config, chat_template=str(path))}


def rebuild_case(model_config, template):
    """The consumers rebuilt on one live engine (one vLLM renderer) with another template and kwargs, as
    an RL framework rebuilds its in-process server between runs: after the old ones are dropped, while
    the rebuilt ones are still referenced, and after `reset` of the server. The failed attempt builds
    nothing that stays alive; the old consumers keep what they were built with."""
    import gc

    server = vs.Server(model_config)
    thinking = {"enable_thinking": True}
    gc.disable()  # no automatic collection: only the fix itself can find out that the old consumers are gone
    try:
        old = server.build_all({"OnlineRenderer": {"default_chat_template_kwargs": THINKING_OFF}},
                               chat_template=str(template))
        observed = {"old": consumer_view(old)}
        del old  # OnlineDerenderer stays in a reference cycle: garbage, not yet collected
        rebuilt = attempt(server.build_all, chat_template=OTHER_TEMPLATE, default_chat_template_kwargs=thinking)
    finally:
        gc.enable()
    if "error" in rebuilt:
        return {**observed, "after_drop": rebuilt}
    alive = rebuilt["value"]
    observed["after_drop"] = {"consumers": consumer_view(alive), **renders(alive, model_config.is_multimodal_model)}
    observed["while_alive"] = attempt(lambda: consumer_view(server.build_all(chat_template=str(template))))
    observed["reset"] = attempt(_reset, server.renderer)
    again = attempt(server.build_all, chat_template=str(template))
    observed["after_reset"] = {"consumers": consumer_view(again["value"])} if "value" in again else again
    observed["kept"] = consumer_view(alive)
    return observed


def _reset(renderer):
    from mtp_overlay.fixes.vllm_chat_template import reset

    reset(renderer)


def subclass_case(model_config, template):
    """OpenAIServingChat's subclasses, built directly with a template path: what they store."""
    import importlib

    server = vs.Server(model_config)
    online = server.build("OnlineRenderer", chat_template=str(template))
    found = {}
    for module, class_name in (("vllm.entrypoints.openai.chat_completion.batch_serving", "OpenAIServingChatBatch"),
                               ("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages")):
        owner = getattr(importlib.import_module(module), class_name)
        found[class_name] = attempt(lambda: described(owner(
            server.engine_client, server.models, "assistant", online_renderer=online, request_logger=None,
            chat_template=template, chat_template_content_format="auto").chat_template))
    return found


def cli_case(argv):
    """What `vllm serve ARGV` builds (vLLM's own init_app_state) and renders."""
    server, state = vs.cli_state(argv)
    consumers = {name: getattr(state, attribute) for name, attribute in CLI_STATE.items()}
    return {"consumers": consumer_view(consumers), **renders(consumers, server.model_config.is_multimodal_model)}


def observe(work, stock=True, multimodal=True):
    """Every case with the fix off (``stock``; a vLLM carrying the source patch has no stock) and on,
    on a tiny LLaVA (``multimodal``) or a tiny Llama (see `vllm_serving.write_tiny_model`)."""
    import vllm
    from vllm.config import ModelConfig

    from mtp_overlay import registry
    from mtp_overlay.patching.survey import patched_on_disk

    vs.offline_environment()
    work = Path(work)
    model = vs.write_tiny_model(work / "model", multimodal)
    template = work / "chat.jinja"
    template.write_text(vs.FILE_TEMPLATE)
    model_config = ModelConfig(model=str(model))
    argv = ["--model", str(model), "--served-model-name", vs.SERVED_NAME, "--chat-template", str(template),
            "--default-chat-template-kwargs", json.dumps(THINKING_OFF)]
    observed = {"version": vllm.__version__, "cli": {}}
    public = Path(tempfile.mkdtemp(prefix="mtp-overlay-public-"))
    public.chmod(0o755)
    try:
        for label, on in ((("stock", False),) if stock else ()) + (("fixed", True),):
            switch(on)
            observed["cli"][label] = cli_case(argv)
            observed[label] = cases(model_config, template, work, public)
    finally:
        switch(True)
        shutil.rmtree(public)
    row = registry.check([NAME])[0]  # imports every target: the installed fix has seen them all
    status = registry.status([NAME], patched=patched_on_disk)[0]
    observed["check"] = [row.verdict, row.reason]
    wrapped = [f"{owner.__name__}.{attribute}" for owner, attribute in registry.lifecycle(NAME).wrapped()]
    observed["status"] = {"state": status.state, "patched": status.patched, "wrapped": wrapped}
    text = json.dumps(observed, default=repr)
    for path, name in ((Path(vllm.__file__).parent, "<vllm>"), (work, "<work>"), (public, "<public>")):
        text = text.replace(json.dumps(str(path))[1:-1], name)
    return json.loads(text)


OBSERVE = """
import json, sys
from mtp_overlay.bed.steps.vllm_chat_template import observe
print("OBSERVED " + json.dumps(observe(sys.argv[1], stock=sys.argv[2] == "stock", multimodal=sys.argv[3] == "1")))
"""


def observe_in_subprocess(site, work, stock=True, multimodal=True, timeout=900):
    """`observe` in a fresh interpreter with ``site`` (another vLLM, or a patched copy) first on the path."""
    import subprocess
    import sys

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", OBSERVE, str(work), "stock" if stock else "patched", str(int(multimodal))]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("OBSERVED ")]
    if result.returncode or not lines:
        raise RuntimeError(f"observe() failed with {site} first on the path:\n{result.stderr[-4000:]}")
    return json.loads(lines[-1][len("OBSERVED "):])
