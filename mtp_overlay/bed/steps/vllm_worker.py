"""Test scaffolding, not product: vLLM's real weight-update sessions on CPU, with the tiny NemotronH
target and vLLM's real NemotronHMTP drafter.

What runs is vLLM's: ``Worker.start_weight_update / start_draft_weight_update / update_weights /
finish_weight_update / supports_draft_weight_updates`` (0.33 ``v1/worker/gpu_worker.py:1167,
1542-1660``); both GPU model runners' ``get_model / get_draft_model / reset_lora_state /
reload_weights / execute_model`` (Model Runner V2, ``v1/worker/gpu/model_runner.py``, is 0.33's
default for NemotronH with MTP; V1 is ``v1/worker/gpu_model_runner.py``); the weight-transfer engine,
made by ``WeightTransferEngineFactory.create_engine`` as ``Worker.load_model`` makes it; vLLM's
packed producer and consumer; the layerwise reload; the models, loaded by ``get_model`` and
``load_eagle_model`` (which shares the target's embedding and LM head with the drafter) from a
checkpoint that transformers' ``save_pretrained`` wrote, the MTP head in ``mtp.*`` names beside it.

What is the bed's: the Worker and the runner are made with ``__new__`` and handed only the attributes
those methods read; the wire between the trainer's producer and the engine is
`streams.RecordingCommunicator` / `streams.ReplayCommunicator` (no NCCL group:
``init_transfer_engine`` is not run, the engine is handed the group and the wire parameters it
would have recorded); CUDA streams are `streams.host_streams`; ``torch.accelerator.synchronize`` is
`streams.accelerator_synchronize_stand_in`. Only the NCCL engine receives on CPU (IPC needs CUDA
IPC handles, the others their own rendezvous); every engine is constructed, and its sessions run
from start to finish without chunks.

Usage::

    with worker_environment() as bed:
        steps = run_sequence(bed, SEQUENCES["target, target"])
        steps[-1].drafter_changed    # [] on stock: a target session never touches the MTP head

``execute_model`` cannot run on CPU (it needs request state, KV caches and a forward):
`execute_model_stopped` calls the real methods (whatever wraps them runs first) and the runner's
body stops at its first statement.
"""

import contextlib
import dataclasses
import os

from ..runtime.device import rank_device

RUNNERS = ("v2", "v1")
ENGINES = ("nccl", "ipc", "sparse_nccl", "nccl_m2n", "sharded_rdt")
RECEIVES_ON_CPU = ("nccl",)  # the others need CUDA IPC handles or their own rendezvous
PACKED_BUFFER_BYTES = 4096  # the wire's packed buffer: several chunks for the tiny model
PACKED_BUFFERS = 2
CHECKPOINT = "model.safetensors"


def target_vllm_config(directory, engine="nccl"):
    """The Worker's VllmConfig: the tiny NemotronH in ``directory`` as the model, its MTP head as the
    speculative drafter (``method="mtp"``), weights loaded from the checkpoint there, ``engine`` as
    the weight-transfer backend (sharded RDT refuses any executor but Ray's, so it gets that one)."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.config import WeightTransferConfig

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    target = ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype="float32")
    speculative = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=target,
                                    target_parallel_config=ParallelConfig())
    parallel = ParallelConfig(distributed_executor_backend="ray") if engine == "sharded_rdt" else ParallelConfig()
    return VllmConfig(model_config=target, speculative_config=speculative, parallel_config=parallel,
                      device_config=DeviceConfig(device=rank_device().type),
                      weight_transfer_config=WeightTransferConfig(backend=engine))


def write_checkpoint(directory, seed=0):
    """A tiny NemotronH checkpoint in ``directory``: transformers' ``NemotronHForCausalLM`` saved by
    ``save_pretrained`` (``backbone.*`` names, config.json), plus the MTP head in ``mtp.*`` names (as
    Nemotron-H MTP checkpoints carry it) in the same file. Returns ``([(name, shape, dtype)], the MTP
    head's names)``."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.model_executor.model_loader.utils import initialize_model

    from .vllm_drafter import refit_stream, tiny_config

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config("nemotron_h"), dtype=torch.float32).save_pretrained(directory)
    path = os.path.join(directory, CHECKPOINT)
    tensors = safetensors.torch.load_file(path)
    config = target_vllm_config(directory)
    with rank_device():  # the drafter's layout, to name its head: vLLM's own class, no weights
        skeleton = initialize_model(vllm_config=config, model_config=config.speculative_config.draft_model_config)
    head = refit_stream(skeleton, "mtp.*", seed=seed, with_target_names=False)
    tensors.update(head)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    return [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()], [name for name, _ in head]


@dataclasses.dataclass
class WorkerBed:
    """The tiny target and its drafter as vLLM loaded them, and the checkpoint's names, shapes and dtypes."""

    directory: str
    config: object  # the Worker's VllmConfig (NCCL engine)
    target: object  # NemotronHForCausalLM
    drafter: object  # NemotronHMTP, embedding and LM head shared with the target
    checkpoint: list  # [(name, shape, dtype)] in the file's order
    mtp_names: list  # the MTP head's names in it (mtp.*), as written beside transformers' names
    seed: int = 1000  # the last seed a fresh stream took

    def export_stream(self, seed=None):
        """``[(checkpoint name, fresh tensor)]`` of every tensor in the checkpoint, in its order (the
        target's and the MTP head's ``mtp.*``): what a trainer's full export sends."""
        import torch

        generator = torch.Generator().manual_seed(self._seed(seed))
        return [(name, torch.randn(shape, generator=generator, dtype=dtype)) for name, shape, dtype in self.checkpoint]

    def draft_stream(self, seed=None, naming="mtp.*"):
        """``[(checkpoint name, fresh tensor)]`` of the MTP head alone in ``naming`` (`vllm_drafter.NAMINGS`)."""
        from .vllm_drafter import refit_stream

        return refit_stream(self.drafter, naming, seed=self._seed(seed), with_target_names=False)

    def _seed(self, seed):
        if seed is None:
            self.seed += 1
            return self.seed
        return seed

    def role(self, model):
        """"target", "drafter", or the class name of another module."""
        return "target" if model is self.target else "drafter" if model is self.drafter else type(model).__name__

    def drafter_parameters(self):
        """The drafter's own parameters: all but those it shares with the target (by identity)."""
        shared = {id(p) for p in self.target.parameters()}
        return sorted(name for name, p in self.drafter.named_parameters() if id(p) not in shared)

    def shared_parameters(self):
        """The drafter's parameters that are the target's (its embedding and LM head)."""
        shared = {id(p) for p in self.target.parameters()}
        return sorted(name for name, p in self.drafter.named_parameters() if id(p) in shared)

    def worker(self, runner="v2", engine="nccl"):
        """A vLLM Worker (``Worker.__new__``) holding a fresh ``runner`` model runner over the bed's
        models and a fresh ``engine`` weight-transfer engine, no session open."""
        return make_worker(self, runner, engine)


@contextlib.contextmanager
def worker_environment(seed=0):
    """vLLM's world-size-1 gloo groups and the attention stand-in (`vllm_drafter.drafter_environment`),
    a checkpoint written to a temporary folder, and the models vLLM loads from it: yields a WorkerBed."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    from . import vllm_drafter

    with vllm_drafter.drafter_environment() as folder:
        directory = os.path.join(folder, "checkpoint")
        checkpoint, mtp_names = write_checkpoint(directory, seed)
        config = target_vllm_config(directory)
        with set_current_vllm_config(config), rank_device():
            target = get_model(vllm_config=config)
            drafter = load_eagle_model(target, config)
        yield WorkerBed(directory, config, target, drafter, checkpoint, mtp_names)


class StopStep(Exception):
    """Raised where the bed stops a model runner's ``execute_model`` (Model Runner V2's first statement)."""


class _StoppingPipelineHandler:
    """Model Runner V2's ``pp_handler`` as the bed hands it in: the first thing ``execute_model`` does
    (``update_pp_decode_requests``, 0.33 ``v1/worker/gpu/model_runner.py:1210-1211``) is ask it for
    the last step's sampled outputs; it stops the step there."""

    def get_prev_sampled_outputs(self):
        raise StopStep("the test bed stops execute_model at its first statement (no request state on CPU)")


def make_runner(bed, runner="v2"):
    """vLLM's GPU model runner of kind ``runner`` (`RUNNERS`), made with ``__new__`` and given what
    its ``get_model``, ``get_draft_model``, ``reset_lora_state``, ``reload_weights`` and the first
    statement of ``execute_model`` read."""
    if runner == "v2":
        from vllm.v1.worker.gpu import model_runner
        from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator

        made = model_runner.GPUModelRunner.__new__(model_runner.GPUModelRunner)
        speculator = MTPSpeculator.__new__(MTPSpeculator)
        speculator.model = bed.drafter
        fields = dict(speculator=speculator, encoder_cache=None, pooling_runner=None,
                      pp_handler=_StoppingPipelineHandler())
    elif runner == "v1":
        from vllm.v1.spec_decode.eagle import EagleProposer
        from vllm.v1.worker import gpu_model_runner

        made = gpu_model_runner.GPUModelRunner.__new__(gpu_model_runner.GPUModelRunner)
        proposer = EagleProposer.__new__(EagleProposer)
        proposer.model = bed.drafter
        # the class V1's __init__ makes, wherever the release defines it
        late_interaction = vars(gpu_model_runner)["LateInteractionRunner"]
        fields = dict(drafter=proposer, encoder_cache={}, late_interaction_runner=late_interaction(), mm_budget=None,
                      execute_model_state=None)
    else:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    config = bed.config
    fields.update(vllm_config=config, model_config=config.model_config, load_config=config.load_config,
                  lora_config=config.lora_config, model=bed.target)
    vars(made).update(fields)
    return made


def make_worker(bed, runner="v2", engine="nccl"):
    """vLLM's ``Worker`` made with ``__new__`` and given what its session methods read: the config, a
    `make_runner` runner, the engine ``WeightTransferEngineFactory`` makes for the runner's model (as
    ``Worker.load_model`` does, 0.33 ``v1/worker/gpu_worker.py:606-611``), its rank, and the session
    flags, pipeline sends and profiler as ``Worker.__init__`` leaves them (``_weight_update_is_draft``
    only where vLLM has draft sessions); its ``execute_model`` reads the last two."""
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.gpu_worker import Worker

    from ..runtime.streams import HostCommunicator

    config = bed.config if engine == "nccl" else target_vllm_config(bed.directory, engine)
    made = Worker.__new__(Worker)
    runner_object = make_runner(bed, runner)
    transfer = WeightTransferEngineFactory.create_engine(
        config.weight_transfer_config, config, rank_device(), runner_object.get_model())
    if engine == "nccl":  # what init_transfer_engine records from the trainer's init info (0.33)
        transfer.model_update_group = HostCommunicator(rank_device())
        if hasattr(transfer, "packed"):
            transfer.packed = True
            transfer.packed_buffer_size_bytes, transfer.packed_num_buffers = PACKED_BUFFER_BYTES, PACKED_BUFFERS
    vars(made).update(vllm_config=bed.config, speculative_config=bed.config.speculative_config,
                      model_runner=runner_object, weight_transfer_engine=transfer, rank=0,
                      _weight_update_active=False, _pp_send_work=[], profiler=None)
    if hasattr(Worker, "start_draft_weight_update"):
        made._weight_update_is_draft = False
    return made


def can_receive(worker):
    """Whether the worker's engine receives chunks on CPU (`RECEIVES_ON_CPU`: over the host wire)."""
    return worker.weight_transfer_engine.config.backend in RECEIVES_ON_CPU


def update_info(worker, stream):
    """The NCCL engine's per-chunk update info for ``stream``: names, dtypes, shapes, and where the
    release carries the wire parameters per chunk (vLLM 0.25.1; 0.33 takes them at init), those."""
    info = {"names": [name for name, _ in stream],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in stream],
            "shapes": [list(t.shape) for _, t in stream]}
    fields = {field.name for field in dataclasses.fields(worker.weight_transfer_engine.update_info_cls)}
    if "packed" in fields:
        info.update(packed=True, packed_buffer_size_bytes=PACKED_BUFFER_BYTES, packed_num_buffers=PACKED_BUFFERS)
    return info


def send(worker, stream):
    """One ``Worker.update_weights`` chunk: the trainer's packed producer puts ``stream`` on the host
    wire, vLLM's engine receives it into the session's model."""
    from vllm.distributed.weight_transfer import packed_tensor

    from ..runtime.streams import accelerator_synchronize_stand_in
    from ..runtime.streams import RecordingCommunicator, ReplayCommunicator, host_streams

    sender = RecordingCommunicator(rank_device())
    with host_streams():
        packed_tensor.packed_nccl_broadcast_producer(iter(stream), sender, 0, lambda item: item[1],
                                                     buffer_size_bytes=PACKED_BUFFER_BYTES, num_buffers=PACKED_BUFFERS)
    worker.weight_transfer_engine.model_update_group = ReplayCommunicator(sender.sent, rank_device())
    with host_streams(), accelerator_synchronize_stand_in():
        worker.update_weights(update_info(worker, stream))


def session(worker, stream, draft=False, chunk=None):
    """One weight-update session as a trainer drives it: ``start_weight_update`` (or
    ``start_draft_weight_update``), ``update_weights`` per ``chunk`` tensors of ``stream`` (one call when
    None; none when the engine cannot receive on CPU), ``finish_weight_update``. Returns the number
    of ``update_weights`` calls."""
    (worker.start_draft_weight_update if draft else worker.start_weight_update)()
    calls = 0
    if can_receive(worker) and stream:
        chunk = chunk or len(stream)
        for start in range(0, len(stream), chunk):
            send(worker, stream[start:start + chunk])
            calls += 1
    worker.finish_weight_update()
    return calls


def put_back_after_a_failed_reload(model):
    """After a refit that raised halfway through vLLM's layerwise reload of ``model`` (its layers left
    on the meta device, the reload's bookkeeping open), put every layer's own tensors back (a layer
    the reload finished keeps what it loaded) and close the bookkeeping, as vLLM's
    ``finalize_layerwise_processing`` does for a layer that loaded nothing: the bed's shared models
    stay usable for the next test."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()


def execute_model_stopped(caller):
    """``caller.execute_model(SchedulerOutput.make_empty())``, ``caller`` a bed Worker or model runner,
    through the class attribute (a wrapper installed on it runs first). A Worker's own
    ``execute_model`` runs up to its model runner's (0.33 ``v1/worker/gpu_worker.py:1334-1362``);
    the runner's body stops at its first statement: V1's own state guard (``execute_model_state`` is
    set: "State error", 0.33 ``gpu_model_runner.py:3911-3915``), V2's request-state update
    (`_StoppingPipelineHandler`). Returns ``(exception, "vllm/<file>:<line>")`` (the last frame in
    vLLM's code) after checking that the traceback went through every ``execute_model`` on the way,
    each in its own vLLM module."""
    import importlib
    import sys
    import traceback

    from vllm.v1.core.sched.output import SchedulerOutput

    runner = getattr(caller, "model_runner", caller)
    bodies = {(sys.modules[type(owner).__module__].__file__, "execute_model") for owner in (caller, runner)}
    sentinel = "state left by an execute_model without sample_tokens (test bed)"
    if "execute_model_state" in vars(runner):  # V1
        runner.execute_model_state = sentinel
    try:
        caller.execute_model(SchedulerOutput.make_empty())
    except (RuntimeError, StopStep) as stopped:
        frames = traceback.extract_tb(stopped.__traceback__)
        missing = bodies - {(frame.filename, frame.name) for frame in frames}
        if missing:
            raise AssertionError(f"{type(caller).__name__}.execute_model stopped before vLLM's body ran "
                                 f"({', '.join(sorted(path for path, _ in missing))}): {stopped!r}") from stopped
        package = os.path.dirname(importlib.import_module("vllm").__file__)
        last = [frame for frame in frames if frame.filename.startswith(package + os.sep)][-1]
        return stopped, f"vllm/{os.path.relpath(last.filename, package)}:{last.lineno}"
    finally:
        if "execute_model_state" in vars(runner):
            runner.execute_model_state = None
    raise AssertionError(f"{type(caller).__name__}.execute_model returned: the bed could not stop it "
                         "at its first statement")


# --- sequences ---------------------------------------------------------------------------------
# "target": a target session carrying the full export (the target's tensors and the mtp.* head);
# "draft": a draft session carrying the mtp.* head; "reload": GPUModelRunner.reload_weights of the
# full export (an iterator, checkpoint format); "execute": Worker.execute_model, its runner's
# stopped at its first statement; "load_weights <naming>": the drafter's own load_weights called
# directly on its head in that naming (what trainers that bypass the sessions do, and vLLM 0.25.1's
# only way to refit the drafter).
ACTIONS = ("target", "draft", "reload", "execute", "load_weights mtp.*", "load_weights positional")
SEQUENCES = {
    "target, target": ("target", "target"),
    "target, draft, target": ("target", "draft", "target"),
    "draft, reload": ("draft", "reload"),
    "positional call, mtp.* call": ("load_weights positional", "load_weights mtp.*"),
}


@dataclasses.dataclass
class Step:
    """What one action did. ``*_changed``: parameters whose bytes differ from before the action."""

    action: str
    runner: str  # "v2" or "v1"
    engine: str  # the engine's class name
    calls: int = 0  # update_weights / load_weights calls
    sent: list = dataclasses.field(default_factory=list)  # checkpoint names sent
    mtp_sent: list = dataclasses.field(default_factory=list)  # of them, the MTP head's (in any naming)
    stream: list = dataclasses.field(default_factory=list, repr=False)  # [(name, tensor)] sent
    target_parameters: int = 0
    target_changed: list = dataclasses.field(default_factory=list)
    drafter_parameters: list = dataclasses.field(default_factory=list)  # its own, not the target's
    drafter_changed: list = dataclasses.field(default_factory=list)
    shared_changed: list = dataclasses.field(default_factory=list)  # embedding and LM head (the target's)
    drafter_loaded: list = dataclasses.field(default_factory=list)  # load_weights' return, own parameters
    layerwise: list = dataclasses.field(default_factory=list)  # [("begin"|"end", role)]: vLLM's layerwise reload
    said: list = dataclasses.field(default_factory=list)  # OverlayWarning messages
    error: str = None  # "draft": what vLLM raised refusing it; "execute": where the body was stopped
    stopped_at: str = None  # "execute": "vllm/<file>:<line>" of that stop


def _raw(tensor):
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8)


def _snapshot(model):
    """``{name: bytes}`` of every parameter (bytes: a fresh parameter may hold NaN, which equals nothing)."""
    return {name: _raw(p).clone() for name, p in model.named_parameters()}


def _changed(model, before, names):
    import torch

    now = dict(model.named_parameters())
    return sorted(name for name in names if not torch.equal(_raw(now[name]), before[name]))


def runner_kind(runner):
    """"v2" for Model Runner V2, "v1" for the V1 runner."""
    return "v2" if type(runner).__module__.endswith(".gpu.model_runner") else "v1"


# every name vLLM calls its layerwise reload by: the engines import it from reload/__init__ when
# called, reload/inplace.py binds it at import (0.33), 0.25.1's V1 runner does (its reload_weights)
LAYERWISE = {"initialize_layerwise_reload": "begin", "finalize_layerwise_reload": "end"}
LAYERWISE_BINDINGS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload",
                      "vllm.model_executor.model_loader.reload.inplace", "vllm.v1.worker.gpu_model_runner")


@contextlib.contextmanager
def layerwise_reloads(bed):
    """Within it, every call of vLLM's layerwise reload (through any binding of `LAYERWISE_BINDINGS`
    that is imported) is appended to the yielded list as ``("begin"|"end", bed.role(model))``."""
    import sys
    from unittest import mock

    calls = []

    def recording(function, what):
        def record(*args, **kwargs):
            calls.append((what, bed.role(args[0] if args else kwargs.get("model"))))
            return function(*args, **kwargs)

        return record

    with contextlib.ExitStack() as stack:
        for module in filter(None, map(sys.modules.get, LAYERWISE_BINDINGS)):
            for name, what in LAYERWISE.items():
                if name in vars(module):
                    stack.enter_context(mock.patch.object(module, name, recording(vars(module)[name], what)))
        yield calls


def run_step(bed, worker, action, chunk=None):
    """Run one ``action`` (`ACTIONS`) on ``worker``; a `Step` saying what it sent, changed and called,
    what was said (OverlayWarnings) and what vLLM refused (``error``)."""
    import warnings

    from mtp_overlay import OverlayWarning

    if action not in ACTIONS:
        raise ValueError(f"action must be one of {', '.join(ACTIONS)}, got {action!r}")
    own, shared = bed.drafter_parameters(), bed.shared_parameters()
    step = Step(action, runner_kind(worker.model_runner), type(worker.weight_transfer_engine).__name__,
                drafter_parameters=own)
    before_target, before_drafter = _snapshot(bed.target), _snapshot(bed.drafter)
    step.target_parameters = len(before_target)
    if action in ("target", "reload"):
        step.stream = bed.export_stream()
        step.mtp_sent = [name for name, _ in step.stream if name in bed.mtp_names]
    elif action != "execute":
        step.stream = bed.draft_stream(naming="mtp.*" if action == "draft" else action.split()[-1])
        step.mtp_sent = [name for name, _ in step.stream]
    step.sent = [name for name, _ in step.stream]
    with warnings.catch_warnings(record=True) as caught, layerwise_reloads(bed) as step.layerwise:
        warnings.simplefilter("always")
        if action == "target":
            step.calls = session(worker, step.stream, chunk=chunk)
        elif action == "draft":
            try:
                step.calls = session(worker, step.stream, draft=True, chunk=chunk)
            except (RuntimeError, AttributeError) as refused:  # an engine without draft sessions; 0.25.1
                step.error = f"{type(refused).__name__}: {refused}"
        elif action == "reload":
            worker.model_runner.reload_weights(weights_iterator=iter(step.stream))
            step.calls = 1
        elif action == "execute":
            stopped, step.stopped_at = execute_model_stopped(worker)
            step.error = f"{type(stopped).__name__}: {stopped}"
        else:
            step.drafter_loaded = sorted(set(bed.drafter.load_weights(iter(step.stream))) & set(own))
            step.calls = 1
    step.said = [str(w.message) for w in caught if issubclass(w.category, OverlayWarning)]
    step.target_changed = _changed(bed.target, before_target, before_target)
    step.drafter_changed = _changed(bed.drafter, before_drafter, own)
    step.shared_changed = _changed(bed.drafter, before_drafter, shared)
    return step


def run_sequence(bed, actions, runner="v2", engine="nccl", worker=None, chunk=None):
    """Run ``actions`` in order on ``worker`` (a fresh `WorkerBed.worker` of ``runner`` and ``engine``
    when None); returns one `Step` per action."""
    worker = worker or bed.worker(runner, engine)
    return [run_step(bed, worker, action, chunk) for action in actions]
