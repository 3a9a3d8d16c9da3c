"""vllm-mtp-drafter-load on the pinned vLLM's real MTP drafters, built on CPU.

``NemotronHMTP`` (reads ``mtp.*``) and ``DeepSeekMTP`` (reads positional ``model.layers.<2>.``) are
made by vLLM's own ``initialize_model`` from tiny configs; their ``load_weights`` and weight loaders
are vLLM's. The one stand-in (attention backend selection on ``UnspecifiedPlatform``) lives in
`mtp_overlay.bed.steps.vllm_drafter`. DeepSeek loads run under ``disable_mtp_completeness_check``, as
vLLM's weight-transfer engines run every refit: its per-call layer check would fail any chunk.
"""

import contextlib
import types
import warnings

import pytest
import torch
from pins import VLLM

import mtp_overlay
from mtp_overlay.bed.runtime.releases import edited_module
from mtp_overlay import OverlayError, OverlayWarning
from mtp_overlay.fixes.vllm_mtp_drafter_load import (
    FIX,
    counted,
    discard_refit,
    drafter_refit,
    last_call_report,
    last_refit_report,
)
from mtp_overlay.bed.runtime.streams import RecordingCommunicator, ReplayCommunicator, host_streams
from mtp_overlay.bed.steps.vllm_drafter import (
    KINDS,
    TARGET_NAMES,
    build_drafter,
    changed,
    drafter_environment,
    refit_stream,
    snapshot,
)

NAME = "vllm-mtp-drafter-load"
NATIVE = {"nemotron_h": "mtp.*", "deepseek": "positional"}
FOREIGN = {"nemotron_h": "positional", "deepseek": "mtp.*"}


@pytest.fixture(scope="module")
def drafters():
    mtp_overlay.install(only=[NAME])
    with drafter_environment():
        yield {kind: build_drafter(kind) for kind in KINDS}


@pytest.fixture(autouse=True)
def no_open_refit(drafters):
    """Each test starts with no refit open on the drafters (a stale implicit one would be reported)."""
    for model in drafters.values():
        discard_refit(model)


@pytest.fixture
def overlay():
    """``overlay(on, strict=False)`` switches the fix; it is back on (not strict) after the test."""

    def switch(on, strict=False):
        mtp_overlay.uninstall(only=[NAME])
        if on:
            mtp_overlay.install(only=[NAME], strict=strict)

    yield switch
    switch(True)


def loading(model):
    """What vLLM's engines wrap every refit in (DeepSeek's per-call completeness check off)."""
    if type(model).__name__ != "DeepSeekMTP":
        return contextlib.nullcontext()
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    return disable_mtp_completeness_check()


@contextlib.contextmanager
def overlay_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = []
        yield found
    found.extend(str(w.message) for w in caught if issubclass(w.category, OverlayWarning))


def mtp_parameters(model):
    return sorted(name for name, _ in model.named_parameters() if counted(name))


def mtp_names(stream):
    return [name for name, _ in stream if name not in TARGET_NAMES.values()]


def refit(model, stream, chunk=None):
    """Load ``stream`` in calls of ``chunk`` pairs (one call when None); the loaded names of all calls."""
    chunk = chunk or len(stream)
    loaded = set()
    with loading(model):
        for start in range(0, len(stream), chunk):
            loaded |= model.load_weights(iter(stream[start:start + chunk]))
    return loaded


# --- stock drops the other naming without a word; the fix names what was dropped -----------------


@pytest.mark.parametrize("kind", KINDS)
def test_stock_silently_accepts_a_refit_in_the_other_naming_and_the_fix_reports_it(drafters, overlay, kind):
    model = drafters[kind]
    stream = refit_stream(model, FOREIGN[kind], seed=11)
    before = snapshot(model)

    overlay(False)
    with overlay_warnings() as said:
        loaded = refit(model, stream)
    assert [name for name in loaded if counted(name)] == []  # returned normally, loaded no MTP parameter
    assert changed(model, before) == [] and said == []  # the drafter kept its old head; nobody was told

    overlay(True)
    with overlay_warnings() as said, drafter_refit(model) as block:
        refit(model, stream)
    report = block.report
    assert report is last_refit_report(model) and not report.ok
    assert report.missing == mtp_parameters(model)
    assert report.dropped == mtp_names(stream)  # the backbone name is ignored on purpose, not reported
    assert len(said) == 1 and f"refit #{report.number}" in said[0]
    assert all(name in said[0] for name in report.missing + report.dropped)
    assert changed(model, before) == []

    overlay(True, strict=True)
    with pytest.raises(OverlayError) as raised, drafter_refit(model):
        refit(model, stream)
    assert all(name in str(raised.value) for name in report.missing + report.dropped)


@pytest.mark.parametrize("kind", KINDS)
def test_a_complete_refit_loads_every_parameter_and_reports_nothing(drafters, overlay, kind):
    model = drafters[kind]
    stream = refit_stream(model, NATIVE[kind], seed=12)
    before = snapshot(model)
    overlay(True, strict=True)
    with overlay_warnings() as said, drafter_refit(model) as block:
        refit(model, stream)
    assert block.report.ok and said == []
    assert block.report.names == len(stream) and block.report.calls == 1
    assert changed(model, before) == sorted(before)  # every MTP-layer parameter took the new values
    sent = dict(stream)
    layer = "model.layers.0." if kind == "nemotron_h" else "model.layers.2."
    eh_proj = "mtp.layers.0.eh_proj.weight" if kind == "nemotron_h" else "model.layers.2.eh_proj.weight"
    assert torch.equal(dict(model.named_parameters())[layer + "eh_proj.weight"], sent[eh_proj])


def test_nemotron_h_reads_the_multimodal_language_model_prefix(drafters, overlay):
    """The pinned vLLM strips ``language_model.`` (Nemotron-H VL checkpoints); 0.25.1 drops such names."""
    model = drafters["nemotron_h"]
    overlay(True, strict=True)
    with drafter_refit(model) as block:
        refit(model, refit_stream(model, "mtp.*", seed=13, prefix="language_model."))
    assert block.report.ok


# --- chunked refits ---------------------------------------------------------------------------


def test_chunked_refit_is_one_refit_with_one_report(drafters, overlay):
    """One tensor per call, as vLLM's unpacked NCCL path does: nothing is said until the refit ends,
    then once, naming exactly the chunk that came in the other naming."""
    model = drafters["nemotron_h"]
    stream = refit_stream(model, "mtp.*", seed=14)
    wrong = [i for i, (name, _) in enumerate(stream) if "eh_proj" in name]
    foreign = refit_stream(model, "positional", seed=14)
    stream[wrong[0]] = foreign[wrong[0]]
    overlay(True)
    with overlay_warnings() as said:
        with drafter_refit(model) as block:
            refit(model, stream, chunk=1)
            assert said == [] and last_refit_report(model) is not block.report
    assert len(said) == 1
    report = block.report
    assert (report.calls, report.names) == (len(stream), len(stream))
    assert report.missing == ["model.layers.0.eh_proj.weight"]
    assert report.dropped == ["model.layers.2.eh_proj.weight"]

    with overlay_warnings() as said, drafter_refit(model) as block:
        refit(model, refit_stream(model, "mtp.*", seed=15), chunk=2)
    assert block.report.ok and said == []


def test_calls_outside_a_refit_are_judged_at_their_end_and_never_loaded_when_the_next_refit_begins(drafters, overlay):
    """Without a boundary, each call is judged when it returns (names it dropped: at once, not one refit
    later), and the calls add up into a refit that ends when the next one sends its first name again:
    a complete one silently, one that left parameters unloaded with its report."""
    model = drafters["nemotron_h"]
    overlay(True)
    with overlay_warnings() as said:
        with drafter_refit(model) as block:
            refit(model, refit_stream(model, "mtp.*", seed=16))
        for seed in (17, 18):
            refit(model, refit_stream(model, "mtp.*", seed=seed), chunk=3)
    complete = last_refit_report(model)
    assert said == [] and complete.ok and complete.number == block.report.number + 1
    assert (complete.boundary, complete.calls, complete.names) == ("load_weights calls", 4, 10)
    assert last_call_report(model).ok and last_call_report(model).number is None

    with drafter_refit(model):  # closes the open (complete) implicit refit, silently
        refit(model, refit_stream(model, "mtp.*", seed=20))
    stale = refit_stream(model, "positional", seed=19)
    for start in range(0, len(stale), 3):
        chunk = stale[start:start + 3]
        with overlay_warnings() as said:
            model.load_weights(iter(chunk))
        call = last_call_report(model)
        assert call.dropped == mtp_names(chunk) and call.missing == [] and call.names == len(chunk)
        assert len(said) == (1 if mtp_names(chunk) else 0)
        assert all(name in said[0] for name in mtp_names(chunk)) if said else True
    with overlay_warnings() as said:
        model.load_weights(iter(refit_stream(model, "positional", seed=21)[:3]))  # the next refit begins
    report = last_refit_report(model)
    assert (report.calls, report.names) == (4, len(stale)) and report.missing == mtp_parameters(model)
    assert report.dropped == []  # said per call already
    assert len(said) == 2 and f"refit #{report.number}" in said[0] and "7 of 7" in said[0]


def test_one_name_twice_in_one_call_is_one_refit_not_a_false_alarm(drafters, overlay):
    """A stream that repeats a name (a trainer sending a tied tensor twice) loads everything; it is one
    call of one refit, not the start of the next (which would report the first as never loaded)."""
    model = drafters["nemotron_h"]
    stream = refit_stream(model, "mtp.*", seed=22)
    repeated = stream + [stream[0]]
    before = snapshot(model)
    overlay(True, strict=True)  # no refit open (the autouse fixture): this call begins one
    with overlay_warnings() as said:
        loaded = model.load_weights(iter(repeated))
    assert said == [] and set(mtp_parameters(model)) <= set(loaded)
    assert changed(model, before) == sorted(before) and last_call_report(model).ok
    with overlay_warnings() as said:
        model.load_weights(iter(refit_stream(model, "mtp.*", seed=23)))  # the next refit: the first closes
    assert said == [] and last_refit_report(model).ok and last_refit_report(model).names == len(repeated)


def test_a_chunk_with_only_a_name_mapped_outside_the_layer_is_no_false_alarm(drafters, overlay):
    """DeepSeek checkpoints carry an MTP layer's own embed_tokens, which DeepSeekMTP loads into the
    shared embedding: a chunk holding only it loads nothing of the layer, and is no dropped name."""
    model = drafters["deepseek"]
    embed = ("model.layers.2.embed_tokens.weight", torch.randn(*model.model.embed_tokens.weight.shape))
    overlay(True, strict=True)
    with overlay_warnings() as said, loading(model):
        loaded = model.load_weights(iter([embed]))
    assert "model.embed_tokens.weight" in loaded and said == [] and last_call_report(model).ok


OVERSIZED = {"nemotron_h": ("mtp.layers.0.mixer.q_proj.weight", "model.layers.0.mixer.qkv_proj.weight", 0),
             "deepseek": ("model.layers.2.mlp.gate_proj.weight", "model.layers.2.mtp_block.mlp.gate_up_proj.weight", 0)}


@pytest.mark.parametrize("kind", KINDS)
def test_an_oversized_tensor_is_truncated_silently_by_vllm_and_the_fix_names_its_shape(drafters, overlay, kind):
    """vLLM's parallel loaders narrow a checkpoint tensor to the parameter's slice: a shard 8 rows too
    long loads its first rows and nobody is told. The fix compares each MTP tensor with its layer."""
    model = drafters[kind]
    name, parameter, _ = OVERSIZED[kind]
    stream = refit_stream(model, NATIVE[kind], seed=24)
    index = [n for n, _ in stream].index(name)
    right = stream[index][1]
    long = torch.cat([right, torch.randn(8, *right.shape[1:], generator=torch.Generator().manual_seed(1))])
    stream[index] = (name, long)

    overlay(False)
    with overlay_warnings() as said, loading(model):
        loaded = model.load_weights(iter(stream))
    rows = dict(model.named_parameters())[parameter]
    assert parameter in loaded and said == []  # loaded, nothing said
    assert torch.equal(rows[: right.shape[0]], right)  # the first rows of the long tensor, the rest dropped

    overlay(True)
    with overlay_warnings() as said, drafter_refit(model) as block:
        refit(model, stream)
    assert block.report.mis_shaped == [(name, tuple(long.shape), tuple(right.shape))]
    assert block.report.missing == block.report.dropped == [] and len(said) == 1
    assert f"{name} {list(long.shape)} for {list(right.shape)}" in said[0]

    overlay(True, strict=True)
    with pytest.raises(OverlayError, match="another shape"), loading(model):
        model.load_weights(iter(stream))  # outside a refit: judged at the end of the call
    assert last_call_report(model).mis_shaped == block.report.mis_shaped


# --- vLLM's own refit lifecycle: the NCCL engine, packed, chunk by chunk ----------------------------


def engine_refit(model, stream, buffer=4096):
    """The trainer's packed producer into a host wire, then vLLM's NCCLWeightTransferEngine receiving it
    into ``model`` between ``start_weight_update`` and ``finish_weight_update``."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor

    sender = RecordingCommunicator("cpu")
    with host_streams():
        packed_tensor.packed_nccl_broadcast_producer(iter(stream), sender, 0, lambda item: item[1], buffer_size_bytes=buffer)
    engine = nccl_engine.NCCLWeightTransferEngine(
        WeightTransferConfig(backend="nccl"), model.vllm_config_for_tests, torch.device("cpu"), model)
    engine.model_update_group = ReplayCommunicator(sender.sent, "cpu")
    engine.packed, engine.packed_buffer_size_bytes = True, buffer
    info = engine.parse_update_info({
        "names": [name for name, _ in stream],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in stream],
        "shapes": [list(t.shape) for _, t in stream],
    })
    engine.start_weight_update()
    with host_streams():
        engine.receive_weights(info)
    engine.finish_weight_update()
    return len(sender.sent)


def test_vllm_engine_refit_is_reported_at_finish_weight_update(drafters, overlay):
    model = drafters["nemotron_h"]
    overlay(True, strict=True)
    native = refit_stream(model, "mtp.*", seed=19)
    chunks = engine_refit(model, native, buffer=8192)
    report = last_refit_report(model)
    assert chunks > 1 and report.ok and (report.boundary, report.calls) == ("vLLM layerwise reload", chunks)
    sent = dict(native)
    assert torch.equal(dict(model.named_parameters())["model.layers.0.enorm.weight"], sent["mtp.layers.0.enorm.weight"])

    before = snapshot(model)
    overlay(True)
    stale = refit_stream(model, "positional", seed=20)
    with overlay_warnings() as said:
        engine_refit(model, stale, buffer=8192)
    report = last_refit_report(model)
    assert report.missing == mtp_parameters(model) and report.dropped == mtp_names(stale)
    assert len(said) == 1 and changed(model, before) == []

    overlay(True, strict=True)
    with pytest.raises(OverlayError, match="never loaded"):
        engine_refit(model, refit_stream(model, "positional", seed=21), buffer=8192)


# --- lifecycle and probe ----------------------------------------------------------------------


def edited(module, old, new):
    return edited_module(module, (old, new))


def test_probe_install_and_uninstall_on_the_installed_vllm(drafters, overlay):
    from vllm.model_executor.model_loader.reload import inplace, layerwise
    from vllm.model_executor.models import deepseek_mtp, nemotron_h_mtp

    overlay(True)
    row = mtp_overlay.status(only=[NAME])[0]
    assert (row.state, row.distribution, row.version) == ("installed", "vllm", VLLM)
    bindings = [(nemotron_h_mtp.NemotronHMTP, "load_weights"), (deepseek_mtp.DeepSeekMTP, "load_weights"),
                (layerwise, "initialize_layerwise_reload"), (layerwise, "finalize_layerwise_reload"),
                (inplace, "initialize_layerwise_reload"), (inplace, "finalize_layerwise_reload")]
    assert set(bindings) <= set(FIX.lifecycle.wrapped())
    for module in (nemotron_h_mtp, deepseek_mtp, layerwise, inplace):
        assert FIX.probe(module).state == "needed"
    originals = [vars(owner)[name].__wrapped__ for owner, name in bindings]
    overlay(False)
    assert all(vars(owner)[name] is original for (owner, name), original in zip(bindings, originals))
    assert all(type(original) is types.FunctionType for original in originals)


PROBES = {
    "load_weights renamed": (
        "vllm.model_executor.models.nemotron_h_mtp", "    def load_weights(self, weights",
        "    def load_checkpoint(self, weights", "drifted", "defines no load_weights"),
    "load_weights argument added": (
        "vllm.model_executor.models.deepseek_mtp", "    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]])",
        "    def load_weights(self, weights, strict=False)", "drifted", "('self', 'weights', 'strict')"),
    "patched on disk": (
        "vllm.model_executor.models.nemotron_h_mtp", '        """Load MTP weights with proper name remapping."""',
        '        """Load MTP weights with proper name remapping."""\n        MTPDrafterRefits', "redundant", "patched on disk"),
    "finalize takes a config first": (
        "vllm.model_executor.model_loader.reload.layerwise", "def finalize_layerwise_reload(*args, **kwargs):",
        "def finalize_layerwise_reload(config, *args, **kwargs):", "drifted", "no longer takes the model first"),
}


@pytest.mark.parametrize(("module", "old", "new", "state", "reason"), list(PROBES.values()), ids=list(PROBES))
def test_probe_reports_drift_and_redundancy_naming_what_it_found(module, old, new, state, reason):
    import importlib

    verdict = FIX.probe(edited(importlib.import_module(module), old, new))
    assert verdict.state == state and reason in verdict.reason


def test_drafter_refit_refuses_what_is_not_a_drafter():
    with pytest.raises(TypeError, match="vLLM MTP drafter"):
        drafter_refit(torch.nn.Linear(2, 2))


# --- refit freshness: the trainer's fingerprint against what the drafter received -----------------


def packed_refit(model, stream, received, buffer=8192):
    """vLLM's packed producer (device-normalized-broadcast hooked) into a host wire, then vLLM's
    packed consumer feeding ``model.load_weights``, fingerprinting what it consumes into ``received``."""
    from vllm.distributed.weight_transfer import packed_tensor

    from mtp_overlay.mtp import record_fingerprints

    assert mtp_overlay.status(only=["device-normalized-broadcast"])[0].state == "installed"
    sender = RecordingCommunicator("cpu")
    with host_streams():
        packed_tensor.packed_nccl_broadcast_producer(iter(stream), sender, 0, lambda item: item[1], buffer_size_bytes=buffer)
        metadata = ((name, (list(t.shape), t.dtype)) for name, t in stream)
        with drafter_refit(model) as block:
            packed_tensor.packed_nccl_broadcast_consumer(
                metadata, ReplayCommunicator(sender.sent, "cpu"), 0,
                lambda chunk: model.load_weights(record_fingerprints(chunk, received)),
                buffer_size_bytes=buffer, device="cpu")
    return len(sender.sent), block.report


def test_trainer_fingerprint_equals_what_the_drafter_received_through_the_packed_broadcast(drafters, overlay):
    from mtp_overlay.mtp import StaleDrafterError, check_fresh, compare_fingerprints, fingerprint, mtp_name_filter

    model = drafters["nemotron_h"]
    overlay(True, strict=True)
    keep = mtp_name_filter(2, 1)
    trainer = [(name, t.to(torch.bfloat16) if "proj" in name else t) for name, t in refit_stream(model, "mtp.*", seed=30)]
    expected = fingerprint(trainer, keep=keep)
    assert sorted(expected) == sorted(mtp_names(trainer)) and {d.dtype for d in expected.values()} == {"bfloat16", "float32"}

    received = {}
    chunks, report = packed_refit(model, trainer, received)
    assert chunks > 1 and report.ok
    assert received == fingerprint(trainer)  # every tensor, the backbone one included
    check_fresh(expected, {name: received[name] for name in expected})

    # the rollout got last step's head: same names, shapes and dtypes, other bytes
    old = [(name, t.to(torch.bfloat16) if "proj" in name else t) for name, t in refit_stream(model, "mtp.*", seed=31)]
    stale = {}
    packed_refit(model, old, stale)
    with pytest.raises(StaleDrafterError) as raised:
        check_fresh(expected, {name: stale[name] for name in expected})
    assert sorted(raised.value.problems) == sorted(expected)
    assert all("differs in checksum" in why for why in raised.value.problems.values())

    # one tensor touched after the fingerprint (a trainer step between fingerprint and send)
    touched = [(name, t.clone()) for name, t in trainer]
    touched[3][1].view(-1)[5] += 1
    again = {}
    packed_refit(model, touched, again)
    assert list(compare_fingerprints(expected, {n: again[n] for n in expected})) == [touched[3][0]]


def test_fingerprint_of_an_fp32_master_in_the_wire_dtype_matches_the_bf16_wire(drafters):
    from mtp_overlay.mtp import fingerprint, record_fingerprints

    master = refit_stream(drafters["nemotron_h"], "mtp.*", seed=32, with_target_names=False)
    wire = [(name, t.to(torch.bfloat16)) for name, t in master]
    received = {}
    list(record_fingerprints(iter(wire), received))
    assert fingerprint(master, dtype=torch.bfloat16) == received != fingerprint(master)
