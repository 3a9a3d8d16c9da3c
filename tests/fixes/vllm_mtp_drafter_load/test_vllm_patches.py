"""Source patches for the pinned vLLM and 0.25.1: vllm-mtp-drafter-load and device-normalized-broadcast.

For container images whose processes never ``import mtp_overlay``. Every case patches a private copy
of a real install (the venv's pinned vLLM, the side-by-side 0.25.1): its files hard-linked into a
temporary site, the touched files real copies. The patched vLLM is then run: it reports a stale
drafter and normalizes devices by itself, and the overlay's hooks stand down (``redundant``).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from pins import VLLM

from mtp_overlay import registry
from mtp_overlay.cli import main
from mtp_overlay.patching.manifest import DEFAULT_PATH, load, touched_files
from mtp_overlay.bed.runtime.releases import link_installed, record_sha256, release_site, run_with_release

REPO = Path(__file__).resolve().parents[3]
FIXES = ("vllm-mtp-drafter-load", "device-normalized-broadcast")
# every fix that ships a vLLM patch (what container_build.sh applies)
VLLM_PATCHED = [name for name in registry.names() if registry.get(name).distribution == "vllm" and registry.get(name).families]
VERSIONS = (VLLM, "0.25.1")


def installed_site(version):
    return Path(sysconfig.get_paths()["purelib"]) if version == VLLM else release_site("vllm", version)


def patch_file(fix, version):
    fix = registry.get(fix)
    return DEFAULT_PATH.parent / fix.name / "vllm" / f"{fix.family_of(version)}.patch"


def touched(version, fixes=FIXES):
    return sorted({file for fix in fixes for file in touched_files(patch_file(fix, version))})


def patched_copy(version, tmp_path):
    site = tmp_path / f"site-{version}"
    return link_installed("vllm", site, site=None if version == VLLM else installed_site(version), copies=touched(version))


def patch(capsys, *args):
    capsys.readouterr()
    code = main(["patch", *args, "--json"])
    return code, {row["fix"]: row for row in json.loads(capsys.readouterr().out)}


def tree_sha(root, files):
    return {file: hashlib.sha256((Path(root) / file).read_bytes()).hexdigest() for file in files}


@pytest.mark.parametrize("version", VERSIONS)
def test_apply_check_revert_round_trip_on_a_copy_of_the_real_install(version, tmp_path, capsys):
    site = patched_copy(version, tmp_path)
    files = touched(version)
    before = tree_sha(site, files)
    code, rows = patch(capsys, "check", "--site-packages", str(site), "--only", FIXES[0], "--only", FIXES[1])
    assert code == 0 and {row["state"] for row in rows.values()} == {"needed"}
    code, rows = patch(capsys, "apply", "--site-packages", str(site), "--only", FIXES[0], "--only", FIXES[1])
    assert code == 0 and {(r["action"], r["state"]) for r in rows.values()} == {("patched", "applied")}
    after = tree_sha(site, files)
    images = load().images["vllm"][version]
    for fix in FIXES:
        assert rows[fix]["variant"] == patch_file(fix, version).name
        fix_files = touched_files(patch_file(fix, version))
        assert {f: after[f] for f in fix_files} == {f: images[f][frozenset({fix})] for f in fix_files}
    code, rows = patch(capsys, "apply", "--site-packages", str(site), "--only", FIXES[0], "--only", FIXES[1])
    assert code == 0 and {r["action"] for r in rows.values()} == {"already applied"}
    code, rows = patch(capsys, "revert", "--site-packages", str(site), "--only", FIXES[0], "--only", FIXES[1])
    assert code == 0 and tree_sha(site, files) == before
    # the real install was never touched: its files are still the wheel's
    released = record_sha256("vllm", installed_site(version))
    assert tree_sha(installed_site(version), files) == {file: released[file] for file in files}


PATCHED = """
import json, logging, os, sys, warnings
warnings.simplefilter("ignore")
import torch, vllm, mtp_overlay
from mtp_overlay.fixes.vllm_mtp_drafter_load import FIX as DRAFTER_FIX, drafter_refit
from mtp_overlay.fixes.device_normalized_broadcast import FIX as BROADCAST_FIX
from mtp_overlay.bed.runtime.streams import HostStream, RecordingCommunicator, host_streams
from mtp_overlay.bed.steps.vllm_drafter import build_drafter, changed, drafter_environment, refit_stream, snapshot
from vllm.distributed.weight_transfer import nccl_engine, packed_tensor
from vllm.model_executor.model_loader.reload import layerwise
from vllm.model_executor.models import deepseek_mtp, nemotron_h_mtp, utils

out = {"version": vllm.__version__, "where": os.path.dirname(vllm.__file__)}
from vllm.v1.worker import gpu_model_runner, gpu_worker
from vllm.v1.worker.gpu import model_runner
modules = (nemotron_h_mtp, deepseek_mtp, layerwise, gpu_worker, gpu_model_runner, model_runner, packed_tensor, nccl_engine)
out["probes"] = [(DRAFTER_FIX if i < 6 else BROADCAST_FIX).probe(m).state for i, m in enumerate(modules)]
from mtp_overlay.patching.survey import patched_on_disk
out["status"] = {row.name: [row.state, row.patched] for row in mtp_overlay.status(patched=patched_on_disk) if row.name in ("vllm-mtp-drafter-load", "device-normalized-broadcast")}
said = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger(utils.__name__).addHandler(handler)

with drafter_environment():
    model = build_drafter("nemotron_h")
    for case, naming in (("native", "mtp.*"), ("positional", "positional")):
        before, start = snapshot(model), len(said)
        layerwise.initialize_layerwise_reload(model)
        for pair in refit_stream(model, naming, seed=8):
            model.load_weights([pair])
        layerwise.finalize_layerwise_reload(model, model.vllm_config_for_tests.model_config)
        out[case] = {"changed": changed(model, before), "said": said[start:]}
    # outside any refit boundary: each call judged at its end; one name twice in a call; a long tensor
    native = refit_stream(model, "mtp.*", seed=10, with_target_names=False)
    long = list(native)
    index = [name for name, _ in long].index("mtp.layers.0.mixer.q_proj.weight")
    long[index] = (long[index][0], torch.cat([long[index][1], torch.zeros(8, long[index][1].shape[1])]))
    positional = refit_stream(model, "positional", seed=11, with_target_names=False)
    for case, stream in (("repeated", native + [native[0]]), ("positional call", positional), ("long", long)):
        start = len(said)
        model.load_weights(iter(stream))
        out[case] = said[start:]
    os.environ["MTP_OVERLAY_STRICT"] = "1"
    try:
        with drafter_refit(model):
            model.load_weights(iter(refit_stream(model, "positional", seed=9)))
        out["strict"] = None
    except RuntimeError as exc:
        out["strict"] = str(exc)

meta = torch.device("meta")
stream = [("w", torch.zeros(3, device=meta)), ("filterbank", torch.rand(4)), ("b", torch.zeros(2, device=meta))]
with host_streams():
    group = RecordingCommunicator(meta)
    packed_tensor.packed_nccl_broadcast_producer(iter(stream), group, 0, lambda item: item[1], buffer_size_bytes=1 << 20)
    out["packed"] = [t.device.type for t in group.sent]
    group = RecordingCommunicator(meta)
    if hasattr(nccl_engine, "NCCLTrainerWeightTransferEngine"):
        from vllm.distributed.weight_transfer import base
        module = torch.nn.Linear(2, 3, device=meta)
        module.register_parameter("filterbank", torch.nn.Parameter(torch.rand(4), requires_grad=False))
        source = base.ModuleSource(module)
        engine = nccl_engine.NCCLTrainerWeightTransferEngine(client=None, source=source, packed=False)
        engine.model_update_group = group
        engine._broadcast(source, source.metadata)
    else:
        nccl_engine.NCCLWeightTransferEngine.trainer_send_weights(
            iter(stream), {"group": group, "packed": False, "stream": HostStream()})
    out["one_by_one"] = [t.device.type for t in group.sent]
print(json.dumps(out))
"""


# drafter freshness on the patched vLLM: its own Worker sessions and runners (the test bed's)
FRESHNESS = """
import json, logging, os, warnings
warnings.simplefilter("ignore")
import mtp_overlay
from mtp_overlay.fixes.vllm_mtp_drafter_load import refits_behind
from mtp_overlay.bed.steps.vllm_worker import RUNNERS, run_step, session, worker_environment
from vllm.model_executor.models import utils

said = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger(utils.__name__).addHandler(handler)
out = {}
with worker_environment() as bed:
    for runner in RUNNERS:
        worker = bed.worker(runner)
        for case, actions in (("stale", ("load_weights mtp.*", "target", "target", "execute")),
                              ("fresh", ("load_weights mtp.*", "target", "draft", "execute"))):
            logged = []
            for action in actions:
                start = len(said)
                step = run_step(bed, worker, action)
                logged.append(said[start:] + step.said)  # vLLM's log, and any OverlayWarning (none: stood down)
            out[f"{runner} {case}"] = {"said": logged, "behind": refits_behind(worker)}  # vLLM's count
    os.environ["MTP_OVERLAY_STRICT"] = "1"
    worker = bed.worker("v2")
    for action in ("load_weights mtp.*", "reload"):
        run_step(bed, worker, action)
    try:
        session(worker, bed.export_stream())
        out["strict"] = None
    except RuntimeError as exc:
        out["strict"] = [str(exc), worker._weight_update_active]
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=VERSIONS)
def patched_site(request, tmp_path_factory):
    """A patched copy of vLLM ``version``: ``(version, site)``."""
    version = request.param
    site = patched_copy(version, tmp_path_factory.mktemp("patched"))
    assert main(["patch", "apply", "--site-packages", str(site), "--only", FIXES[0], "--only", FIXES[1]]) == 0
    return version, site


def run_patched(site, code):
    """``code`` on the patched copy (the overlay imported: its hooks decide), not strict: its last JSON line."""
    environment = {key: value for key, value in os.environ.items() if key != "MTP_OVERLAY_STRICT"}
    result = run_with_release(site, code, env=environment, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def patched_vllm(patched_site):
    """Run `PATCHED` on the patched copy."""
    version, site = patched_site
    return version, site, run_patched(site, PATCHED)


@pytest.mark.slow
def test_patched_vllm_reports_a_stale_drafter_by_itself_and_the_hooks_stand_down(patched_vllm):
    version, site, out = patched_vllm
    assert (out["version"], out["where"]) == (version, str(site / "vllm"))
    assert out["probes"] == ["redundant"] * 8
    assert out["status"] == {fix: ["redundant", True] for fix in FIXES}
    assert len(out["native"]["changed"]) == 7 and out["native"]["said"] == []
    positional = out["positional"]
    assert positional["changed"] == [] and len(positional["said"]) == 1
    message = positional["said"][0]
    assert "refit #2 (vLLM layerwise reload: 10 load_weights call(s), 10 names)" in message
    assert "7 of 7 MTP parameters never loaded: model.layers.0.eh_proj.weight" in message
    assert "9 MTP checkpoint names dropped unrecognised: model.layers.2.mixer.q_proj.weight" in message
    assert out["strict"] is not None and "7 of 7 MTP parameters never loaded" in out["strict"]
    assert out["repeated"] == []  # one name twice in one call: no new refit, no false alarm
    [call] = out["positional call"]  # judged at the end of the call, not one refit later
    assert "one load_weights call outside any refit boundary (9 names): 9 MTP checkpoint names dropped" in call
    [long] = out["long"]
    assert "mtp.layers.0.mixer.q_proj.weight [40, 32] for [32, 32]" in long and "narrows" in long


@pytest.mark.slow
def test_patched_vllm_reports_a_drafter_a_target_refit_left_behind(patched_site):
    version, site = patched_site
    out = run_patched(site, FRESHNESS)
    for runner in ("v2", "v1"):
        stale, fresh = out[f"{runner} stale"], out[f"{runner} fresh"]
        assert [len(said) for said in stale["said"]] == [0, 0, 1, 0] and stale["behind"] == 2
        message = stale["said"][2][0]
        assert "vLLM MTP drafter NemotronHMTP is 1 target refit behind NemotronHForCausalLM" in message
        assert "seen at Worker.start_weight_update" in message
        hint = "Worker.start_draft_weight_update()" if version == VLLM else "This vLLM has no draft sessions"
        assert hint in message
        if version == VLLM:  # a draft session refreshes the drafter
            assert [len(said) for said in fresh["said"]] == [0, 0, 0, 0] and fresh["behind"] == 0
        else:  # 0.25 has none: the draft step is refused, the step reports the stale drafter
            assert [len(said) for said in fresh["said"]] == [0, 0, 0, 1] and fresh["behind"] == 1
    text, active = out["strict"]
    assert "is 1 target refit behind" in text and "GPUModelRunner.reload_weights" in text and active is False


@pytest.mark.slow
def test_patched_vllm_sends_every_refit_tensor_from_the_communicator_device(patched_vllm):
    _, _, out = patched_vllm
    assert out["packed"] == ["meta"]
    assert out["one_by_one"] == ["meta"] * 3


@pytest.mark.slow
def test_container_build_script_on_a_fresh_environment_with_vllm(tmp_path):
    """scripts/container_build.sh on a fresh venv holding (a linked copy of) the pinned vLLM: both vLLM
    patches land, `patch check` is clean, and a process that imports the overlay finds its hooks
    standing down (``redundant``)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.run([python, "-c", ask], capture_output=True, text=True, check=True).stdout.strip())
    link_installed("vllm", purelib, copies=touched(VLLM, VLLM_PATCHED))
    # the rest of the pinned stack is this venv's, seen through a .pth: the script's pip finds it satisfied
    (purelib / "pinned-stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(REPO, source, ignore=skip)

    build = subprocess.run(["bash", str(source / "scripts" / "container_build.sh")],
                           env={**os.environ, "PYTHON": str(python)}, capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout + build.stderr
    images = load().images["vllm"][VLLM]
    for fix in VLLM_PATCHED:
        assert f"{fix} (vllm {VLLM}, 0.33.patch): patched -> applied" in build.stdout
        fix_files = touched_files(patch_file(fix, VLLM))
        assert tree_sha(purelib, fix_files) == {f: images[f][frozenset({fix})] for f in fix_files}

    hooks = subprocess.run(
        [python, "-c", "import json, warnings; warnings.simplefilter('ignore'); import mtp_overlay\n"
         "import vllm.model_executor.models.nemotron_h_mtp, vllm.model_executor.models.deepseek_mtp\n"
         "import vllm.model_executor.model_loader.reload.inplace, vllm.distributed.weight_transfer.nccl_engine\n"
         "import vllm.renderers.online_renderer\n"
         "from mtp_overlay.patching.survey import patched_on_disk\n"
         "print(json.dumps({r.name: [r.state, r.patched] for r in mtp_overlay.status(patched=patched_on_disk)\n"
         "                  if r.distribution == 'vllm'}))"],
        capture_output=True, text=True, timeout=900, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert hooks.returncode == 0, hooks.stderr[-3000:]
    states = json.loads(hooks.stdout.strip().splitlines()[-1])
    assert states.pop("vllm-media-placeholders") == ["installed", None]  # no source patch: its hooks stay on
    assert states == {fix: ["redundant", True] for fix in VLLM_PATCHED}
