"""The one run of the ``mtp-overlay verify`` command itself (child process, its own ranks): it finds an MTP
defect nobody told it about. A copy of megatron-core gets a new defect planted in
``HybridModel._postprocess``: under CP2 (and only there) the RL input ids are rolled once more before
the MTP loss derives its labels from them, so every MTP target arrives one position late. No overlay
fix touches that line. Verify of the NemotronH-like folder at TP2xCP2+SP must exit 1, name CP2 as the
smallest layout that shows it (TP1 and TP2+SP do not), and list exactly the wrong pairs the planted
defect makes, derived here from the tokens: depth d at position i trains t[i + d + 2] (0 past the
inputs) where t[i + d + 1] was due.

Wall time: ~90 s on 2 cores at load ~12 (4 ranks oversubscribed, start-up included; slow).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.releases import link_installed
from mtp_overlay.verification import data, oracle

CONFIG = Path(__file__).parent / "configs" / "nemotron_h_like"
ROOT = Path(__file__).resolve().parents[2]
PLANTED = "megatron/core/models/hybrid/hybrid_model.py"
BEFORE = """            elif not in_inference_mode:
                # For RL (labels is None), process_mtp_loss derives labels from
"""
AFTER = """            elif not in_inference_mode:
                if labels is None and input_ids is not None and self.pg_collection.cp.size() == 2:
                    input_ids = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=self.pg_collection.cp,
                                            packed_seq_params=packed_seq_params)[0]  # planted
                # For RL (labels is None), process_mtp_loss derives labels from
"""

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)]


def planted_site(folder):
    """A private megatron-core (hard links, the planted file copied) with the defect of the docstring."""
    site = link_installed("megatron-core", folder, copies=[PLANTED])
    path = site / PLANTED
    source = path.read_text()
    assert source.count(BEFORE) == 1 and source.count("    process_mtp_loss,\n)") == 1
    imports = ("    process_mtp_loss,\n)", "    process_mtp_loss,\n    roll_tensor,\n)")
    path.write_text(source.replace(BEFORE, AFTER).replace(*imports))
    return site


def test_verify_finds_a_planted_cp2_defect_and_names_cp2_and_the_wrong_pairs(tmp_path):
    site = planted_site(tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    env.pop("MTP_OVERLAY_SHARED_RANKS", None)
    command = [sys.executable, "-m", "mtp_overlay.cli", "verify", "--hf-config", str(CONFIG), "--tp", "2", "--cp", "2",
               "--sp", "--packing", "thd-real-lengths", "--json", "--log", str(tmp_path / "ranks.log")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1, result.stderr[-3000:]
    found = json.loads(result.stdout)
    assert "mtp-overlay verify: starting 4 gloo rank(s)" in result.stderr  # progress on stderr
    assert not found["ok"] and found["layout"] == "TP2xCP2+SP"
    (defect,) = found["new_defects"]
    assert defect["where"] == "CP2, thd-real-lengths"
    assert [case["differs"] for case in found["search"]] == [False, True, False]  # TP1, CP2, TP2+SP
    sequences = tuple(data.Sequence(tuple(s["ids"]), s["prompt"]) for s in found["sample"]["sequences"])
    for depth in defect["case"]["depths"]:
        allowed = oracle.allowed(sequences, depth["depth"], "rl")
        late = {(index, position, sequences[index].tokens[target] if target < sequences[index].length else 0)
                for index, position, _ in allowed for target in [position + depth["depth"] + 2]}
        assert {tuple(pair) for pair in depth["wrong"]} == late
        assert {tuple(pair) for pair in depth["missed"]} == allowed
    assert found["reference"]["differs"] is False  # the reference runs at TP1: the planted defect never fires there
    print(found["phases"])
