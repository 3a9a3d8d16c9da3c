"""vllm-mtp-drafter-load on vLLM 0.25.1's real NemotronHMTP (installed side by side, run in a subprocess).

0.25.1's ``NemotronHMTP.load_weights`` reads only names starting with ``mtp.`` (and the embedding and
LM head it still owns): it drops positional names and, unlike the pinned vLLM, the ``language_model.mtp.*``
names of multimodal Nemotron-H checkpoints. It has no ``is_unused_checkpoint_weight``, so the fix
falls back to "nothing of the name's MTP layer was loaded" for dropped names.
"""

import json

import pytest

from mtp_overlay.bed.runtime.releases import release_site, run_with_release

pytestmark = pytest.mark.slow  # another vLLM release, installed side by side (~10 s to start it)

SCRIPT = """
import json, warnings
warnings.simplefilter("ignore")
import vllm, mtp_overlay
from mtp_overlay import OverlayError, OverlayWarning
from mtp_overlay.fixes.vllm_mtp_drafter_load import FIX, counted, drafter_refit, last_refit_report
from mtp_overlay.bed.steps.vllm_drafter import build_drafter, changed, drafter_environment, refit_stream, snapshot
from vllm.model_executor.model_loader.reload import layerwise
from vllm.model_executor.models import nemotron_h_mtp

NAME = "vllm-mtp-drafter-load"
out = {"version": vllm.__version__}
with drafter_environment():
    model = build_drafter("nemotron_h")
    parameters = sorted(name for name, _ in model.named_parameters() if counted(name))
    out["parameters"] = parameters
    out["probe"] = [FIX.probe(module).state for module in (nemotron_h_mtp, layerwise)]
    out["status"] = mtp_overlay.status(only=[NAME])[0].state
    cases = {"positional": ("positional", ""), "language_model": ("mtp.*", "language_model."), "native": ("mtp.*", "")}
    for case, (naming, prefix) in cases.items():
        stream = refit_stream(model, naming, seed=5, prefix=prefix)
        row = out[case] = {"sent": [name for name, _ in stream]}
        mtp_overlay.uninstall(only=[NAME])
        before = snapshot(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row["stock_loaded"] = sorted(model.load_weights(iter(stream)))
        row["stock_changed"] = changed(model, before)
        row["stock_said"] = [str(w.message) for w in caught if issubclass(w.category, OverlayWarning)]
        mtp_overlay.install(only=[NAME])
        before = snapshot(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layerwise.initialize_layerwise_reload(model)  # vLLM 0.25.1's own refit lifecycle
            for pair in refit_stream(model, naming, seed=6, prefix=prefix):  # one call per tensor, as 0.25.1's unpacked NCCL path
                model.load_weights([pair])
            layerwise.finalize_layerwise_reload(model, model.vllm_config_for_tests.model_config)
        report = last_refit_report(model)
        row["fixed"] = {"missing": report.missing, "dropped": report.dropped, "calls": report.calls,
                        "boundary": report.boundary, "changed": changed(model, before),
                        "said": [str(w.message) for w in caught if issubclass(w.category, OverlayWarning)]}
        mtp_overlay.install(only=[NAME], strict=True)
        try:
            with drafter_refit(model):
                model.load_weights(iter(stream))
            row["strict"] = None
        except OverlayError as exc:
            row["strict"] = str(exc)
        mtp_overlay.install(only=[NAME], strict=False)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_0_25_1():
    result = run_with_release(release_site("vllm", "0.25.1"), SCRIPT, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["positional", "language_model"])
def test_vllm_0_25_1_drops_these_names_silently_and_the_fix_reports_them(vllm_0_25_1, case):
    out, row = vllm_0_25_1, vllm_0_25_1[case]
    mtp_sent = row["sent"][:-1]  # the last name is the backbone's, ignored on purpose
    assert out["version"] == "0.25.1" and out["probe"] == ["needed", "needed"] and out["status"] == "installed"
    assert [name for name in row["stock_loaded"] if name in out["parameters"]] == []
    assert row["stock_changed"] == [] and row["stock_said"] == []
    fixed = row["fixed"]
    assert fixed["missing"] == out["parameters"] and fixed["dropped"] == mtp_sent
    assert (fixed["boundary"], fixed["calls"]) == ("vLLM layerwise reload", len(row["sent"]))
    assert fixed["changed"] == [] and len(fixed["said"]) == 1
    assert row["strict"] is not None and all(name in row["strict"] for name in out["parameters"] + mtp_sent)


def test_vllm_0_25_1_complete_refit_loads_everything_and_reports_nothing(vllm_0_25_1):
    out, row = vllm_0_25_1, vllm_0_25_1["native"]
    assert sorted(row["stock_changed"]) == sorted(name for name in out["parameters"] if name.startswith("model.layers."))
    fixed = row["fixed"]
    assert fixed["missing"] == fixed["dropped"] == fixed["said"] == [] and row["strict"] is None
    assert fixed["changed"] == row["stock_changed"]
