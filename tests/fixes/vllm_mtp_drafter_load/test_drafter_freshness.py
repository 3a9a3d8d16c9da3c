"""vllm-mtp-drafter-load's freshness half on vLLM's own Worker sessions, model runners and engines (CPU).

The test bed (`mtp_overlay.bed.steps.vllm_worker`) runs the pinned vLLM's real ``Worker.start_weight_update /
start_draft_weight_update / update_weights / finish_weight_update``, both model runners'
``reload_weights`` and ``execute_model`` (stopped at its first statement), the engine
``WeightTransferEngineFactory`` makes, and the tiny NemotronH target with vLLM's real NemotronHMTP
drafter. One bed for the module: the target and the drafter are the same objects in every worker, so
each sequence starts by refreshing the drafter (a direct ``load_weights`` of its head). Every sequence
also runs with the fix off from the same parameters and the same streams: the models are left exactly
as stock vLLM leaves them.
"""

import importlib
import traceback
import warnings

import pytest
import torch

import mtp_overlay
from mtp_overlay import OverlayError, OverlayWarning
from mtp_overlay.fixes.vllm_mtp_drafter_load import FIX, freshness, refits_behind
from mtp_overlay.mtp import rollout_mtp_metrics
from mtp_overlay.bed.runtime.releases import edited_module
from mtp_overlay.bed.steps.vllm_worker import (
    ENGINES,
    RUNNERS,
    SEQUENCES,
    put_back_after_a_failed_reload,
    run_step,
    session,
    worker_environment,
)

NAME = "vllm-mtp-drafter-load"
REFRESH = "load_weights mtp.*"  # the drafter's own load of its head: fresh against every target refit so far


@pytest.fixture(scope="module")
def bed():
    mtp_overlay.install(only=[NAME])
    with worker_environment() as built:
        yield built


@pytest.fixture
def overlay():
    """``overlay(on, strict=False)`` switches the fix; it is back on (not strict) after the test."""

    def switch(on, strict=False):
        mtp_overlay.uninstall(only=[NAME])
        if on:
            mtp_overlay.install(only=[NAME], strict=strict)

    yield switch
    switch(True)


def parameters(bed):
    """Every parameter of the target and the drafter's own, by role and name."""
    found = {("target", name): p for name, p in bed.target.named_parameters()}
    own = set(bed.drafter_parameters())
    found.update({("drafter", name): p for name, p in bed.drafter.named_parameters() if name in own})
    return found


def raw(tensor):
    return tensor.detach().reshape(-1).view(torch.uint8).clone()


def replay(bed, actions, runner="v2", engine="nccl", seed=7000):
    """Run ``actions`` on a fresh worker with the streams of ``seed``; ``(worker, steps, states)``, the
    state (bytes of every parameter) after each step."""
    bed.seed = seed
    worker = bed.worker(runner, engine)
    steps, states = [], []
    for action in actions:
        steps.append(run_step(bed, worker, action))
        states.append({key: raw(p) for key, p in parameters(bed).items()})
    return worker, steps, states


def stock_and_fixed(bed, overlay, actions, runner="v2", engine="nccl", strict=False):
    """``actions`` with the fix off, then on (``strict``) from the same parameters and streams; asserts
    both leave every parameter the same after every step; returns the fixed run's ``(worker, steps)``
    and the stock run's steps."""
    start = {key: p.detach().clone() for key, p in parameters(bed).items()}
    overlay(False)
    _, stock, stock_states = replay(bed, actions, runner, engine)
    with torch.no_grad():
        for key, p in parameters(bed).items():
            p.copy_(start[key])
    overlay(True, strict=strict)
    worker, fixed, fixed_states = replay(bed, actions, runner, engine)
    for index, (a, b) in enumerate(zip(stock_states, fixed_states)):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), (index, actions[index])
    for a, b in zip(stock, fixed):
        assert (a.target_changed, a.drafter_changed, a.shared_changed) == (b.target_changed, b.drafter_changed,
                                                                         b.shared_changed)
    return worker, fixed, stock


def said(steps):
    return [len(step.said) for step in steps]


# --- "target, target": one warning naming the stale drafter -----------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_target_target_warns_once_naming_the_stale_drafter(bed, overlay, runner):
    actions = (REFRESH, *SEQUENCES["target, target"], "execute")
    worker, steps, stock = stock_and_fixed(bed, overlay, actions, runner)
    assert said(stock) == [0, 0, 0, 0] and stock[1].drafter_changed == stock[2].drafter_changed == []  # the bug
    assert said(steps) == [0, 0, 1, 0]  # at the second target session's start; not again at the step
    message = steps[2].said[0]
    for part in ("vLLM MTP drafter NemotronHMTP is 1 target refit behind NemotronHForCausalLM",
                 "seen at Worker.start_weight_update", "last target refit #", "Worker.finish_weight_update "
                 "(NCCLWeightTransferEngine)", "Worker.start_draft_weight_update()"):
        assert part in message
    assert refits_behind(worker) == 2


@pytest.mark.parametrize("runner", RUNNERS)
def test_strict_mode_refuses_every_target_session_and_step_until_the_drafter_is_refreshed(bed, overlay, runner):
    from vllm.v1.core.sched.output import SchedulerOutput

    overlay(True, strict=True)
    worker = bed.worker(runner)
    first = [run_step(bed, worker, action) for action in (REFRESH, "target")]
    assert [step.error for step in first] == [None, None]
    before = {key: raw(p) for key, p in parameters(bed).items()}
    for attempt in ("first", "retry"):  # strict keeps refusing until the drafter is refreshed
        with pytest.raises(OverlayError, match="NemotronHMTP is 1 target refit behind"):
            session(worker, bed.export_stream())
        assert worker._weight_update_active is False, attempt  # vLLM never began the session
    with pytest.raises(OverlayError, match="seen at GPUModelRunner.execute_model"):
        worker.model_runner.execute_model(SchedulerOutput.make_empty())
    assert all(torch.equal(before[key], raw(p)) for key, p in parameters(bed).items())
    after = [run_step(bed, worker, action) for action in (REFRESH, "target")]  # refreshed: vLLM runs again
    assert [(step.error, step.said) for step in after] == [(None, [])] * 2 and refits_behind(worker) == 1


def test_a_target_session_that_raises_halfway_counts_as_the_target_refit_it_was(bed, overlay):
    """One wrong-shaped target tensor: vLLM's ``update_weights`` raises after its layerwise reload
    changed every target parameter (loaded, or put on the meta device). Stock says nothing; the fix counts
    the refit and the next step says the drafter is behind."""
    seen = {}
    for on in (False, True):
        overlay(on)
        worker = bed.worker("v2")
        run_step(bed, worker, REFRESH)
        stream = bed.export_stream()
        last = max(index for index, (name, _) in enumerate(stream) if name not in bed.mtp_names)
        name, tensor = stream[last]
        stream[last] = (name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))
        before = {name: raw(p) for name, p in bed.target.named_parameters()}
        with pytest.raises(AssertionError):
            session(worker, stream)
        changed = {p.device.type == "meta" or not torch.equal(raw(p), before[name])  # meta: not loaded back yet
                   for name, p in bed.target.named_parameters()}
        put_back_after_a_failed_reload(bed.target)
        seen[on] = changed, worker._weight_update_active, run_step(bed, worker, "execute").said
    assert seen[False] == ({True}, False, [])  # vLLM changed every target parameter, ended the session, no word
    (changed, active, said), behind = seen[True], refits_behind(worker)
    assert (changed, active, len(said), behind) == ({True}, False, 1, 1)
    assert "Worker.update_weights (NCCLWeightTransferEngine), which raised after vLLM began replacing" in said[0]
    assert [step.said for step in (run_step(bed, worker, a) for a in (REFRESH, "target"))] == [[], []]  # bed usable


@pytest.mark.parametrize("runner", RUNNERS)
def test_target_draft_target_says_nothing(bed, overlay, runner):
    actions = (REFRESH, *SEQUENCES["target, draft, target"])
    worker, steps, _ = stock_and_fixed(bed, overlay, actions, runner, strict=True)
    assert said(steps) == [0, 0, 0, 0] and steps[2].drafter_changed == bed.drafter_parameters()
    assert refits_behind(worker) == 1  # the last target refit: the next start or step will say it


# --- reload_weights and the step ------------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_target_refit_through_reload_weights_counts_once_and_the_next_step_says_so(bed, overlay, runner):
    actions = (REFRESH, "reload", "execute", "execute")
    worker, steps, _ = stock_and_fixed(bed, overlay, actions, runner)
    assert steps[1].layerwise == [("begin", "target"), ("end", "target")]  # the reload runs the layerwise one inside
    assert refits_behind(worker) == 1  # counted once
    assert said(steps) == [0, 0, 1, 0]
    assert "seen at GPUModelRunner.execute_model" in steps[2].said[0] and "GPUModelRunner.reload_weights" in steps[2].said[0]
    steps = [run_step(bed, worker, action) for action in (REFRESH, "target")]
    assert refits_behind(worker) == 1  # a target session, its layerwise reload inside: once


@pytest.mark.parametrize("runner", RUNNERS)
def test_strict_mode_stops_the_step_before_vllms_body(bed, overlay, runner):
    from vllm.v1.core.sched.output import SchedulerOutput

    overlay(True, strict=True)
    worker = bed.worker(runner)
    for action in (REFRESH, "reload"):
        run_step(bed, worker, action)
    body = importlib.import_module(type(worker.model_runner).__module__).__file__
    with pytest.raises(OverlayError, match="seen at GPUModelRunner.execute_model") as raised:
        worker.model_runner.execute_model(SchedulerOutput.make_empty())
    assert not any(frame.filename == body for frame in traceback.extract_tb(raised.value.__traceback__))


def test_the_step_reads_one_integer_while_nothing_is_owed(bed, overlay, monkeypatch):
    """Fresh drafter: ``execute_model`` never looks the runner up (the whole per-step cost is `_due`)."""
    worker = bed.worker("v2")
    run_step(bed, worker, REFRESH)
    assert freshness._due == 0

    def looked_up(runner):
        raise AssertionError("the step looked the runner up")

    monkeypatch.setattr(freshness, "of_runner", looked_up)
    step = run_step(bed, worker, "execute")
    assert step.stopped_at and step.said == []


# --- engines ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_that_cannot_update_the_drafter_is_named_at_the_first_refit(bed, overlay, engine):
    worker = bed.worker(engine=engine)
    can = type(worker.weight_transfer_engine).supports_draft_weight_update
    name = type(worker.weight_transfer_engine).__name__
    overlay(True, strict=True)  # the notice stays a warning: nothing is stale yet
    refresh, first = (run_step(bed, worker, action) for action in (REFRESH, "target"))
    assert refresh.said == [] and first.error is None
    assert first.said == ([] if can else [first.said[0]])
    if not can:
        assert f"engine {name} cannot update vLLM's MTP drafter NemotronHMTP" in first.said[0]
        assert "supports_draft_weight_update = False" in first.said[0]
    overlay(True)
    second = run_step(bed, worker, "target")
    assert len(second.said) == 1 and f"({name})" in second.said[0] and refits_behind(worker) == 2
    hint = "Worker.start_draft_weight_update()" if can else f"engine {name} cannot update the drafter"
    assert hint in second.said[0]


# --- the per-call half ------------------------------------------------------------------------------


def test_a_positional_call_is_reported_at_its_end_not_hidden_by_the_next_call(bed, overlay):
    actions = (REFRESH, *SEQUENCES["positional call, mtp.* call"])
    _, steps, stock = stock_and_fixed(bed, overlay, actions)
    assert said(stock) == [0, 0, 0] and stock[1].drafter_changed == []
    assert said(steps) == [0, 1, 0]
    assert f"{len(steps[1].mtp_sent)} MTP checkpoint names dropped unrecognised" in steps[1].said[0]
    assert "one load_weights call outside any refit boundary" in steps[1].said[0]
    assert steps[2].drafter_changed == bed.drafter_parameters()

    overlay(True, strict=True)
    with pytest.raises(OverlayError, match="dropped unrecognised"):
        bed.drafter.load_weights(iter(bed.draft_stream(naming="positional")))
    assert sorted(bed.drafter.load_weights(iter(bed.draft_stream()))) == bed.drafter_parameters()


# --- status, refits_behind, rollout metrics -------------------------------------------------------


def test_status_refits_behind_and_the_rollout_metrics_show_the_staleness(bed, overlay):
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    worker = bed.worker("v2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverlayWarning)
        for action in (REFRESH, "target", "target"):
            run_step(bed, worker, action)
    subjects = (worker, worker.model_runner, bed.target, bed.drafter)
    assert [refits_behind(subject) for subject in subjects] == [2, 2, 2, 2]
    assert refits_behind(torch.nn.Linear(1, 1)) is None
    row = mtp_overlay.status(only=[NAME])[0]
    [drafter] = row.details["drafters"]
    assert (drafter["drafter"], drafter["target"], drafter["refits_behind"]) == ("NemotronHMTP", "NemotronHForCausalLM", 2)
    assert drafter["engine"] == "NCCLWeightTransferEngine" and "NemotronHMTP 2 target refit(s) behind" in row.reason
    stats = SpecDecodingStats.new(1)
    stats.observe_draft(1, 0)
    metrics = rollout_mtp_metrics([stats], drafter_refits_behind=[refits_behind(worker)])
    assert metrics["rollout_drafter_refits_behind"] == 2.0
    run_step(bed, worker, "draft")
    assert refits_behind(worker) == 0 and mtp_overlay.status(only=[NAME])[0].details["drafters"][0]["refits_behind"] == 0


# --- probe ------------------------------------------------------------------------------------------


def test_probe_of_the_worker_the_runners_and_the_engine_base(bed, monkeypatch):
    from vllm.distributed.weight_transfer import base
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.gpu import model_runner

    for module in (gpu_worker, gpu_model_runner, model_runner):
        assert FIX.probe(module).state == "needed", module.__name__
    assert "start_draft_weight_update refreshes it" in FIX.probe(gpu_worker).reason
    assert {(gpu_worker.Worker, "start_weight_update"), (gpu_worker.Worker, "finish_weight_update"),
            (gpu_model_runner.GPUModelRunner, "execute_model"), (model_runner.GPUModelRunner, "reload_weights")} <= set(
        FIX.lifecycle.wrapped())
    monkeypatch.delattr(base.WeightTransferEngine, "supports_draft_weight_update")
    verdict = FIX.probe(gpu_worker)
    assert verdict.state == "drifted" and "declares no supports_draft_weight_update" in verdict.reason


PROBES = {
    "finish renamed": ("vllm.v1.worker.gpu_worker", "    def finish_weight_update(self) -> None:",
                       "    def end_weight_update(self) -> None:", "drifted", "Worker defines no finish_weight_update"),
    "runner without reload_weights": (
        "vllm.v1.worker.gpu_model_runner", "    def reload_weights(\n", "    def reload_all(\n", "drifted",
        "GPUModelRunner defines no reload_weights"),
    "worker patched on disk": (
        "vllm.v1.worker.gpu_worker", '        """Finish the current weight update session."""',
        '        """Finish the current weight update session."""\n        MTPDrafterRefits', "redundant",
        "patched on disk"),
}


@pytest.mark.parametrize(("module", "old", "new", "state", "reason"), list(PROBES.values()), ids=list(PROBES))
def test_probe_reports_drift_and_redundancy_of_the_freshness_targets(module, old, new, state, reason):
    verdict = FIX.probe(edited_module(importlib.import_module(module), (old, new)))
    assert verdict.state == state and reason in verdict.reason



# --- vLLM 0.25.1 (installed side by side): no draft sessions, only "no drafter load since the target refit" --

SCRIPT_0_25_1 = """
import json, warnings
warnings.simplefilter("ignore")
import vllm, mtp_overlay
from mtp_overlay.fixes.vllm_mtp_drafter_load import FIX, refits_behind
from mtp_overlay.bed.steps.vllm_worker import RUNNERS, run_step, worker_environment
from vllm.v1.worker import gpu_worker

mtp_overlay.install(only=["vllm-mtp-drafter-load"])
out = {"version": vllm.__version__}
SEQUENCES = {"stale": ("load_weights mtp.*", "target", "target", "execute"),
             "refreshed": ("load_weights mtp.*", "target", "load_weights mtp.*", "execute"),
             "reload": ("load_weights mtp.*", "reload", "execute")}
with worker_environment() as bed:
    out["probes"] = {module.__name__: [FIX.probe(module).state, FIX.probe(module).reason] for module in (gpu_worker,)}
    for runner in RUNNERS:
        for case, actions in SEQUENCES.items():
            worker = bed.worker(runner)
            steps = [run_step(bed, worker, action) for action in actions]
            out[f"{runner} {case}"] = {"said": [step.said for step in steps], "behind": refits_behind(worker),
                                       "draft": [step.drafter_changed for step in steps]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_0_25_1():
    from mtp_overlay.bed.runtime.releases import release_site, run_json

    return run_json(release_site("vllm", "0.25.1"), SCRIPT_0_25_1, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS)
def test_vllm_0_25_1_says_no_drafter_load_came_since_the_target_refit(vllm_0_25_1, runner):
    out = vllm_0_25_1
    assert out["version"] == "0.25.1"
    worker_probe = out["probes"]["vllm.v1.worker.gpu_worker"]
    assert worker_probe[0] == "needed" and "no draft sessions" in worker_probe[1]
    stale, refreshed, reload = (out[f"{runner} {case}"] for case in ("stale", "refreshed", "reload"))
    assert [len(said) for said in stale["said"]] == [0, 0, 1, 0] and stale["behind"] == 2
    message = stale["said"][2][0]
    assert "NemotronHMTP is 1 target refit behind" in message and "seen at Worker.start_weight_update" in message
    assert "has no draft sessions" in message and "start_draft_weight_update" not in message
    assert [len(said) for said in refreshed["said"]] == [0, 0, 0, 0] and refreshed["behind"] == 0
    assert refreshed["draft"][2]  # the direct load did refresh the drafter
    assert [len(said) for said in reload["said"]] == [0, 0, 1] and reload["behind"] == 1  # V2 runs V1's: once
