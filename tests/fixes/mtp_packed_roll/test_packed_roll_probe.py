"""mtp-packed-roll's probe on real megatron-core releases: needed, redundant, drifted.

Each case imports a real megatron-core (a side-by-side release, or a copy of one that the test
patched or reshaped) in a fresh interpreter with the overlay on. Upstream shapes checked:
0.16-0.19 (needed); Megatron-LM main as of 2026-08 (needed: the roll gained ``return_sum`` but still
reads ``cu_seqlens_q``); an upstream carrying Megatron-LM #4494's padded boundaries through a helper,
as the dev branch does (redundant); our DEP-3 patch on disk (redundant, and it rolls like the hook).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pins import MEGATRON_CORE

from mtp_overlay.bed.runtime.releases import release_copy, run_json, run_with_release

# fresh interpreters on release copies: the full suite (the pin's probe: the contract and support-matrix tests)
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
PATCHES = REPO / "patches" / "mtp-packed-roll" / "megatron-core"
MODULE = "megatron/core/transformer/multi_token_prediction.py"
FIX = "mtp-packed-roll"

REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import torch
import mtp_overlay
import megatron.core.transformer.multi_token_prediction as m
from mtp_overlay.bed.oracles.packed_reference import packed_params
from mtp_overlay.patching.survey import patched_on_disk
row = mtp_overlay.status(only=["mtp-packed-roll"], patched=patched_on_disk)[0]
wrapped = sorted(attribute for _, attribute in mtp_overlay.registry.lifecycle("mtp-packed-roll").wrapped())
out = {"state": row.state, "reason": row.reason, "version": row.version, "patched": row.patched, "wrapped": wrapped}
if "return_sum" in m.roll_tensor.__code__.co_varnames:
    rolled, total = m.roll_tensor(torch.ones(1, 8), -1, -1, None, packed_params([7], [8]), return_sum=False)
    out["no_sum"] = [rolled.tolist(), total]
print(json.dumps(out))
"""


def report(site, **env):
    return run_json(site, REPORT, env={**os.environ, **env})


def site_of(version, tmp_path):
    return release_copy("megatron-core", version, tmp_path / "site")


def apply_patch(site, patch):
    subprocess.run(["git", "apply", "-p1", str(patch)], cwd=site, check=True)


def edit_source(site, *replacements):
    path = Path(site) / MODULE
    source = path.read_text()
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path.write_text(source)


@pytest.mark.parametrize("version", ["0.16.1", MEGATRON_CORE])
def test_stock_release_needs_the_fix_and_gets_both_wrappers(version, tmp_path):
    row = report(site_of(version, tmp_path))
    assert row["version"] == version and row["state"] == "installed"
    assert "0.16-0.19 shape: the packed roll reads cu_seqlens_q" in row["reason"]
    assert row["wrapped"] == ["_roll_tensor_packed_seq", "roll_tensor"] and row["patched"] is False


@pytest.mark.parametrize(
    ("version", "patch"), [("0.16.1", "0.16"), (MEGATRON_CORE, "0.17-0.19")]
)
def test_release_patched_on_disk_is_redundant_and_left_unwrapped(version, patch, tmp_path):
    site = site_of(version, tmp_path)
    apply_patch(site, PATCHES / f"{patch}.patch")
    row = report(site)
    assert row["state"] == "redundant" and "already reads packed_seq_params.cu_seqlens_q_padded" in row["reason"]
    assert row["wrapped"] == [] and row["patched"] is True


HELPER = '''

def _packed_roll_boundaries(packed_seq_params):
    """The boundaries the packed tensor is laid out on (Megatron-LM #4494's rule)."""
    if packed_seq_params.cu_seqlens_q_padded is not None:
        return packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q


def _roll_tensor_packed_seq('''


def test_upstream_reading_padded_boundaries_through_a_helper_is_redundant(tmp_path):
    """Megatron-LM dev reads cu_seqlens_q_padded in a helper its packed roll calls (#4494)."""
    site = site_of(MEGATRON_CORE, tmp_path)
    edit_source(
        site,
        ("\n\ndef _roll_tensor_packed_seq(", HELPER),
        ("    cu_seqlens = packed_seq_params.cu_seqlens_q\n", "    cu_seqlens = _packed_roll_boundaries(packed_seq_params)\n"),
    )
    row = report(site)
    assert row["state"] == "redundant" and row["wrapped"] == []


def test_main_shape_with_return_sum_is_needed_and_honours_return_sum(tmp_path):
    """Megatron-LM main (2026-08): both rolls take return_sum and still read cu_seqlens_q."""
    site = site_of(MEGATRON_CORE, tmp_path)
    edit_source(
        site,
        ("def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):",
         "def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None, return_sum=True):"),
        ("def _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group=None):",
         "def _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group=None, return_sum=True):"),
        ("return _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group)",
         "return _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group, return_sum=return_sum)"),
    )
    row = report(site)
    assert row["state"] == "installed" and "main (2026-08) shape" in row["reason"]
    assert row["no_sum"] == [[[1, 1, 1, 1, 1, 1, 0, 0]], None]


def test_renamed_roll_is_drift_and_import_survives(tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    edit_source(
        site,
        ("def _roll_tensor_packed_seq(", "def _roll_packed_sequences("),
        ("return _roll_tensor_packed_seq(", "return _roll_packed_sequences("),
    )
    row = report(site)
    assert row["state"] == "drifted" and "has no _roll_tensor_packed_seq" in row["reason"]
    assert row["wrapped"] == []


def test_unknown_signature_is_drift_naming_the_parameters(tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    edit_source(site, ("def _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group=None):",
                       "def _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group=None, fill=0):"))
    row = report(site)
    assert row["state"] == "drifted" and "'fill'" in row["reason"] and row["wrapped"] == []
    code = "import mtp_overlay, megatron.core.transformer.multi_token_prediction"
    strict = run_with_release(site, code, env={**os.environ, "MTP_OVERLAY_STRICT": "1"})
    assert strict.returncode != 0 and "OverlayError" in strict.stderr and FIX in strict.stderr
    relaxed = run_with_release(site, code)
    assert relaxed.returncode == 0 and "OverlayWarning" in relaxed.stderr


PATCHED_ROLLS = """
import json
from mtp_overlay.bed.runtime.launcher import run_ranks


def rolls():
    import torch
    from megatron.core import parallel_state
    import megatron.core.transformer.multi_token_prediction as m
    from mtp_overlay.bed.oracles import packed_reference as ref

    group = parallel_state.get_context_parallel_group()
    size, rank = group.size(), group.rank()
    wrong = 0
    for real, padded in (([3, 5], [4, 8]), ([5, 7], [8, 8]), ([1, 0, 9, 4], [4, 0, 12, 8]), ([8], [8])):
        row = torch.arange(100, 100 + 2 * sum(padded)).reshape(2, -1)
        for cp, g in ((1, None), (size, group)):
            local = ref.cp_local(row, padded, cp, rank if cp > 1 else 0)
            want = ref.cp_local(ref.reference_roll(row, real, padded), padded, cp, rank if cp > 1 else 0)
            got, count = m.roll_tensor(local, -1, -1, g, ref.packed_params(real, padded))
            wrong += int((got != want).sum()) + int(count != got.sum())
    unpacked = torch.arange(1, 17).reshape(1, -1)
    got = m.roll_tensor(ref.cp_local(unpacked, [16], size, rank), -1, -1, group, None)[0]
    wrong += int((got != ref.cp_local(ref.reference_roll(unpacked, [16], [16]), [16], size, rank)).sum())
    try:
        m.roll_tensor(torch.ones(1, 6), -1, -1, group, ref.packed_params([5, 6], [6, 6]))
        uneven = None
    except ValueError as exc:
        uneven = str(exc)
    return {"file": m.__file__, "wrong": wrong, "uneven": uneven,
            "wrapped": type(vars(m)["_roll_tensor_packed_seq"]).__name__ == "FunctionWrapper"}


if __name__ == "__main__":
    results = run_ranks(rolls, 2, cp=2, timeout=240)
    print(json.dumps([{"value": r.value, "error": r.error} for r in results]))
"""


def test_patched_release_rolls_like_the_hook_with_the_hook_standing_down(tmp_path):
    site = site_of(MEGATRON_CORE, tmp_path)
    apply_patch(site, PATCHES / "0.17-0.19.patch")
    script = tmp_path / "patched_rolls.py"
    script.write_text(PATCHED_ROLLS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(result.stdout.strip().splitlines()[-1])
    for rank in ranks:
        assert rank["error"] is None, rank["error"]
        value = rank["value"]
        assert value["file"].startswith(str(site)) and not value["wrapped"]
        assert value["wrong"] == 0
        assert "padded lengths [6, 6]" in value["uneven"] and "2*cp_size=4" in value["uneven"]
