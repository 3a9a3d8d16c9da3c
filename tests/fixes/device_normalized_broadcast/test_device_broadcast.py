"""device-normalized-broadcast on the installed (pinned) vLLM's weight-transfer producer.

Every proof runs vLLM's own ``pack_tensors``, ``packed_nccl_broadcast_producer`` / consumer and
``NCCLTrainerWeightTransferEngine._broadcast``. On this CPU machine the communicator's device is
``meta`` (``torch.cat([cpu, meta])`` raises like ``torch.cat([cpu, cuda])`` does) or ``cpu`` for a
real 2-process gloo broadcast. The CUDA-stream no-ops and PyNcclCommunicator stand-ins are test
scaffolding from `mtp_overlay.bed.runtime.streams`.
"""

import json
import os
import types
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pins import VLLM

import mtp_overlay
from mtp_overlay.contract import State
from mtp_overlay.fixes.device_normalized_broadcast import FIX, to_device_stream
from mtp_overlay.lifecycle import Lifecycle
from mtp_overlay.bed.runtime import preloaded
from mtp_overlay.bed.runtime.launcher import _free_port
from mtp_overlay.bed.runtime.releases import edited_module, release_site, run_with_release
from mtp_overlay.bed.fixes import reproduce
from mtp_overlay.bed.runtime.streams import RecordingCommunicator, host_streams
from vllm.distributed.weight_transfer import base, nccl_engine, packed_tensor

NAME = "device-normalized-broadcast"
PRODUCER = "packed_nccl_broadcast_producer"
ENGINE = nccl_engine.NCCLTrainerWeightTransferEngine
BUFFER = 1024  # bytes: several chunks out of the streams below
HOST_CONSTANTS = ("audio.filterbank", "vision.norm_mean")


@pytest.fixture
def overlay():
    """``overlay(True/False)`` switches the fix; it is back on after the test."""

    def switch(on):
        mtp_overlay.uninstall(only=[NAME])
        if on:
            mtp_overlay.install(only=[NAME])

    yield switch
    switch(True)


def refit_tensors():
    """A trainer's export stream on the host: several dtypes, a 0-dim and a non-contiguous tensor."""
    generator = torch.Generator().manual_seed(6)
    return [
        ("embed.weight", torch.randn(16, 8, generator=generator).to(torch.bfloat16)),
        ("audio.filterbank", torch.rand(20, 6, generator=generator)),
        ("layers.0.weight", torch.randn(12, 10, generator=generator).to(torch.float16).t()),
        ("vision.norm_mean", torch.tensor([0.485, 0.456, 0.406])),
        ("layers.0.bias", torch.randn(10, generator=generator)),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("head.weight", torch.randn(20, 9, generator=generator)),
    ]


def placed(pairs, device, host=HOST_CONSTANTS):
    """The stream as a trainer hands it over: everything on ``device`` but the host constants."""
    return [(name, tensor if name in host else tensor.to(device)) for name, tensor in pairs]


def run_producer(pairs, group, module=packed_tensor, producer=None, buffer=BUFFER):
    """Run the real producer; return the chunks the real ``pack_tensors`` built, and the tensors it packed."""
    chunks, packed_inputs = [], []
    real_pack = module.pack_tensors

    def recording_pack(iterator, post_iter_func, *args, **kwargs):
        def recording_post(item):
            tensor = post_iter_func(item)
            packed_inputs.append(tensor)
            return tensor

        chunk = real_pack(iterator, recording_post, *args, **kwargs)
        if chunk is not None:
            chunks.append(chunk)
        return chunk

    producer = producer or getattr(module, PRODUCER)
    with mock.patch.object(module, "pack_tensors", recording_pack):
        producer(iter(pairs), group, 0, lambda item: item[1], buffer_size_bytes=buffer)
    return chunks, packed_inputs


def chunk_metadata(chunks):
    return [(c.names, c.shapes, c.dtypes, c.tensor_sizes, tuple(c.packed_tensor.shape)) for c in chunks]


# --- the packed path -------------------------------------------------------------------------


def test_host_tensor_breaks_stock_packing_and_the_fix_cures_it(overlay):
    meta = torch.device("meta")
    stream = placed(refit_tensors(), meta)
    with host_streams():
        overlay(False)
        with pytest.raises(RuntimeError, match="device"):
            run_producer(stream, RecordingCommunicator(meta))

        overlay(True)
        group = RecordingCommunicator(meta)
        chunks, packed_inputs = run_producer(stream, group)
        all_on_device, _ = run_producer(placed(refit_tensors(), meta, host=()), RecordingCommunicator(meta))

    assert len(chunks) > 1
    assert chunk_metadata(chunks) == chunk_metadata(all_on_device)
    assert [name for c in chunks for name in c.names] == [name for name, _ in stream]
    assert all(t.device == meta for t in packed_inputs)
    assert [t.device for t in group.sent] == [meta] * len(chunks)
    # tensors already on the communicator's device reached the buffer as the very same tensors
    on_device = [t for name, t in stream if name not in HOST_CONSTANTS]
    reached = [t for (name, _), t in zip(stream, packed_inputs) if name not in HOST_CONSTANTS]
    assert all(a is b for a, b in zip(on_device, reached)) and len(reached) == len(on_device)


def test_all_host_chunk_reaches_the_collective_on_the_communicator_device(overlay):
    host_only = [pair for pair in refit_tensors() if pair[0] in HOST_CONSTANTS]
    with host_streams():
        overlay(False)
        stock = RecordingCommunicator("meta")
        run_producer(host_only, stock, buffer=1 << 20)
        overlay(True)
        fixed = RecordingCommunicator("meta")
        run_producer(host_only, fixed, buffer=1 << 20)
    # stock hands PyNcclCommunicator a host buffer, which its broadcast asserts against
    assert [t.device.type for t in stock.sent] == ["cpu"]
    assert [t.device.type for t in fixed.sent] == ["meta"]
    assert fixed.sent[0].shape == stock.sent[0].shape


def test_tensors_already_on_the_device_are_not_copied(overlay):
    overlay(True)
    assert (packed_tensor, PRODUCER) in FIX.lifecycle.wrapped()  # the hooked producer runs below, not the stock one
    assert vars(packed_tensor)[PRODUCER].__wrapped__ is not vars(packed_tensor)[PRODUCER]
    stream = refit_tensors()
    pointers = [t.untyped_storage().data_ptr() for _, t in stream]
    with host_streams():
        group = RecordingCommunicator("cpu")
        _, packed_inputs = run_producer(stream, group)
    assert [t.untyped_storage().data_ptr() for t in packed_inputs] == pointers
    assert all(a is b for (_, a), b in zip(stream, packed_inputs))
    assert all(t.device.type == "cpu" for t in group.sent)


def test_every_producer_binding_is_hooked(overlay):
    """The engine imports the producer by name: its alias normalizes as well."""
    meta = torch.device("meta")

    def alias(*args, **kwargs):  # looked up at call time: the binding as overlay() left it
        return nccl_engine.packed_nccl_broadcast_producer(*args, **kwargs)

    with host_streams():
        overlay(False)
        with pytest.raises(RuntimeError, match="device"):
            run_producer(placed(refit_tensors(), meta), RecordingCommunicator(meta), producer=alias)
        overlay(True)
        chunks, _ = run_producer(placed(refit_tensors(), meta), RecordingCommunicator(meta), producer=alias)
    assert all(c.packed_tensor.device == meta for c in chunks)


# --- the trainer engine: one-by-one and packed ------------------------------------------------


def refit_module(device):
    """A module on ``device`` holding a non-learnable host constant that never followed ``.to(device)``."""
    with torch.device(device):
        module = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 4))
    module.register_parameter("filterbank", torch.nn.Parameter(torch.rand(5, 3), requires_grad=False))
    return module


def engine_broadcast(source, group, packed):
    engine = ENGINE(client=None, source=source, packed=packed, packed_buffer_size_bytes=256)
    engine.model_update_group = group
    engine._broadcast(source, source.metadata)
    return group.sent


def test_one_by_one_path_sends_the_host_parameter_on_the_communicator_device(overlay):
    meta = torch.device("meta")
    source = base.ModuleSource(refit_module(meta))
    parameters = dict(source.iter_full())
    with host_streams():
        overlay(False)
        stock = engine_broadcast(source, RecordingCommunicator(meta), packed=False)
        overlay(True)
        fixed = engine_broadcast(source, RecordingCommunicator(meta), packed=False)

    assert {t.device.type for t in stock} == {"meta", "cpu"}  # PyNcclCommunicator asserts on the cpu one
    assert [t.device for t in fixed] == [meta] * len(parameters)
    assert [(tuple(t.shape), t.dtype) for t in fixed] == [(m.shape, m.dtype) for m in source.metadata]
    for (name, original), sent in zip(parameters.items(), fixed):
        assert (sent is original) == (name != "filterbank")


def test_packed_engine_path_packs_the_host_parameter(overlay):
    meta = torch.device("meta")
    source = base.ModuleSource(refit_module(meta))
    with host_streams():
        overlay(False)
        with pytest.raises(RuntimeError, match="device"):
            engine_broadcast(source, RecordingCommunicator(meta), packed=True)
        overlay(True)
        sent = engine_broadcast(source, RecordingCommunicator(meta), packed=True)
    total = sum(m.dtype.itemsize * torch.Size(m.shape).numel() for m in source.metadata)
    assert {t.device for t in sent} == {meta} and sum(t.numel() for t in sent) == total


# --- a real 2-process gloo broadcast -----------------------------------------------------------


class GlooCommunicator(RecordingCommunicator):
    """What the producer and consumer call on PyNcclCommunicator, over torch.distributed gloo on the host."""

    def __init__(self):
        super().__init__("cpu")

    def broadcast(self, tensor, src, stream=None):
        assert tensor.device == self.device, f"communicator on {self.device}, tensor on {tensor.device}"
        torch.distributed.broadcast(tensor, src)


def wire_bytes(tensor):
    return tensor.contiguous().view(-1).view(torch.uint8).tolist()


def engine_module():
    torch.manual_seed(0)  # the same parameters on both ranks and in the test
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 4))


def gloo_rank(rank, port, writer):
    """One rank: the real producer (rank 0) or consumer (rank 1), stock then fixed, packed then one by one."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group, stream, source = GlooCommunicator(), refit_tensors(), base.ModuleSource(engine_module())
    results = {}
    try:
        with host_streams():
            for phase in ("stock", "fixed"):
                mtp_overlay.uninstall(only=[NAME])
                if phase == "fixed":
                    mtp_overlay.install(only=[NAME])
                received = []
                if rank == 0:
                    packed_tensor.packed_nccl_broadcast_producer(
                        iter(stream), group, 0, lambda item: item[1], buffer_size_bytes=BUFFER, num_buffers=2
                    )
                    engine_broadcast(source, group, packed=False)
                else:
                    shapes = ((name, (list(t.shape), t.dtype)) for name, t in stream)
                    packed_tensor.packed_nccl_broadcast_consumer(
                        shapes,
                        group,
                        0,
                        lambda pairs: received.extend((n, wire_bytes(t)) for n, t in pairs),
                        buffer_size_bytes=BUFFER,
                        num_buffers=2,
                        device="cpu",
                    )
                    for meta in source.metadata:
                        weight = torch.empty(meta.shape, dtype=meta.dtype)
                        group.broadcast(weight, src=0)
                        received.append((meta.name, wire_bytes(weight)))
                results[phase] = received
        writer.send(results)
    finally:
        dist.destroy_process_group()


def test_gloo_broadcast_of_an_all_on_device_stream_delivers_the_same_bytes_stock_and_fixed():
    """No regression in the byte stream: every tensor is already on the communicator's device, so stock
    and fixed must both deliver exactly the sent bytes through vLLM's real producer, consumer and engine
    over a real gloo broadcast. The bug itself is shown by the mixed-device tests above."""
    context = preloaded.context()
    port, processes, readers = _free_port(), [], []
    for rank in range(2):
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(target=gloo_rank, args=(rank, port, writer), daemon=True)
        process.start()
        writer.close()
        processes.append(process)
        readers.append(reader)
    try:
        assert readers[1].poll(240), "the consumer rank never answered"
        received = readers[1].recv()
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in processes] == [0, 0]

    sent = [(name, wire_bytes(tensor)) for name, tensor in refit_tensors()]
    sent += [(name, wire_bytes(tensor)) for name, tensor in engine_module().named_parameters()]
    assert received["stock"] == sent
    assert received["fixed"] == sent


# --- the public normalizer for trainers with their own producer --------------------------------


def layout(tensor):
    return tensor.shape, tensor.dtype, tensor.stride()


def test_to_device_stream_is_lazy_and_copies_only_what_is_elsewhere():
    pulled = []

    def export():
        for name, tensor in placed(refit_tensors(), "meta"):
            pulled.append(name)
            yield name, tensor

    stream = to_device_stream(export(), "meta")
    assert pulled == []
    name, tensor = next(stream)
    assert pulled == ["embed.weight"] and tensor.device.type == "meta"
    originals = dict(placed(refit_tensors(), "meta"))
    for name, tensor in to_device_stream(originals.items(), torch.device("meta")):
        original = originals[name]
        assert tensor.device.type == "meta"
        assert layout(tensor) == layout(original)
        assert (tensor is original) == (name not in HOST_CONSTANTS)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool]),
    transpose=st.booleans(),
)
def test_to_device_stream_keeps_names_shapes_dtypes_and_bytes(shape, dtype, transpose):
    tensor = torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    [(name, moved)] = list(to_device_stream([("w", tensor)], "meta"))
    assert name == "w" and layout(moved) == layout(tensor)
    [(name, same)] = list(to_device_stream([("w", tensor)], "cpu"))
    assert same is tensor and torch.equal(same, tensor)


@pytest.mark.parametrize(
    ("named_tensors", "device", "error", "message"),
    [
        ([], 1.5, TypeError, "device must be a torch.device, str or int"),
        ([], True, TypeError, "device must be"),
        ([], "gpu", ValueError, "device 'gpu'"),
        (5, "cpu", TypeError, "named_tensors must be an iterable of"),
    ],
)
def test_to_device_stream_rejects_bad_arguments_at_the_call(named_tensors, device, error, message):
    with pytest.raises(error, match=message):
        to_device_stream(named_tensors, device)


def test_cpu_only_torch_assertion_for_cuda_is_a_value_error_naming_the_device():
    # a torch built without CUDA raises AssertionError from torch.cuda._lazy_init for "cuda"
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this process: torch no longer calls _lazy_init")
    error = AssertionError("Torch not compiled with CUDA enabled")
    with mock.patch.object(torch.cuda, "_lazy_init", side_effect=error):
        with pytest.raises(ValueError, match="device 'cuda' is not a device .*not compiled with CUDA"):
            to_device_stream([], "cuda")


@pytest.mark.parametrize("pair", [("w",), ("w", [1.0]), torch.zeros(2)])
def test_to_device_stream_names_the_bad_item(pair):
    stream = to_device_stream([("ok", torch.zeros(1)), pair], "cpu")
    next(stream)
    with pytest.raises(TypeError, match=r"named_tensors\[1\] must be a \(name, tensor\) pair"):
        next(stream)


# --- probe: needed, redundant, drifted ---------------------------------------------------------


def edited(module, old, new):
    return edited_module(module, (old, new))


def test_probe_finds_stock_vllm_needs_the_fix():
    for module in (packed_tensor, nccl_engine):
        verdict = FIX.probe(module)
        assert verdict.state == "needed" and "refuses a host+meta stream" in verdict.reason
    row = mtp_overlay.status(only=[NAME])[0]
    assert (row.state, row.distribution, row.version) == ("installed", "vllm", VLLM)
    shows, evidence = reproduce(NAME)
    assert shows and "is not on the expected device" in evidence


def test_probe_finds_packing_that_normalizes_redundant():
    fixed = edited(
        packed_tensor,
        "packed = torch.cat(tensor_list, dim=0)",
        "packed = torch.cat([t.to(tensor_list[-1].device) for t in tensor_list], dim=0)",
    )
    verdict = FIX.probe(fixed)
    assert verdict.state == "redundant" and "normalizes devices" in verdict.reason


def test_a_platform_error_in_the_stock_run_is_not_taken_for_the_bug():
    """The probe runs stock pack_tensors on a host+meta stream; an error about anything but the
    devices (no driver, no memory) says nothing about the bug: failed, with the error, not needed."""
    broken = edited(
        packed_tensor,
        "packed = torch.cat(tensor_list, dim=0)",
        'raise RuntimeError("Found no NVIDIA driver on your system.")',
    )
    verdict = FIX.probe(broken)
    assert verdict.state == "failed" and "Found no NVIDIA driver" in verdict.reason
    assert verdict.state in State.FAILING


PRODUCER_GROUP = "    group: Any,\n    src: int,\n    post_iter_func"
ENGINE_META = 'meta: list[ParamMeta]) -> None:\n        """Drive'
DRIFTS = {
    "producer renamed": (packed_tensor, f"def {PRODUCER}(", "def packed_nccl_send(", f"has neither {PRODUCER}"),
    "producer argument renamed": (packed_tensor, PRODUCER_GROUP, PRODUCER_GROUP.replace("group", "comm"), "'comm'"),
    "pack_tensors argument renamed": (
        packed_tensor, "def pack_tensors(\n    iterator", "def pack_tensors(\n    stream", "pack_tensors('stream'"
    ),
    "engine method renamed": (
        nccl_engine,
        "def _broadcast(self, source",
        "def _send(self, source",
        f"has neither {ENGINE.__name__}._broadcast nor NCCLWeightTransferEngine.trainer_send_weights",
    ),
    "engine method argument added": (
        nccl_engine, ENGINE_META, ENGINE_META.replace("meta: list[ParamMeta])", "meta, stream=None)"), "'stream'"
    ),
}


@pytest.mark.parametrize(("module", "old", "new", "reason"), list(DRIFTS.values()), ids=list(DRIFTS))
def test_probe_reports_drift_naming_what_differs(module, old, new, reason):
    verdict = FIX.probe(edited(module, old, new))
    assert verdict.state == "drifted" and reason in verdict.reason


def test_older_producer_name_is_hooked_too():
    older = edited(packed_tensor, f"def {PRODUCER}(", "def packed_broadcast_producer(")
    assert FIX.probe(older).state == "needed"
    # its own bookkeeping: the registry's lifecycle keeps hooking the real vLLM
    fix = Lifecycle(NAME, FIX.declaration.modules, type(FIX)())
    fix.install(older)
    try:
        assert [attribute for _, attribute in fix.wrapped()] == ["packed_broadcast_producer"]
        with host_streams(older):
            stream, group = placed(refit_tensors(), "meta"), RecordingCommunicator("meta")
            chunks, _ = run_producer(stream, group, module=older, producer=older.packed_broadcast_producer)
        assert all(c.packed_tensor.device.type == "meta" for c in chunks)
    finally:
        fix.uninstall_wrappers()
    assert type(older.packed_broadcast_producer) is types.FunctionType


def test_probe_without_pack_tensors_still_needs_the_fix():
    older = edited(packed_tensor, "def pack_tensors(", "def _pack_inline(")
    verdict = FIX.probe(older)
    assert verdict.state == "needed" and "no pack_tensors" in verdict.reason


# --- lifecycle ---------------------------------------------------------------------------------


BINDINGS = [(packed_tensor, PRODUCER), (nccl_engine, PRODUCER), (ENGINE, "_broadcast")]


def test_late_install_applies_and_uninstall_restores_every_binding_by_identity(overlay):
    overlay(False)
    originals = [vars(owner)[attribute] for owner, attribute in BINDINGS]
    assert all(type(original) is types.FunctionType for original in originals)
    with host_streams(), pytest.raises(RuntimeError, match="device"):
        run_producer(placed(refit_tensors(), "meta"), RecordingCommunicator("meta"))

    mtp_overlay.install(only=[NAME])  # vLLM's modules are imported already: a late install
    row = mtp_overlay.status(only=[NAME])[0]
    assert (row.state, row.late) == ("installed", True)
    assert sorted(map(repr, FIX.lifecycle.wrapped())) == sorted(map(repr, BINDINGS))
    assert [vars(owner)[attribute].__wrapped__ for owner, attribute in BINDINGS] == originals
    with host_streams():
        chunks, _ = run_producer(placed(refit_tensors(), "meta"), RecordingCommunicator("meta"))
    assert all(c.packed_tensor.device.type == "meta" for c in chunks)

    mtp_overlay.install(only=[NAME])  # a second install never stacks
    assert [vars(owner)[attribute].__wrapped__ for owner, attribute in BINDINGS] == originals
    mtp_overlay.uninstall(only=[NAME])
    assert all(vars(owner)[attribute] is original for (owner, attribute), original in zip(BINDINGS, originals))
    assert mtp_overlay.status(only=[NAME])[0].state == "disabled"


IMPORT_ORDER = """
import json, sys, types, warnings
warnings.simplefilter("ignore")
overlay_first = ORDER == "overlay-first"
if overlay_first:
    import mtp_overlay
from vllm.distributed.weight_transfer import nccl_engine, packed_tensor
bindings = [(packed_tensor, "packed_nccl_broadcast_producer"), (nccl_engine, "packed_nccl_broadcast_producer"),
            (nccl_engine.NCCLTrainerWeightTransferEngine, "_broadcast")]
before = [vars(owner)[name] for owner, name in bindings]
import mtp_overlay
row = mtp_overlay.status(only=["device-normalized-broadcast"])[0]
originals = [getattr(b, "__wrapped__", b) if overlay_first else b for b in before]
wrapped = [vars(owner)[name].__wrapped__ is original for (owner, name), original in zip(bindings, originals)]
mtp_overlay.uninstall(only=["device-normalized-broadcast"])
restored = [vars(owner)[name] is original for (owner, name), original in zip(bindings, originals)]
print(json.dumps({"state": row.state, "late": row.late, "wrapped": wrapped, "restored": restored,
                  "plain": [type(o) is types.FunctionType for o in originals],
                  "same_producer": vars(nccl_engine)[bindings[0][1]] is vars(packed_tensor)[bindings[0][1]]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["overlay-first", "vllm-first"])
def test_every_binding_is_wrapped_once_and_restored_whatever_the_import_order(order):
    """Overlay first: the engine's ``from packed_tensor import`` binds an already hooked producer;
    vLLM first: the install is late. Either way each binding wraps the plain original once."""
    result = preloaded.run_python(f"ORDER = {order!r}\n" + IMPORT_ORDER, dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {"state": "installed", "late": order == "vllm-first", "same_producer": True}
    assert row == {**expected, "wrapped": [True] * 3, "restored": [True] * 3, "plain": [True] * 3}


# --- vLLM 0.25.1: the one-by-one path is the staticmethod NCCLWeightTransferEngine.trainer_send_weights ---


SEND_WEIGHTS_0_25 = """
import json, subprocess, sys, types, warnings
warnings.simplefilter("ignore")
import torch
import mtp_overlay
from vllm.distributed.weight_transfer import nccl_engine
from mtp_overlay.fixes.device_normalized_broadcast import FIX
from mtp_overlay.bed.runtime.streams import HostStream, RecordingCommunicator

NAME = "device-normalized-broadcast"
engine, args_class = nccl_engine.NCCLWeightTransferEngine, nccl_engine.NCCLTrainerSendWeightsArgs
meta = torch.device("meta")
stream = [("embed.weight", torch.randn(4, 3, device=meta)), ("audio.filterbank", torch.rand(5, 2)),
          ("step", torch.tensor(7)), ("head.weight", torch.randn(3, 2, dtype=torch.bfloat16, device=meta))]

def send(trainer_args):
    engine.trainer_send_weights(iter(stream), trainer_args)
    return trainer_args["group"] if isinstance(trainer_args, dict) else trainer_args.group

def summary(sent):
    return [(str(t.device), list(t.shape), str(t.dtype)) for t in sent]

row = mtp_overlay.status(only=[NAME])[0]
verdict = FIX.probe(nccl_engine)
original = vars(engine)["trainer_send_weights"].__wrapped__
hooked = {"staticmethod": isinstance(vars(engine)["trainer_send_weights"], staticmethod),
          "original_is_staticmethod": type(original) is staticmethod}

mtp_overlay.uninstall(only=[NAME])
hooked["restored"] = vars(engine)["trainer_send_weights"] is original
stock = summary(send({"group": RecordingCommunicator(meta), "packed": False, "stream": HostStream()}).sent)

mtp_overlay.install(only=[NAME])
as_dict = {"group": RecordingCommunicator(meta), "packed": False, "stream": HostStream()}
dict_sent = send(dict(as_dict)).sent
caller_dict = {"group": RecordingCommunicator(meta), "packed": False, "stream": HostStream()}
send(caller_dict)
called = []
as_dataclass = args_class(group=RecordingCommunicator(meta), stream=HostStream(),
                          post_iter_func=lambda item: called.append(item[0]) or item[1])
dataclass_sent = send(as_dataclass).sent
own_post_iter_func = called == [name for name, _ in stream]
check = subprocess.run([sys.executable, "-c", "import sys; from mtp_overlay.cli import main; "
                        "sys.exit(main(['check', '--only', NAME]))".replace("NAME", repr(NAME))],
                       capture_output=True, text=True)
print(json.dumps({
    "version": row.version, "state": row.state, "verdict": verdict.state, "hooked": hooked,
    "inputs": summary(t for _, t in stream), "stock": stock,
    "fixed_dict": summary(dict_sent), "fixed_dataclass": summary(dataclass_sent), "own": own_post_iter_func,
    "untouched": [a is b for (_, a), b in zip(stream, dict_sent)],
    "caller_args_kept": [sorted(caller_dict) == ["group", "packed", "stream"],
                         as_dataclass.post_iter_func((None, torch.ones(1))).device.type == "cpu"],
    "check_rc": check.returncode, "check_out": check.stdout + check.stderr[-2000:],
}))
"""


@pytest.fixture(scope="module")
def vllm_0_25_1():
    result = run_with_release(release_site("vllm", "0.25.1"), SEND_WEIGHTS_0_25, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_vllm_0_25_1_one_by_one_path_sends_a_host_tensor_and_the_fix_cures_it(vllm_0_25_1):
    """Real 0.25.1 ``trainer_send_weights(packed=False)``: stock hands the communicator a host tensor
    (PyNcclCommunicator refuses it); fixed, every tensor it is handed is on its device, same shape and
    dtype, and those already there are the very same objects. Dict and dataclass ``trainer_args``
    alike (the dataclass's own ``post_iter_func`` kept), the caller's object unchanged."""
    row = vllm_0_25_1
    on_meta = [["meta", shape, dtype] for _, shape, dtype in row["inputs"]]
    assert row["stock"] == row["inputs"] and any(device != "meta" for device, _, _ in row["stock"])
    assert row["fixed_dict"] == on_meta
    assert row["fixed_dataclass"] == on_meta and row["own"]
    assert row["untouched"] == [device == "meta" for device, _, _ in row["inputs"]]
    assert row["caller_args_kept"] == [True, True]


@pytest.mark.slow
def test_vllm_0_25_1_probe_needs_the_fix_and_its_staticmethod_is_restored_by_identity(vllm_0_25_1):
    row = vllm_0_25_1
    assert (row["version"], row["state"], row["verdict"]) == ("0.25.1", "installed", "needed")
    assert row["hooked"] == {"staticmethod": True, "original_is_staticmethod": True, "restored": True}
    assert row["check_rc"] == 0, row["check_out"]
    assert "device-normalized-broadcast" in row["check_out"] and "needed" in row["check_out"]


# --- a real CUDA device ------------------------------------------------------------------------


class NcclCommunicator:
    """PyNcclCommunicator's surface over torch.distributed NCCL (one process, world size 1)."""

    def __init__(self, device):
        self.device = device
        self.sent = []

    def broadcast(self, tensor, src, stream=None):
        torch.distributed.broadcast(tensor, src)
        self.sent.append(tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_tensor_in_a_cuda_refit_stream(overlay):
    import torch.distributed as dist

    cuda = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=cuda)
    try:
        stream = placed(refit_tensors(), cuda)
        overlay(False)
        with pytest.raises(RuntimeError, match="device"):
            run_producer(stream, NcclCommunicator(cuda))
        with pytest.raises((RuntimeError, ValueError)):  # an all-host chunk: NCCL refuses a host buffer
            run_producer(refit_tensors(), NcclCommunicator(cuda), buffer=1 << 20)

        overlay(True)
        group = NcclCommunicator(cuda)
        chunks, packed_inputs = run_producer(stream, group)
        torch.cuda.synchronize()
        assert all(t.device == cuda for t in group.sent)
        received = [byte for t in group.sent for byte in wire_bytes(t.cpu())]
        assert received == [byte for _, t in refit_tensors() for byte in wire_bytes(t)]
        assert all(a is b for (name, a), b in zip(stream, packed_inputs) if name not in HOST_CONSTANTS)

        source = base.ModuleSource(refit_module(cuda))
        sent = engine_broadcast(source, NcclCommunicator(cuda), packed=False)
        assert {t.device for t in sent} == {cuda}
    finally:
        dist.destroy_process_group()
