"""The vLLM worlds the vllm-chat-template tests look at, each observed once per session.

A world is a vLLM install and what `mtp_overlay.bed.steps.vllm_chat_template.observe` saw there:
- the pinned vLLM (``pins.VLLM``): the venv's, in this process, the fix off (stock) and on (the hook);
- "0.25.1": vLLM 0.25.1 side by side, in a subprocess, off and on;
- "<pinned> patched", "0.25.1 patched": a copy of each carrying the fix's DEP-3 patch (applied with
  `mtp-overlay patch apply`), the hook on (it stands down), in a subprocess.
"""

import pytest
from pins import VLLM

from mtp_overlay.cli import main
from mtp_overlay.bed.runtime.releases import copy_installed, release_site
from mtp_overlay.bed.steps.vllm_chat_template import observe, observe_in_subprocess

VERSIONS = (VLLM, "0.25.1")
MULTIMODAL = {VLLM: True, "0.25.1": False}  # 0.25.1's LLaVA does not import on transformers 5.20


def copy_release(version, destination):
    """A private copy of vLLM ``version`` (the venv's for the pinned one) to patch or edit."""
    return copy_installed("vllm", destination, site=None if version == VLLM else release_site("vllm", version))


@pytest.fixture
def vllm_copy():
    return copy_release


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """``world(name)``: the observations of that world (computed on first use)."""
    seen = {}

    def get(name):
        if name not in seen:
            version, _, patched = name.partition(" ")
            work = tmp_path_factory.mktemp(f"world-{version}{'-patched' if patched else ''}")
            if patched:
                site = copy_release(version, work / "site")
                assert main(["patch", "apply", "--site-packages", str(site), "--only", "vllm-chat-template"]) == 0
                seen[name] = observe_in_subprocess(site, work / "work", stock=False, multimodal=MULTIMODAL[version])
            elif version == VLLM:
                seen[name] = observe(work)
            else:
                seen[name] = observe_in_subprocess(release_site("vllm", version), work, multimodal=MULTIMODAL[version])
        return seen[name]

    return get
