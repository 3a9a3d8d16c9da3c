"""vllm-chat-template on vLLM's real chat consumers (OnlineRenderer, OnlineDerenderer,
ServingTokenization, OpenAIServingChat, OpenAIServingResponses, AnthropicServingMessages).

Each test reads one world (see conftest.py): the pinned vLLM in this process (a tiny LLaVA: the image goes
through LLaVA's real multimodal processor) and vLLM 0.25.1 in a subprocess (a tiny Llama: the
``<image>`` placeholder is text), the fix off (stock) and on, next to what vLLM's own CLI path
(`make_arg_parser` + `init_app_state`) builds from ``--chat-template FILE --default-chat-template-kwargs``.
Stand-ins (GPU only): the engine client, and the platform's device type while the parser is built.
"""

import pytest
from pins import VLLM

CONSUMERS = ("OnlineRenderer", "OnlineDerenderer", "ServingTokenization", "OpenAIServingChat", "OpenAIServingResponses")
OFF = {"enable_thinking": False}
HOOK = [pytest.param(VLLM), pytest.param("0.25.1", marks=pytest.mark.slow)]
TEMPLATE_FILE = "<work>/chat.jinja"


def value(outcome):
    assert "value" in outcome, outcome
    return outcome["value"]


def cli(world, label="stock"):
    return world["cli"][label]


@pytest.mark.parametrize("version", HOOK)
def test_template_file_renders_as_its_path_on_stock_and_like_vllm_serve_when_fixed(world, version):
    """A chat with an image rendered through a template FILE: stock renders the path (the pinned vLLM: LLaVA's
    processor finds no <image> to expand and fails); fixed, byte for byte what `vllm serve` renders."""
    seen = world(version)
    served = cli(seen)
    prompt, ids, placeholders = value(served["chat_image"])
    assert "<image>" in prompt and prompt.endswith("assistant : /no_think")
    assert value(served["tokenize_image"]) == ids
    if seen["version"] == VLLM:
        assert placeholders == {"image": [[2, 4]]} and ids.count(3) == 4  # 4 image tokens in place of <image>

    stock = seen["stock"]["path_str"]
    assert all(stored == [repr(TEMPLATE_FILE), OFF if name == "OnlineRenderer" else {}]
               for name, stored in stock["consumers"].items())
    assert value(stock["chat_text"])[0] == TEMPLATE_FILE  # the path is the prompt
    if seen["version"] == VLLM:
        assert "Failed to apply prompt replacement for mm_items['image'][0]" in stock["chat_image"]["error"]
    else:
        assert value(stock["chat_image"])[0] == TEMPLATE_FILE
    assert "error" in seen["stock"]["path_obj"]["chat_image"]  # a Path is no template at all

    for case in ("path_str", "path_obj", "literal"):
        fixed = seen["fixed"][case]
        assert fixed["consumers"] == {name: ["FILE", OFF] for name in CONSUMERS}, case
        for render in ("chat_image", "chat_text", "tokenize_image"):
            assert fixed[render] == served[render], (case, render)
    assert seen["stock"]["literal"]["consumers"]["OpenAIServingChat"][0] == "FILE"  # Jinja text passes unchanged


@pytest.mark.parametrize("version", HOOK)
def test_tokenize_and_chat_render_one_conversation_alike(world, version):
    """Kwargs handed to the renderer only: stock /tokenize drops them (differs from the chat route);
    fixed, every consumer of the server gets them. Absent everywhere: {} everywhere."""
    seen = world(version)
    stock, fixed = seen["stock"]["literal"], seen["fixed"]["literal"]
    chat_ids, tokenize_ids = value(stock["chat_image"])[1], value(stock["tokenize_image"])
    assert tokenize_ids != chat_ids and tokenize_ids == chat_ids[:-1]  # no " /no_think" on /tokenize
    assert [stock["consumers"][name][1] for name in CONSUMERS] == [OFF, {}, {}, {}, {}]

    assert value(fixed["tokenize_image"]) == value(fixed["chat_image"])[1] == value(cli(seen)["tokenize_image"])
    assert all(kwargs == OFF for _, kwargs in fixed["consumers"].values())

    for label in ("stock", "fixed"):
        absent = seen[label]["absent"]
        assert absent["consumers"] == {name: ["None", {}] for name in CONSUMERS}, label
        prompt, ids, _ = value(absent["chat_image"])
        assert prompt.startswith("model-default ")  # the model's own template
        assert value(absent["tokenize_image"]) == ids


@pytest.mark.parametrize("version", HOOK)
def test_legacy_spelling_is_renamed_and_the_native_one_wins(world, version):
    seen = world(version)
    unexpected = "TypeError: OnlineRenderer.__init__() got an unexpected keyword argument 'chat_template_kwargs'"
    assert seen["stock"]["legacy"] == {"error": unexpected}
    assert seen["stock"]["both"] == {"error": unexpected}

    legacy, both = seen["fixed"]["legacy"], seen["fixed"]["both"]
    for case in (legacy, both):
        assert case["consumers"] == {name: ["FILE", OFF] for name in CONSUMERS}
        assert case["chat_image"] == cli(seen)["chat_image"]
    assert legacy["warnings"] == []
    assert both["warnings"] == [
        f"OverlayWarning(True): mtp-overlay fix 'vllm-chat-template': {name}: both default_chat_template_kwargs={OFF!r} and its legacy spelling "
        "chat_template_kwargs={'enable_thinking': True} were given; default_chat_template_kwargs wins "
        "(drop chat_template_kwargs)"
        for name in CONSUMERS
    ]


@pytest.mark.parametrize("version", HOOK)
def test_two_values_on_one_server_are_refused(world, version):
    """Stock builds a server whose /tokenize and chat route render with different templates or kwargs;
    fixed, the consumer that brings the second value is refused, naming the argument and the first."""
    seen = world(version)
    stock = seen["stock"]["template_conflict"]
    assert stock["consumers"]["ServingTokenization"][0] == "OTHER" and stock["consumers"]["OnlineRenderer"][0] == "None"
    assert value(stock["tokenize_image"]) != value(stock["chat_image"])[1]
    assert seen["stock"]["kwargs_conflict"]["consumers"]["OpenAIServingChat"][1] == {"enable_thinking": True}

    template = seen["fixed"]["template_conflict"]["error"]
    assert template.startswith("ValueError: ServingTokenization: chat_template=")
    assert "differs from None, which OnlineRenderer was built with on the same vLLM renderer" in template
    kwargs = seen["fixed"]["kwargs_conflict"]["error"]
    assert kwargs.startswith("ValueError: OpenAIServingChat: default_chat_template_kwargs={'enable_thinking': True} "
                             "differs from {'enable_thinking': False}, which OnlineRenderer was built with")


@pytest.mark.parametrize("version", HOOK)
def test_a_rewritten_template_file_is_read_again_by_the_next_server(world, version):
    """`vllm serve` reads --chat-template at each start, but vLLM's load_chat_template is an lru_cache by
    path: a server built in-process after the file was rewritten got the old text. Fixed, each server
    reads the file as it is (stock stores the path itself, both times)."""
    seen = world(version)
    fixed = seen["fixed"]["reread"]
    assert fixed["first"]["consumers"] == {name: ["FILE", {}] for name in CONSUMERS}
    assert fixed["second"]["consumers"] == {name: ["OTHER", {}] for name in CONSUMERS}
    assert value(fixed["second"]["chat_text"])[0] == "what is in this picture ? "  # OTHER's rendering of the chat
    assert value(fixed["first"]["chat_text"])[0] == "user : what is in this picture ? assistant :"  # FILE's
    stock = seen["stock"]["reread"]
    assert stock["second"]["consumers"]["OpenAIServingChat"][0] == repr("<work>/rewritten.jinja")


ALL_ALIVE = "OnlineDerenderer, OnlineRenderer, OpenAIServingChat, OpenAIServingResponses, ServingTokenization"


@pytest.mark.parametrize("version", HOOK)
def test_a_server_is_rebuilt_on_a_live_engine_once_its_old_consumers_are_gone(world, version):
    """An RL framework rebuilds its in-process server on the same engine (one vLLM renderer) between runs,
    with another template and kwargs: stock takes it; fixed, it was refused although the old consumers
    were gone. Now: taken once they are gone (garbage left in a reference cycle included, with automatic
    collection off), refused naming the live ones while they are referenced, taken after `reset`."""
    seen = world(version)
    stock, fixed = seen["stock"]["rebuild"], seen["fixed"]["rebuild"]
    rebuilt = {name: ["OTHER", {"enable_thinking": True}] for name in CONSUMERS}
    assert stock["after_drop"]["consumers"] == rebuilt
    assert fixed["old"] == {name: ["FILE", OFF] for name in CONSUMERS}
    assert fixed["after_drop"] == stock["after_drop"]  # what it stores and how every route renders
    error = fixed["while_alive"]["error"]
    assert error.startswith("ValueError: OnlineRenderer: chat_template=") and error.endswith("to forget its values")
    assert (f"which OnlineRenderer was built with on the same vLLM renderer, and consumers built with it are alive "
            f"({ALL_ALIVE}); ") in error
    assert "drop its old consumers first, or call " in error
    assert fixed["reset"] == {"value": None}
    assert fixed["after_reset"]["consumers"] == {name: ["FILE", {}] for name in CONSUMERS}
    assert fixed["kept"] == rebuilt  # a reset changes no consumer already built


BAD = {  # case -> what the fixed constructor raises (type, then fragments of the message)
    "directory": ("ValueError", "chat_template='<work>' cannot be loaded", "Is a directory"),
    "directory_path": ("ValueError", "chat_template=PosixPath('<work>') cannot be loaded: IsADirectoryError"),
    "non_utf8": ("ValueError", "chat_template='<work>/latin1.jinja' cannot be loaded: its bytes are not utf-8 text"),
    "unreadable": ("ValueError", "chat_template='<public>/unreadable.jinja' cannot be loaded", "Permission denied"),
    "missing": ("ValueError", "chat_template='<work>/missing.jinja' cannot be loaded", "No such file or directory"),
    "missing_path": ("ValueError", "chat_template=PosixPath('<work>/missing.jinja') cannot be loaded:",
                     "FileNotFoundError"),
    "bytes_path": ("TypeError", "chat_template must be Jinja text (str), the path of a template file", "got BytesPath"),
    "number": ("TypeError", "chat_template must be Jinja text (str), the path of a template file", "got int: 7"),
    "kwargs_list": ("TypeError", "default_chat_template_kwargs must be a mapping of template variable names"),
    "kwargs_keys": ("TypeError", "chat_template_kwargs must be a mapping of template variable names", "{1: False}"),
}


@pytest.mark.parametrize("version", HOOK)
def test_bad_input_is_a_clear_error_naming_the_argument_and_builds_nothing(world, version):
    """Stock stores whatever it is given (the failure comes at the first request, if at all); fixed,
    the constructor raises naming the argument, and the failed construction records nothing: the same
    server then takes a valid template."""
    seen = world(version)
    for case, (kind, *fragments) in BAD.items():
        stock, fixed = seen["stock"]["bad"][case], seen["fixed"]["bad"][case]
        if case == "kwargs_keys":
            assert "unexpected keyword argument 'chat_template_kwargs'" in stock["first"]["error"]
        else:
            assert "value" in stock["first"], (case, stock)
        message = fixed["first"]["error"]
        assert message.startswith(f"{kind}: OnlineRenderer: "), (case, message)
        assert all(fragment in message for fragment in fragments), (case, message)
        assert fixed["after"] == {"value": "OTHER"}, case
    missing = seen["fixed"]["bad"]["missing"]["first"]["error"]
    assert missing.endswith("; expected Jinja text or the path of a readable UTF-8 template file")


@pytest.mark.parametrize("version", HOOK)
def test_the_cli_path_is_unchanged_by_the_fix(world, version):
    seen = world(version)
    assert cli(seen, "fixed") == cli(seen, "stock")
    assert all(stored[0] == "FILE" for stored in cli(seen)["consumers"].values())


@pytest.mark.parametrize("version", HOOK)
def test_chat_subclasses_store_the_loaded_template(world, version):
    """OpenAIServingChatBatch inherits OpenAIServingChat's constructor; AnthropicServingMessages has
    its own (0.25.1 reads its chat_template argument after super().__init__)."""
    seen = world(version)
    stock, fixed = seen["stock"]["subclasses"], seen["fixed"]["subclasses"]
    assert stock["OpenAIServingChatBatch"] == {"value": f"PosixPath('{TEMPLATE_FILE}')"}
    if seen["version"] == "0.25.1":
        assert stock["AnthropicServingMessages"] == {"error": "TypeError: Can't compile non template nodes"}
    else:
        assert stock["AnthropicServingMessages"] == {"value": f"PosixPath('{TEMPLATE_FILE}')"}
    assert fixed == {"OpenAIServingChatBatch": {"value": "FILE"}, "AnthropicServingMessages": {"value": "FILE"}}


@pytest.mark.parametrize("version", HOOK)
def test_probe_needs_the_fix_and_the_hook_wraps_every_consumer(world, version):
    seen = world(version)
    assert seen["check"][0] == "needed"
    assert seen["status"] == {"state": "installed", "patched": False, "wrapped": [
        f"{name}.__init__" for name in (*CONSUMERS, "AnthropicServingMessages")]}


def comparable(observed):
    """The hook warns with OverlayWarning (its messages start with the fix's name), the patched vLLM
    with a plain UserWarning: the same text otherwise. Each names its own reset (the overlay's
    ``reset(renderer)``, the patched vLLM's ``SERVER_CHAT_TEMPLATES.reset(renderer)``)."""
    import json
    import re

    both = observed["both"]
    prefix = "mtp-overlay fix 'vllm-chat-template': "
    observed = {**observed, "both": {**both, "warnings": [w.split(": ", 1)[1].removeprefix(prefix) for w in both["warnings"]]}}
    return json.loads(re.sub(r"or call [\w.]+\.reset\(renderer\)", "or call <reset>(renderer)", json.dumps(observed)))


@pytest.mark.slow
@pytest.mark.parametrize("version", [VLLM, "0.25.1"])
def test_patched_vllm_behaves_like_the_hook_and_the_hook_stands_down(world, version):
    """The DEP-3 patch applied to a copy of the release: every case observes what the hook gives,
    the CLI path renders as stock vLLM's, the probe says redundant and nothing is wrapped."""
    hooked, patched = world(version), world(f"{version} patched")
    patched_cases, hooked_cases = comparable(patched["fixed"]), comparable(hooked["fixed"])
    assert patched_cases.keys() == hooked_cases.keys()
    for case, observed in hooked_cases.items():
        if case == "bad":
            for name, outcome in observed.items():
                assert patched_cases[case][name] == outcome, name
        else:
            assert patched_cases[case] == observed, case
    assert all(w.startswith("UserWarning(True): ") for w in patched["fixed"]["both"]["warnings"])
    assert patched["cli"]["fixed"] == cli(hooked)
    assert patched["check"][0] == "redundant" and "already calls load_chat_template" in patched["check"][1]
    assert patched["status"] == {"state": "redundant", "patched": True, "wrapped": []}
