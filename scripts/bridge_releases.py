"""Print which Megatron-Bridge releases install and import here, and whether each has the three MTP defects.

Each release is installed side by side (``pip install --no-deps --target``, mtp_overlay.bed.runtime.releases;
the venv's own for its version) and imported in a fresh interpreter with the venv's megatron-core and
the test bed's stand-ins (``import megatron.bridge``, then ``training.gpt_step``). Per defect, the
release's source (read, not imported) and, where it imports, its behaviour:

* SFT loss mask: the ``forward_args`` dict of ``gpt_step`` (the dict literal with an ``"input_ids"``
  key) has no ``"loss_mask"`` key -> present.
* export depth: ``NemotronHBridge.megatron_to_hf_config`` of a namespace provider
  (``hybrid_layer_pattern="MEME/*E/*E", mtp_num_layers=2, mtp_use_repeated_layer=True``, Bridge
  issue #5946's repro) writes ``num_nextn_predict_layers`` 2 -> present; source: the config mapping
  of ``num_nextn_predict_layers`` to ``mtp_num_layers`` and whether the export reads
  ``mtp_use_repeated_layer``.
* MTP off: a repeated-layer provider (pattern "*-*-", MTP "*-") finalized with ``mtp_num_layers=0``
  keeps an MTP section -> present; source: the ``num_pattern_copies = max(1, ...)`` line.

Usage: PYTHONPATH=$PWD python scripts/bridge_releases.py [VERSION ...]   (default: every release below)
"""

import ast
import json
import sys
from pathlib import Path

from mtp_overlay.bed.runtime.releases import installed_site, release_site, run_with_release

RELEASES = ("0.6.2", "0.6.0", "0.5.1", "0.5.0", "0.4.2", "0.4.1", "0.4.0", "0.3.1", "0.3.0")

CHILD = r"""
import json, traceback, types

def where(error):
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "megatron/" in f.filename]
    frame = (frames or traceback.extract_tb(error.__traceback__))[-1]
    return f"{frame.filename[frame.filename.rfind('megatron/'):]}:{frame.lineno}"

facts = {}
try:
    from mtp_overlay.bed.models.bridge import import_bridge, local_overrides
    from mtp_overlay.bed.steps.bridge_step import import_gpt_step
    step = "megatron.bridge"
    import_bridge()
    step = "gpt_step"
    import_gpt_step()
    facts["imports"] = "yes"
    from megatron.bridge.models.nemotronh.nemotron_h_bridge import NemotronHBridge
    provider = types.SimpleNamespace(hybrid_layer_pattern="MEME/*E/*E", mtp_num_layers=2,
                                     mtp_use_repeated_layer=True)
    facts["exported_depth"] = NemotronHBridge.megatron_to_hf_config(provider)["num_nextn_predict_layers"]
    import torch
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    provider = HybridModelProvider(hybrid_layer_pattern="*-*-", mtp_hybrid_override_pattern="*-",
                                   mtp_use_repeated_layer=True, mtp_num_layers=0, hidden_size=64,
                                   ffn_hidden_size=128, num_attention_heads=4, vocab_size=128)
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=local_overrides(provider))
    facts["finalized_at_0"] = provider.hybrid_layer_pattern
except Exception as error:
    facts.setdefault("imports", f"no: {step}: {type(error).__name__}: {str(error)[:120]} ({where(error)})")
print(json.dumps(facts))
"""


def forward_args_keys(site):
    """Keys of gpt_step's forward_args dict literal (the one with "input_ids"), or None."""
    tree = ast.parse((site / "megatron/bridge/training/gpt_step.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = [key.value for key in node.keys if isinstance(key, ast.Constant)]
            if "input_ids" in keys:
                return keys
    return None


def export_source(site):
    """How the release exports the MTP depth of a NemotronH provider, from its source."""
    base = (site / "megatron/bridge/models/conversion/model_bridge.py").read_text()
    nemotron = (site / "megatron/bridge/models/nemotronh/nemotron_h_bridge.py").read_text()
    if "def megatron_to_hf_config" not in base:
        return "no config export"
    if '("num_nextn_predict_layers", "mtp_num_layers")' not in base or "mtp" not in nemotron:
        return "no MTP in the NemotronH mapping"
    override = nemotron.split("def megatron_to_hf_config", 1)[1] if "def megatron_to_hf_config" in nemotron else ""
    return "depth = mtp_num_layers" + ("" if "mtp_use_repeated_layer" in override else ", repeated layer not read")


def finalize_source(site):
    """The line that sizes a repeated-layer provider's MTP section, "file:line text", or what has none."""
    for provider in ("hybrid/hybrid_provider.py", "mamba/mamba_provider.py"):
        relative = f"megatron/bridge/models/{provider}"
        path = site / relative
        if path.exists():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "num_pattern_copies = max(1" in line:
                    return f"`{relative.split('/')[-1]}:{number}` `{line.strip()}`"
    return "no repeated-layer MTP section"


def row(version):
    from importlib import metadata

    site = installed_site("megatron-bridge") if metadata.version("megatron-bridge") == version else None
    try:
        site = site or release_site("megatron-bridge", version)
    except Exception as error:  # noqa: BLE001 - a release that does not install is a row too
        return f"| {version} | no: {error} | | | |"
    result = run_with_release(Path(site), CHILD, timeout=600)
    lines = result.stdout.strip().splitlines()
    facts = json.loads(lines[-1]) if lines else {"imports": f"no: child failed: {result.stderr[-200:]}"}
    keys = forward_args_keys(Path(site))
    sft = "present: no loss_mask in forward_args"
    if keys is None or "loss_mask" in keys:
        sft = "no forward_args" if keys is None else "absent"
    export = export_source(Path(site))
    if "exported_depth" in facts:
        depth = facts["exported_depth"]
        export += f"; exports {depth} ({'absent' if depth == 1 else 'present'})"
    off = finalize_source(Path(site))
    if "finalized_at_0" in facts:
        kept = "/" in facts["finalized_at_0"]
        off += f"; at 0: `{facts['finalized_at_0']}` ({'present' if kept else 'absent'})"
    return f"| {version} | yes | {facts['imports']} | {sft} | {export} | {off} |"


def main():
    versions = sys.argv[1:] or RELEASES
    print("| Bridge | installs (--no-deps) | imports here (megatron-core 0.19.2) | SFT loss mask | export depth "
          "| mtp_num_layers 0 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for version in versions:
        print(row(version), flush=True)


if __name__ == "__main__":
    main()
