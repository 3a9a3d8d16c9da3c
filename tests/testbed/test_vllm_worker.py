"""The vLLM Worker test bed (mtp_overlay.bed.steps.vllm_worker): vLLM 0.33's own weight-update
sessions on CPU with the tiny NemotronH target and the real NemotronHMTP drafter, and the stale
drafter they leave on stock.

Every vLLM fix is uninstalled for this module (stock vLLM); one bed is built for it. The counts are
derived: the drafter's own parameters from its modules (those it does not share with the target), the
MTP head's checkpoint names from the checkpoint the bed wrote.
"""

import functools
import inspect
import os

import pytest
import torch

import mtp_overlay
from mtp_overlay.bed.steps.vllm_worker import (
    ENGINES,
    RUNNERS,
    SEQUENCES,
    execute_model_stopped,
    run_sequence,
    worker_environment,
)

VLLM_FIXES = [name for name, targets in mtp_overlay.FIXES if all(t.startswith("vllm.") for t in targets)]


@pytest.fixture(scope="module")
def bed():
    before = {row.name: row.state for row in mtp_overlay.status(only=VLLM_FIXES)}
    mtp_overlay.uninstall(only=VLLM_FIXES)
    try:
        with worker_environment() as built:
            yield built
    finally:
        mtp_overlay.install(only=[name for name, state in before.items() if state in ("installed", "pending")])


def vllm_file(function):
    import vllm

    return inspect.getsourcefile(inspect.unwrap(function)).startswith(os.path.dirname(vllm.__file__) + os.sep)


# --- the bed runs vLLM's own objects -------------------------------------------------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_worker_runs_vllms_own_session_methods_runner_and_engine(bed, runner):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM
    from vllm.model_executor.models.nemotron_h_mtp import NemotronHMTP
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.gpu import model_runner

    worker = bed.worker(runner)
    assert type(worker) is gpu_worker.Worker
    for name in ("start_weight_update", "start_draft_weight_update", "update_weights", "finish_weight_update",
                 "supports_draft_weight_updates"):
        assert name not in vars(worker) and vllm_file(getattr(type(worker), name)), name
        assert inspect.unwrap(getattr(type(worker), name)).__module__ == "vllm.v1.worker.gpu_worker"
    expected = {"v2": model_runner.GPUModelRunner, "v1": gpu_model_runner.GPUModelRunner}[runner]
    assert type(worker.model_runner) is expected
    for name in ("get_model", "get_draft_model", "reset_lora_state", "reload_weights", "execute_model"):
        assert name not in vars(worker.model_runner) and vllm_file(getattr(expected, name)), name
    assert type(worker.weight_transfer_engine) is NCCLWeightTransferEngine
    assert type(bed.target) is NemotronHForCausalLM and type(bed.drafter) is NemotronHMTP
    assert worker.model_runner.get_model() is bed.target and worker.model_runner.get_draft_model() is bed.drafter
    assert worker.weight_transfer_engine.model is bed.target and worker.supports_draft_weight_updates()
    # vLLM's load_eagle_model shares the target's embedding and LM head with the drafter
    assert bed.drafter.model.embed_tokens is bed.target.model.embed_tokens and bed.drafter.lm_head is bed.target.lm_head
    assert bed.config.use_v2_model_runner  # 0.33 runs NemotronH + MTP on Model Runner V2 by default


def test_the_checkpoint_holds_the_target_and_the_mtp_head_which_the_target_drops(bed):
    """The target's checkpoint names as transformers writes them, the MTP head beside them; vLLM's
    NemotronH name mapper drops exactly the head (``"mtp": None``) and the drafter reads exactly it."""
    names = [name for name, _, _ in bed.checkpoint]
    assert bed.mtp_names and set(bed.mtp_names) < set(names)
    mapper = type(bed.target).hf_to_vllm_mapper
    assert [name for name in names if mapper.map_name(name) is None] == bed.mtp_names
    assert [name for name in names if not bed.drafter.is_unused_checkpoint_weight(name)] == bed.mtp_names
    layers = sorted(name for name, _ in bed.drafter.named_parameters() if name.startswith("model.layers."))
    assert bed.drafter_parameters() == layers  # its own: the MTP block
    assert bed.shared_parameters() == ["lm_head.weight", "model.embed_tokens.weight"]


# --- the stale drafter on stock ----------------------------------------------------------------


def assert_target_refit(bed, step):
    """The whole target took the new values, the drafter's own parameters none, the shared ones did."""
    assert step.error is None and step.calls >= 1
    assert step.mtp_sent == bed.mtp_names  # the MTP head was in the stream
    assert step.target_changed and len(step.target_changed) == step.target_parameters
    assert step.drafter_changed == [] and step.drafter_parameters == bed.drafter_parameters()
    assert step.shared_changed == bed.shared_parameters()
    assert step.layerwise == [("begin", "target"), ("end", "target")]


@pytest.mark.parametrize("runner", RUNNERS)
def test_target_sessions_carrying_the_mtp_head_leave_the_drafter_stale(bed, runner):
    steps = run_sequence(bed, SEQUENCES["target, target"], runner=runner)
    for step in steps:
        assert_target_refit(bed, step)
    target = dict(bed.target.named_parameters())
    sent = dict(steps[-1].stream)
    assert torch.equal(target["model.norm_f.weight"], sent["backbone.norm_f.weight"])

    chunked = run_sequence(bed, ("target",), runner=runner, chunk=5)[0]  # one update_weights per 5 tensors
    assert chunked.calls == -(-len(chunked.sent) // 5) > 1
    assert_target_refit(bed, chunked)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_draft_session_refreshes_the_drafter_and_the_next_target_session_leaves_it_behind(bed, runner):
    first, draft, last = run_sequence(bed, SEQUENCES["target, draft, target"], runner=runner)
    assert_target_refit(bed, first)
    assert_target_refit(bed, last)
    assert draft.error is None and draft.mtp_sent == draft.sent
    assert draft.drafter_changed == draft.drafter_parameters == bed.drafter_parameters()
    assert draft.target_changed == [] and draft.shared_changed == []
    assert draft.layerwise == [("begin", "drafter"), ("end", "drafter")]
    drafter, sent = dict(bed.drafter.named_parameters()), dict(draft.stream)
    assert torch.equal(drafter["model.layers.0.eh_proj.weight"], sent["mtp.layers.0.eh_proj.weight"])


@pytest.mark.parametrize("runner", RUNNERS)
def test_reload_weights_refits_the_target_only(bed, runner):
    draft, reload = run_sequence(bed, SEQUENCES["draft, reload"], runner=runner)
    assert draft.drafter_changed == bed.drafter_parameters()
    assert_target_refit(bed, reload)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_builds_on_cpu_and_those_without_draft_sessions_refuse_them(bed, engine):
    """The engines vLLM makes for ``weight_transfer_config.backend``; those that receive only over
    their own transport (all but NCCL here) run their sessions without chunks."""
    worker = bed.worker(engine=engine)
    cls = type(worker.weight_transfer_engine)
    assert worker.supports_draft_weight_updates() is cls.supports_draft_weight_update
    target, draft = run_sequence(bed, ("target", "draft"), worker=worker)
    assert target.error is None and not worker._weight_update_active
    if cls.supports_draft_weight_update:
        assert draft.error is None and draft.layerwise == [("begin", "drafter"), ("end", "drafter")]
    else:
        assert draft.error == f"RuntimeError: {cls.__name__} does not support draft model weight updates."
        assert draft.layerwise == [] and draft.drafter_changed == [] and not worker._weight_update_active
    if engine == "nccl":
        assert target.calls == 1 and draft.drafter_changed == bed.drafter_parameters()
    else:
        assert target.calls == draft.calls == 0 and target.target_changed == []


def test_which_refits_go_through_the_layerwise_reload_of_the_target(bed):
    """vLLM 0.33: every target session of a checkpoint-format engine and reload_weights; not the
    sparse patches (in place) nor m2n without fallback entries; never a direct load_weights."""
    found = {engine: run_sequence(bed, ("target",), engine=engine)[0].layerwise for engine in ENGINES}
    assert found == {"nccl": [("begin", "target"), ("end", "target")], "ipc": [("begin", "target"), ("end", "target")],
                     "sparse_nccl": [], "nccl_m2n": [], "sharded_rdt": [("begin", "target"), ("end", "target")]}
    direct = run_sequence(bed, ("load_weights mtp.*",))[0]
    assert direct.layerwise == [] and direct.drafter_changed == bed.drafter_parameters()


@pytest.mark.parametrize("runner", RUNNERS)
def test_vllm_resets_the_runners_lora_state_once_per_target_refit_and_never_for_the_drafter(bed, runner):
    """vLLM 0.33 calls ``reset_lora_state`` where the target's weights were replaced: after a
    target session (``Worker.finish_weight_update``) and in ``reload_weights``, once each; V2's
    override calls the mixin's once (``super()``)."""
    from unittest import mock

    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    original = vars(LoRAModelRunnerMixin)["reset_lora_state"]
    calls = []

    def counting(self):
        calls.append(self)
        return original(self)

    worker = bed.worker(runner)
    counts = []
    with mock.patch.object(LoRAModelRunnerMixin, "reset_lora_state", counting):
        for action in ("target", "draft", "reload", "load_weights mtp.*", "execute"):
            before = len(calls)
            run_sequence(bed, (action,), worker=worker)
            counts.append(len(calls) - before)
    assert counts == [1, 0, 1, 0, 0] and set(calls) == {worker.model_runner}


# --- execute_model: the real method, its body stopped at its first statement ---------------------


@pytest.mark.parametrize("runner", RUNNERS)
def test_execute_model_runs_wrappers_on_vllms_methods_and_stops_in_the_runners_body(bed, runner):
    """A wrapper on ``Worker.execute_model`` and one on the runner's run first (what a fix does:
    decide, then call upstream); vLLM's Worker body runs to the runner's, whose first statement stops."""
    from unittest import mock

    worker = bed.worker(runner)
    seen = []

    def wrapping(owner):
        original = vars(owner)["execute_model"]

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            seen.append(self)
            return original(self, *args, **kwargs)

        return mock.patch.object(owner, "execute_model", wrapper)

    owner = type(worker.model_runner)
    with wrapping(type(worker)), wrapping(owner):
        step = run_sequence(bed, ("execute",), worker=worker)[0]
    assert seen == [worker, worker.model_runner]
    path, line = step.stopped_at.rsplit(":", 1)
    if runner == "v1":  # vLLM's own guard, the body's first statement
        assert step.error.startswith("RuntimeError: State error")
        stopped_in = inspect.unwrap(vars(owner)["execute_model"])
    else:  # the body's first statement asks the pipeline handler for the last step's outputs
        assert step.error.startswith("StopStep")
        stopped_in = owner.update_pp_decode_requests
    first, lines = stopped_in.__code__.co_firstlineno, len(inspect.getsourcelines(stopped_in)[0])
    assert inspect.getsourcefile(stopped_in).endswith(path) and first < int(line) < first + lines
    assert step.target_changed == step.drafter_changed == step.shared_changed == []
    if runner == "v1":
        assert worker.model_runner.execute_model_state is None  # as vLLM keeps it between steps


def test_execute_model_stopped_refuses_a_runner_whose_body_never_ran(bed):
    from unittest import mock

    worker = bed.worker("v1")

    def replaced(self, *args, **kwargs):
        raise RuntimeError("not vLLM's body")

    with mock.patch.object(type(worker.model_runner), "execute_model", replaced):
        with pytest.raises(AssertionError, match="before vLLM's body ran .*gpu_model_runner.py"):
            execute_model_stopped(worker)


# --- the per-call half: two load_weights calls that look like one complete refit -------------------


def test_a_positional_call_then_an_mtp_call_loads_nothing_then_everything_silently(bed):
    positional, native = run_sequence(bed, SEQUENCES["positional call, mtp.* call"])
    assert positional.mtp_sent and positional.error is None  # returned normally
    assert positional.drafter_loaded == positional.drafter_changed == []
    assert native.drafter_loaded == native.drafter_changed == bed.drafter_parameters()


# --- the CPU stand-in ------------------------------------------------------------------------------


def test_accelerator_synchronize_stand_in_is_needed_scoped_and_steps_aside_with_an_accelerator():
    from unittest import mock

    from mtp_overlay.bed.runtime.streams import accelerator_synchronize_stand_in

    real = torch.accelerator.synchronize
    if not torch.accelerator.is_available():
        with pytest.raises(RuntimeError):
            real()  # what WeightTransferEngine.update_weights meets on a machine without a GPU
        with accelerator_synchronize_stand_in():
            assert torch.accelerator.synchronize() is None and torch.accelerator.synchronize is not real
    assert torch.accelerator.synchronize is real
    on_cuda = mock.patch("mtp_overlay.bed.runtime.streams.rank_device", lambda: torch.device("cuda", 0))
    with on_cuda, accelerator_synchronize_stand_in():  # a CUDA rank (device.rank_device): the real one stays
        assert torch.accelerator.synchronize is real


# --- vLLM 0.25.1 (installed side by side): target sessions, no draft sessions ------------------------

SCRIPT_0_25_1 = """
import dataclasses, json, warnings
warnings.simplefilter("ignore")
import vllm, mtp_overlay
from mtp_overlay.bed.steps.vllm_worker import ENGINES, RUNNERS, run_sequence, worker_environment
from vllm.distributed.weight_transfer import base
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.v1.worker.gpu_worker import Worker

mtp_overlay.uninstall()
out = {"version": vllm.__version__, "worker": sorted(vars(Worker)),
       "engines": sorted(WeightTransferEngineFactory._registry),
       "engine_flag": hasattr(base.WeightTransferEngine, "supports_draft_weight_update")}
with worker_environment() as bed:
    out["v2_default"], out["drafter_parameters"] = bed.config.use_v2_model_runner, bed.drafter_parameters()
    out["shared_parameters"], out["mtp_names"] = bed.shared_parameters(), bed.mtp_names
    actions = ("target", "draft", "load_weights mtp.*", "target", "reload", "execute")
    for runner in RUNNERS:
        out[runner] = [{k: v for k, v in dataclasses.asdict(step).items() if k != "stream"}
                       for step in run_sequence(bed, actions, runner=runner)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_0_25_1():
    from mtp_overlay.bed.runtime.releases import release_site, run_json

    return run_json(release_site("vllm", "0.25.1"), SCRIPT_0_25_1, timeout=900)


@pytest.mark.slow
def test_vllm_0_25_1_has_target_sessions_only(vllm_0_25_1):
    out = vllm_0_25_1
    assert out["version"] == "0.25.1"
    assert {"start_weight_update", "update_weights", "finish_weight_update", "reload_weights"} <= set(out["worker"])
    assert not {"start_draft_weight_update", "supports_draft_weight_updates", "get_draft_model"} & set(out["worker"])
    assert not out["engine_flag"] and set(out["engines"]) < set(ENGINES)
    assert out["v2_default"] is False  # 0.25.1 keeps hybrid models on the V1 runner


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS)
def test_vllm_0_25_1_target_refits_leave_the_drafter_stale_and_only_a_drafter_load_refreshes_it(vllm_0_25_1, runner):
    out = vllm_0_25_1
    target, draft, load, again, reload, execute = out[runner]
    for step in (target, again, reload):
        assert step["error"] is None and step["mtp_sent"] == out["mtp_names"]
        assert len(step["target_changed"]) == step["target_parameters"] > 0
        assert step["drafter_changed"] == [] and step["drafter_parameters"] == out["drafter_parameters"]
        assert step["shared_changed"] == out["shared_parameters"]
        assert step["layerwise"] == [["begin", "target"], ["end", "target"]]
    assert draft["error"] == "AttributeError: 'Worker' object has no attribute 'start_draft_weight_update'"
    assert draft["drafter_changed"] == draft["target_changed"] == []
    assert load["drafter_loaded"] == load["drafter_changed"] == out["drafter_parameters"] and load["layerwise"] == []
    assert execute["stopped_at"] and execute["target_changed"] == execute["drafter_changed"] == []
