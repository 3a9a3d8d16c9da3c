"""vllm-chat-template as a DEP-3 source patch and as a probe, on the real files of the pinned vLLM and 0.25.1.

Pre-image hashes are checked against each release's dist-info RECORD (the wheel's own sha256 of every
file); apply / check / revert run `mtp-overlay patch` on private copies of the releases; the probe
reads the installed classes and copies of their modules edited the way upstream would change them.
"""

import hashlib
import json
import re
from pathlib import Path

import pytest
from pins import VLLM

from mtp_overlay import registry
from mtp_overlay.cli import main
from mtp_overlay.fixes.vllm_chat_template import CONSUMERS, FIX
from mtp_overlay.patching.manifest import DEFAULT_PATH, load, touched_files
from mtp_overlay.patching.survey import marker_on_disk
from mtp_overlay.bed.runtime.releases import edited_module
from mtp_overlay.bed.fixes import reproduce

NAME = "vllm-chat-template"
VARIANT_OF = {VLLM: "0.33.patch", "0.25.1": "0.25.patch"}
DEP3 = ("Description:", "Origin:", "Bug:", "Forwarded:", "Applied-Upstream:", "Last-Update:")


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def patch(capsys, *args):
    capsys.readouterr()
    code = main(["patch", *args, "--only", NAME, "--json"])
    return code, json.loads(capsys.readouterr().out)[0]


# --- the patch files (the manifest's hashes are tests/patching's) -------------------------------------
@pytest.mark.parametrize("name", list(VARIANT_OF.values()))
def test_patches_carry_dep3_headers(name):
    header = (DEFAULT_PATH.parent / NAME / "vllm" / name).read_text().split("\n---\n", 1)[0]
    assert [line.split(":")[0] + ":" for line in header.splitlines() if re.match(r"^[A-Z][\w-]+:", line)] == [
        "Description:", "Author:", "Origin:", "Bug:", "Forwarded:", "Applied-Upstream:", "Last-Update:"]
    assert all(field in header for field in DEP3)


# --- apply / check / revert on copies of the releases ---------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("version", list(VARIANT_OF))
def test_apply_check_revert_round_trip_is_byte_identical(version, vllm_copy, tmp_path, capsys):
    site = vllm_copy(version, tmp_path / "site")
    files = touched_files(DEFAULT_PATH.parent / NAME / "vllm" / VARIANT_OF[version])
    before = {file: digest(site / file) for file in files}
    listing = sorted(str(p.relative_to(site)) for p in site.rglob("*"))
    assert marker_on_disk(FIX, site) is False

    code, row = patch(capsys, "check", "--site-packages", str(site))
    assert (code, row["state"], row["variant"], row["version"]) == (0, "needed", VARIANT_OF[version], version)
    code, row = patch(capsys, "apply", "--site-packages", str(site))
    assert (code, row["action"], row["state"]) == (0, "patched", "applied")
    images = load().images["vllm"][version]
    assert {file: digest(site / file) for file in files} == {file: images[file][frozenset({NAME})] for file in files}
    assert marker_on_disk(FIX, site) is True
    code, row = patch(capsys, "apply", "--site-packages", str(site))
    assert (code, row["action"]) == (0, "already applied")

    code, row = patch(capsys, "revert", "--site-packages", str(site))
    assert (code, row["action"], row["state"]) == (0, "reverted", "needed")
    assert {file: digest(site / file) for file in files} == before
    assert sorted(str(p.relative_to(site)) for p in site.rglob("*")) == listing  # no .orig/.rej/tmp left

    with open(site / files[1], "a") as handle:  # a local edit: the pre-image no longer matches
        handle.write("# local edit\n")
    edited = {file: digest(site / file) for file in files}
    code, row = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 1 and row["action"] == "refused" and row["state"] == "mismatch"
    assert {file: digest(site / file) for file in files} == edited


# --- the probe -------------------------------------------------------------------------------------
def test_stock_release_needs_the_fix_on_every_consumer():
    row = registry.check([NAME])[0]
    assert row.verdict == "needed" and row.version == VLLM
    reasons = {target["module"]: target["reason"] for target in row.targets}  # one per target module
    for role, module in FIX.targets.items():
        class_name = CONSUMERS[role][0]
        assert f"{class_name}.__init__ stores chat_template as given" in reasons[module], reasons


def edited(name, *edits):
    """The installed upstream module ``name`` with ``(old, new)`` edits (not put in sys.modules)."""
    import importlib

    return edited_module(importlib.import_module(name), *edits)


IMPORT_LOADER = (
    "from vllm.renderers.chat_utils import (\n",
    "from vllm.renderers.chat_utils import (\n    load_chat_template,\n",
)
LOAD_IN_CLASS = (  # upstream resolving the path in the class itself
    "        self.chat_template = chat_template\n        self.chat_template_content_format",
    "        self.chat_template = load_chat_template(chat_template)\n        self.chat_template_content_format",
)


def test_probe_redundant_when_upstream_loads_the_template_in_the_class():
    module = edited("vllm.renderers.online_renderer", IMPORT_LOADER)
    assert FIX.probe(module).state == "needed"  # importing the loader changes nothing
    verdict = FIX.probe(edited("vllm.renderers.online_renderer", IMPORT_LOADER, LOAD_IN_CLASS))
    assert verdict.state == "redundant" and "OnlineRenderer.__init__ already calls load_chat_template" in verdict.reason


@pytest.mark.parametrize(("name", "old", "new", "reason"), [
    ("vllm.renderers.online_renderer", "        default_chat_template_kwargs: dict[str, Any] | None = None,\n",
     "        template_defaults: dict[str, Any] | None = None,\n", "takes no keyword default_chat_template_kwargs"),
    ("vllm.entrypoints.serve.tokenize.serving", "        online_renderer: OnlineRenderer,\n        *,\n",
     "        renderer_front: OnlineRenderer,\n        *,\n", "takes no keyword online_renderer"),
    ("vllm.renderers.online_derenderer", "class OnlineDerenderer:", "class ChatDerenderer:",
     "has no class OnlineDerenderer"),
])
def test_probe_drifted_when_a_constructor_changes_shape(name, old, new, reason):
    verdict = FIX.probe(edited(name, (old, new)))
    assert verdict.state == "drifted" and reason in verdict.reason, verdict


# --- the reproducer --------------------------------------------------------------------------------
@pytest.mark.slow
def test_reproducer_shows_the_bug_on_stock_vllm():
    shows, evidence = reproduce(NAME)
    assert shows, evidence
    assert "renders a chat with an <image> placeholder as '<tmp>/chat.jinja': the path" in evidence


# --- the hook's lifecycle and the shared server state, in this process -----------------------------
@pytest.fixture
def overlay():
    """``overlay(True/False)`` switches the fix; it is back on after the test."""
    import mtp_overlay

    def switch(on):
        mtp_overlay.uninstall(only=[NAME])
        if on:
            mtp_overlay.install(only=[NAME])

    yield switch
    switch(True)


def test_uninstall_restores_every_constructor_and_install_wraps_once(overlay):
    import importlib

    owners = [getattr(importlib.import_module(module), CONSUMERS[role][0]) for role, module in FIX.targets.items()]
    overlay(True)
    wrapped = [vars(owner)["__init__"] for owner in owners]
    originals = [init.__wrapped__ for init in wrapped]
    assert all(type(init).__name__ == "FunctionWrapper" for init in wrapped)
    overlay(False)
    assert all(vars(owner)["__init__"] is original for owner, original in zip(owners, originals))
    overlay(True)
    registry.install(only=[NAME])
    assert all(vars(owner)["__init__"].__wrapped__ is original for owner, original in zip(owners, originals))


def test_one_kwargs_dict_per_server_and_servers_apart(overlay, tmp_path):
    """Consumers on one renderer share the very kwargs dict (as `vllm serve` hands one to all); two
    servers (two renderers) in one process keep their own values."""
    from vllm.config import ModelConfig

    from mtp_overlay.bed.steps import vllm_serving as vs

    vs.offline_environment()
    model_config = ModelConfig(model=str(vs.write_tiny_model(tmp_path / "model", multimodal=False)))
    template = tmp_path / "chat.jinja"
    template.write_text(vs.FILE_TEMPLATE)

    def server(kwargs):
        built = vs.Server(model_config)
        online = built.build("OnlineRenderer", chat_template=template, default_chat_template_kwargs=kwargs)
        return online, built.build("ServingTokenization", online_renderer=online, chat_template=None)

    overlay(False)
    online, tokenization = server({"enable_thinking": False})
    assert tokenization.default_chat_template_kwargs == {} and tokenization.chat_template is None

    overlay(True)
    first, first_tokenization = server({"enable_thinking": False})
    second, second_tokenization = server({"enable_thinking": True})
    assert first_tokenization.default_chat_template_kwargs is first.default_chat_template_kwargs
    assert first_tokenization.chat_template == first.chat_template == vs.FILE_TEMPLATE
    assert second_tokenization.default_chat_template_kwargs == {"enable_thinking": True}
    assert first.default_chat_template_kwargs == {"enable_thinking": False}


def test_a_call_the_constructor_cannot_take_fails_as_on_stock(overlay):
    """No renderer to key a server by, or a missing required argument: upstream's own error, fix or not."""
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization

    from mtp_overlay.bed.steps import vllm_serving as vs

    errors = []
    for on in (False, True):
        overlay(on)
        for kwargs in ({"chat_template": vs.FILE_TEMPLATE}, {}):  # no renderer; no chat_template at all
            with pytest.raises((AttributeError, TypeError)) as caught:
                ServingTokenization(None, None, chat_template_content_format="auto", **kwargs)
            errors.append(f"{type(caught.value).__name__}: {caught.value}")
    assert errors[:2] == errors[2:]
    assert errors[0] == "AttributeError: 'NoneType' object has no attribute 'model_config'"
    assert "missing 1 required keyword-only argument: 'chat_template'" in errors[1]
