"""vllm-chat-template as a DEP-3 source patch and as a probe, on real vLLM 0.33.0 and 0.25.1 files.

Pre-image hashes are checked against each release's dist-info RECORD (the wheel's own sha256 of every
file); apply / check / revert run `mtp-overlay patch` on private copies of the releases; the probe
reads the installed classes and copies of their modules edited the way upstream would change them.
"""

import base64
import csv
import hashlib
import json
import re
import types
from pathlib import Path

import pytest

from mtp_overlay import registry
from mtp_overlay.cli import main
from mtp_overlay.fixes.vllm_chat_template import CONSUMERS, FIX
from mtp_overlay.patching import engine
from mtp_overlay.patching.manifest import DEFAULT_PATH, load
from mtp_overlay.testing.releases import release_site
from mtp_overlay.testing.reproducers import reproducer

NAME = "vllm-chat-template"
VARIANT_OF = {"0.33.0": "0.33.patch", "0.25.1": "0.25.patch"}
DEP3 = ("Description:", "Origin:", "Bug:", "Forwarded:", "Applied-Upstream:", "Last-Update:")


def installed_site(version):
    """The folder vLLM ``version`` is installed in: the venv's, or the side-by-side release."""
    import vllm

    return Path(vllm.__file__).parents[1] if version == "0.33.0" else release_site("vllm", version)


def record_sha256(site, version):
    """{path: sha256} from the release's RECORD: the hashes its wheel ships."""
    record = Path(site) / f"vllm-{version}.dist-info" / "RECORD"
    hashes = {}
    for row in csv.reader(record.read_text().splitlines()):
        if len(row) > 1 and row[1].startswith("sha256="):
            hashes[row[0]] = base64.urlsafe_b64decode(row[1][len("sha256="):] + "==").hex()
    return hashes


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def patch(capsys, *args):
    capsys.readouterr()
    code = main(["patch", *args, "--only", NAME, "--json"])
    return code, json.loads(capsys.readouterr().out)[0]


# --- the manifest and the patch files --------------------------------------------------------------
@pytest.mark.parametrize("version", list(VARIANT_OF))
def test_manifest_hashes_are_the_released_files_and_their_patched_images(version):
    site = installed_site(version)
    variant = load().fixes[NAME].variant_for(version)
    assert variant.patch.name == VARIANT_OF[version]
    released = record_sha256(site, version)
    current = {file: (site / file).read_bytes() for file in variant.files}
    files, error = engine._git_apply(variant, current, reverse=False)
    assert error == ""
    for file, (pre, post) in variant.measured[version].items():
        assert pre == released[file] == hashlib.sha256(current[file]).hexdigest(), file
        assert hashlib.sha256(files[file]).hexdigest() == post, file


@pytest.mark.parametrize("name", list(VARIANT_OF.values()))
def test_patches_carry_dep3_headers(name):
    header = (DEFAULT_PATH.parent / NAME / "vllm" / name).read_text().split("\n---\n", 1)[0]
    assert [line.split(":")[0] + ":" for line in header.splitlines() if re.match(r"^[A-Z][\w-]+:", line)] == [
        "Description:", "Author:", "Origin:", "Bug:", "Forwarded:", "Applied-Upstream:", "Last-Update:"]
    assert all(field in header for field in DEP3)


def test_marker_is_the_probes_redundancy_signal():
    """`patch check` (reading files) and the probe (reading code objects) look for the same call."""
    marker = load().fixes[NAME].marker
    assert {"file": marker.file, "function": marker.function, "calls": marker.calls} == FIX.marker
    module, class_name, _ = CONSUMERS[0]
    assert FIX.marker["file"] == module.replace(".", "/") + ".py"
    assert FIX.marker["function"] == f"{class_name}.__init__"


# --- apply / check / revert on copies of the releases ---------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("version", list(VARIANT_OF))
def test_apply_check_revert_round_trip_is_byte_identical(version, vllm_copy, tmp_path, capsys):
    site = vllm_copy(version, tmp_path / "site")
    variant = load().fixes[NAME].variant_for(version)
    before = {file: digest(site / file) for file in variant.files}
    listing = sorted(str(p.relative_to(site)) for p in site.rglob("*"))
    assert engine.marker_present(load().fixes[NAME].marker, site) is False

    code, row = patch(capsys, "check", "--site-packages", str(site))
    assert (code, row["state"], row["variant"], row["version"]) == (0, "needed", VARIANT_OF[version], version)
    code, row = patch(capsys, "apply", "--site-packages", str(site))
    assert (code, row["action"], row["state"]) == (0, "patched", "applied")
    assert {file: digest(site / file) for file in variant.files} == {f: post for f, (_, post) in variant.measured[version].items()}
    assert engine.marker_present(load().fixes[NAME].marker, site) is True
    code, row = patch(capsys, "apply", "--site-packages", str(site))
    assert (code, row["action"]) == (0, "already applied")

    code, row = patch(capsys, "revert", "--site-packages", str(site))
    assert (code, row["action"], row["state"]) == (0, "reverted", "needed")
    assert {file: digest(site / file) for file in variant.files} == before
    assert sorted(str(p.relative_to(site)) for p in site.rglob("*")) == listing  # no .orig/.rej/tmp left

    with open(site / variant.files[1], "a") as handle:  # a local edit: the pre-image no longer matches
        handle.write("# local edit\n")
    edited = {file: digest(site / file) for file in variant.files}
    code, row = patch(capsys, "apply", "--site-packages", str(site))
    assert code == 1 and row["action"] == "refused" and row["state"] == "mismatch"
    assert {file: digest(site / file) for file in variant.files} == edited


# --- the probe -------------------------------------------------------------------------------------
def test_stock_release_needs_the_fix_on_every_consumer():
    row = registry.check([NAME])[0]
    assert row.state == "needed" and row.version == "0.33.0"
    for module, class_name, _ in CONSUMERS:
        assert f"{module}: {class_name}.__init__ stores chat_template as given" in row.reason


def edited_module(name, *edits):
    """The installed upstream module ``name`` with ``(old, new)`` edits, as a module object (not put in
    sys.modules): the release as upstream might change it."""
    import importlib

    source = Path(importlib.import_module(name).__file__).read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    module = types.ModuleType(name)
    module.__file__ = f"<{name} edited>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


IMPORT_LOADER = ("from vllm.renderers.chat_utils import (\n", "from vllm.renderers.chat_utils import (\n    load_chat_template,\n")
LOAD_IN_CLASS = (  # upstream resolving the path in the class itself
    "        self.chat_template = chat_template\n        self.chat_template_content_format",
    "        self.chat_template = load_chat_template(chat_template)\n        self.chat_template_content_format",
)


def test_probe_redundant_when_upstream_loads_the_template_in_the_class():
    module = edited_module("vllm.renderers.online_renderer", IMPORT_LOADER)
    assert FIX.probe(module).state == "needed"  # importing the loader changes nothing
    verdict = FIX.probe(edited_module("vllm.renderers.online_renderer", IMPORT_LOADER, LOAD_IN_CLASS))
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
    verdict = FIX.probe(edited_module(name, (old, new)))
    assert verdict.state == "drifted" and reason in verdict.reason, verdict


# --- the reproducer --------------------------------------------------------------------------------
def test_reproducer_shows_the_bug_on_stock_vllm():
    shows, evidence = reproducer(registry.get(NAME))()
    assert shows, evidence
    assert "renders a chat with an <image> placeholder as '<tmp>/chat.jinja': the path" in evidence
