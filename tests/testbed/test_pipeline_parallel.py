"""Pipeline parallelism in the test bed: PP2 through Megatron's own pipeline schedule, MTP on the last
stage, packed THD (mtp_overlay.bed.models.pipeline, megatron_step, parity).

With two pipeline stages ``get_forward_backward_func()`` is megatron-core's
``forward_backward_pipelining_without_interleaving``: the stages exchange activations and gradients
through its ``P2PCommunicator`` over gloo, the MTP block lives on the last stage with its own copy of
the word embeddings, and ``finalize_model_grads`` all-reduces the two copies' gradients. Stage models
hold the PP1 model's weights (``pipeline.build_stage``), so a PP2 step on several microbatches must
equal the PP1 step on the same microbatches: LM and MTP losses, MTP token counts, and the finalized
gradients of every stage under the PP1 model's parameter names (max |Δ| ≤ 1e-6, float noise). The
parity rows at PP2 (and TP2xPP2+SP, slow) compare stock and overlay with each sequence alone at TP1.
"""

import numpy
import pytest
import torch

from mtp_overlay.bed.engines import parity
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.steps.megatron_step import check_step_arguments

PATTERNS = {1: "*-*-/*-", 2: "*-|*-/*-"}  # the tiny HybridModel, whole and in two stages
BATCH_SIZE, SEQ_LENGTH, PROMPT = 2, 32, 12
# three packed rows per step: of one length (every permutation of the same padded sequences) or of
# three lengths (config.variable_seq_lengths: the schedule exchanges each microbatch's shape)
ROWS = {
    "same": ((9, 12, 6, 4), (12, 9, 4, 6), (6, 4, 12, 9)),
    "variable": ((9, 12, 6, 4), (5, 7, 11), (3, 14, 8, 2)),
}
# variable_seq_lengths needs the alltoall MoE dispatcher in megatron-core 0.19's config check,
# MoE or not (transformer/transformer_config.py:2644-2649)
VARIABLE = dict(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
VOCAB = 128  # the tiny models' vocabulary: token id VOCAB is out of range
CASES = {
    "hybrid bshd sft": dict(model="hybrid", rows="bshd"),
    # an out-of-range token in the second microbatch: the first stage's embedding raises (so does the
    # last stage's MTP embedding); both stand in, the schedule runs through, every stage raises stage 0's
    "hybrid bshd bad token": dict(model="hybrid", rows="bshd", bad_token=True, fails=True),
    "hybrid bshd sft 2-output": dict(model="hybrid", rows="bshd", per_token=False, loss="2-output"),
    "hybrid thd padded rl nemo-rl": dict(model="hybrid", rows="same", flavour="padded", labels=False, loss="nemo-rl"),
    # a fix's refusal on the last stage (mtp-loss-mask refuses the unpadded flavour without
    # mtp-packed-roll): raised on every stage, and the next cases run on in step
    "hybrid thd unpadded rl refused": dict(model="hybrid", rows="same", flavour="unpadded", labels=False,
                                           mtp_mask="scoped", fixes=("mtp-loss-mask",), fails=True),
    "hybrid thd unpadded rl, mtp-packed-roll": dict(model="hybrid", rows="same", flavour="unpadded", labels=False,
                                                    fixes=("mtp-packed-roll",)),
    "hybrid thd variable lengths sft": dict(model="hybrid", rows="variable", flavour="padded", model_kwargs=VARIABLE),
    "gpt bshd sft adam": dict(model="gpt", rows="bshd", optimizer=True),
}
SLOW_CASES = ("hybrid thd variable lengths sft", "hybrid thd unpadded rl, mtp-packed-roll", "gpt bshd sft adam")


def microbatches(case, pad_multiple):
    from mtp_overlay.bed.models.packed import make_packed_row
    from mtp_overlay.bed.models.tiny_gpt import make_batch

    if case["rows"] == "bshd":
        batches = [make_batch(batch_size=BATCH_SIZE, seq_length=SEQ_LENGTH, seed=seed) for seed in range(3)]
        for batch in batches:
            batch["loss_mask"][:, :PROMPT] = 0
        if case.get("bad_token"):
            batches[1]["input_ids"][0, 5] = VOCAB
        return batches
    labels = case.get("labels", True)
    return [
        make_packed_row(lengths, pad_multiple=pad_multiple, flavour=case["flavour"], seed=seed,
                        prompts=tuple(min(2, length - 1) for length in lengths)).microbatch(labels=labels)
        for seed, lengths in enumerate(ROWS[case["rows"]])
    ]


def build(case, sequence_parallel):
    from mtp_overlay.bed.models import pipeline
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt
    from mtp_overlay.bed.models.tiny_hybrid import build_tiny_hybrid

    options = dict(sequence_parallel=sequence_parallel, calculate_per_token_loss=case.get("per_token", True),
                   **case.get("model_kwargs", {}))
    if case["model"] == "gpt":
        return build_tiny_gpt(**options)
    return build_tiny_hybrid(hybrid_layer_pattern=PATTERNS[pipeline.size()], **options)


def run_steps(names, sequence_parallel=False, pad_multiple=4):
    """Worker: each case of CASES (by name) on a freshly built model through MegatronStep; per case
    the step's result (an Adam case: the first step's, with the weights updated, and the second's) or
    its error, what each stage's forward got, and the stage's point-to-point traffic."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    import mtp_overlay
    from mtp_overlay.bed.steps.megatron_step import MegatronStep

    exchanged = []
    communicate = P2PCommunicator._communicate

    def count(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, **kwargs):
        exchanged.append((tensor_send_next is not None, tensor_send_prev is not None, recv_prev, recv_next))
        return communicate(self, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                           recv_prev=recv_prev, recv_next=recv_next, **kwargs)

    results = {}
    for name in names:
        case = CASES[name]
        mtp_overlay.uninstall()  # built by stock megatron-core
        model = build(case, sequence_parallel)
        step = MegatronStep(model, optimizer="megatron" if case.get("optimizer") else None)
        mtp_overlay.install(only=list(case.get("fixes", ())))
        seen = []
        model.forward = _recording(model.forward, seen)  # around the fixes' wrappers of HybridModel.forward
        exchanged.clear()
        P2PCommunicator._communicate = count
        arguments = dict(labels=case.get("labels", True), loss=case.get("loss", "3-output"),
                         mtp_mask=case.get("mtp_mask", "explicit"))
        if arguments["loss"] == "nemo-rl":
            arguments["mtp_grad_scale"] = "global-valid-tokens"
        batches = microbatches(case, pad_multiple)
        try:
            if case.get("optimizer"):
                outcome = (step.step(batches, **arguments), step.step(batches, update=False, **arguments))
            else:
                outcome = step.step(batches, update=False, **arguments)
        except Exception as error:  # noqa: BLE001 - a refusal is a result
            outcome = f"{type(error).__name__}: {error} {getattr(error, '__notes__', [])}"
        finally:
            P2PCommunicator._communicate = communicate
        sent = [sum(flags[index] for flags in exchanged) for index in range(4)]
        results[name] = dict(outcome=outcome, seen=seen, sent=sent)
    mtp_overlay.uninstall()
    return results


def _recording(forward, seen):
    """``forward`` that appends the names of the arguments it got (not None) to ``seen``."""

    def recorded(*args, **kwargs):
        seen.append(tuple(sorted(key for key, value in kwargs.items() if value is not None)))
        return forward(*args, **kwargs)

    return recorded


def stage_facts():
    """Worker (PP2): this stage's model, the schedule, and the two pipeline stand-ins checked against
    what they stand in for (an exact point-to-point exchange; the embedding copy's all-reduce)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import get_forward_backward_func, p2p_communication

    from mtp_overlay.bed.models import pipeline
    from mtp_overlay.bed.models.tiny_hybrid import build_tiny_hybrid

    model = build_tiny_hybrid(hybrid_layer_pattern=PATTERNS[2])
    group = parallel_state.get_pipeline_model_parallel_group()
    first_stage = pipeline.stage()["pre_process"]
    facts = dict(pipeline.stage(), mtp_process=model.mtp_process, schedule=get_forward_backward_func().__name__,
                 names=[name for name, _ in pipeline.global_names(model)], cuda=torch.cuda.is_available())

    # p2p_communication.py: the stand-in synchronize, torch's own everything else, an exact exchange
    view = p2p_communication.torch
    facts["view"] = (view.cuda.synchronize is not torch.cuda.synchronize, view.empty is torch.empty,
                     view.distributed is torch.distributed, view.cuda.current_device is torch.cuda.current_device)
    try:
        torch.cuda.synchronize()
        facts["stock synchronize"] = None
    except Exception as error:  # noqa: BLE001 - what the stand-in is for
        facts["stock synchronize"] = type(error).__name__
    for variable in (False, True):
        config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                     variable_seq_lengths=variable)
        communicator = p2p_communication.P2PCommunicator(group, config)
        shape = [()] if variable else (5, 1, 8)  # the schedule's shapes: exchanged, or fixed
        if first_stage:
            communicator.send_forward(sent_tensor(variable), is_last_stage=False)
            received = communicator.recv_backward(shape, is_last_stage=False)
        else:
            received = communicator.recv_forward(shape, is_first_stage=False)
        received = (received[0] if isinstance(received, list) else received).detach()
        if not first_stage:
            communicator.send_backward(received * 2, is_first_stage=False)
        facts[f"received variable={variable}"] = received.numpy()

    # gather_stages: a parameter two stages hold comes once, and only if both copies agree
    stage = parallel_state.get_pipeline_model_parallel_rank()
    facts["gathered"] = [(name, tensor.tolist()) for name, tensor in pipeline.gather_stages(
        [("shared", torch.ones(2)), (f"stage {stage}", torch.full((1,), float(stage)))]
    )]
    try:
        pipeline.gather_stages([("shared", torch.full((2,), float(stage)))])
    except RuntimeError as error:
        facts["copies differ"] = str(error)

    # language_module.py:307: the last stage's copy zeroed and the first stage's all-reduced into it
    weight = model.embedding.word_embeddings.weight
    first = weight.detach().clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
    with torch.no_grad():
        if not first_stage:
            weight.fill_(7.0)
    model.setup_embeddings_and_output_layer()
    facts["copy equals the first stage's"] = bool(torch.equal(weight.detach(), first))
    facts["Tensor.cuda restored"] = "cuda" not in vars(torch.Tensor)
    if not facts["cuda"]:  # upstream's own method raises on both stages before its all-reduce
        try:
            LanguageModule.setup_embeddings_and_output_layer.__wrapped__(model)
            facts["stock setup"] = None
        except RuntimeError as error:
            facts["stock setup"] = type(error).__name__
    return facts


def sent_tensor(variable):
    return torch.arange(40, dtype=torch.float32).reshape(5, 1, 8) + float(variable)


@pytest.fixture(scope="module")
def stages():
    return run_ranks_checked(stage_facts, 2, pp=2, fixes=[])


@pytest.fixture(scope="module")
def pp1():
    return run_ranks_checked(run_steps, 1, fixes=[], args=(list(CASES),), timeout=900)[0]


@pytest.fixture(scope="module")
def pp2():
    return run_ranks_checked(run_steps, 2, pp=2, fixes=[], args=(list(CASES),), timeout=900)


def assert_same_step(result, reference, after_update=False):
    """Losses, token counts, names and gradients equal (max |Δgrad| <= 1e-6). ``after_update``: the step
    after an Adam update under TP, whose float noise the update amplifies (Adam normalises the tiny
    gradients too): losses to 1e-5, gradients to a relative 1e-4, as test_megatron_step allows."""
    rel = 1e-5 if after_update else 1e-6
    assert result.lm_loss == pytest.approx(reference.lm_loss, rel=rel)
    assert result.mtp_losses == pytest.approx(reference.mtp_losses, rel=rel)
    assert result.mtp_tokens == reference.mtp_tokens and result.mtp_tokens[0] > 0
    assert result.grad_names == reference.grad_names
    for part in ("mtp", "lm"):
        assert result.grads[part].size, part
        if after_update:
            assert result.relative_error(reference, part) < 1e-4, part
        else:
            assert numpy.abs(result.grads[part] - reference.grads[part]).max() <= 1e-6, part
    assert result.zero_grad_params == reference.zero_grad_params


def test_pp2_stages_run_megatrons_pipeline_schedule_with_mtp_on_the_last_stage(stages, pp1):
    first, last = stages
    for facts in (first, last):
        assert facts["schedule"] == "forward_backward_pipelining_without_interleaving"
    assert (first["pre_process"], first["post_process"], first["mtp_process"]) == (True, False, False)
    assert (last["pre_process"], last["post_process"], last["mtp_process"]) == (False, True, True)
    # the first stage: the embedding and layers 0-1; the last: its embedding copy, layers 2-3, the
    # final norm, the MTP block and the output layer; together the PP1 model's parameters in its order
    assert not [name for name in first["names"] if name.startswith(("mtp.", "output_layer", "decoder.final"))]
    assert {name.split(".")[2] for name in first["names"] if name.startswith("decoder.layers.")} == {"0", "1"}
    assert {name.split(".")[2] for name in last["names"] if name.startswith("decoder.layers.")} == {"2", "3"}
    assert "embedding.word_embeddings.weight" in last["names"] and any(n.startswith("mtp.") for n in last["names"])
    whole = pp1["hybrid bshd sft"]["outcome"].grad_names
    assert first["names"] + [name for name in last["names"] if name not in first["names"]] == list(
        whole["lm"][:-1] + whole["mtp"] + whole["lm"][-1:]  # the MTP block sits before the output layer
    )


def test_pipeline_stand_ins_equal_what_they_stand_in_for(stages):
    """p2p_communication's synchronize and setup_embeddings_and_output_layer's ``.cuda()`` (cpu_shims):
    the exchanges deliver exactly what was sent (fixed and exchanged shapes), the last stage's copy of
    the embeddings is the first stage's after upstream's zero-and-all-reduce; upstream's own calls fail
    on a CPU machine."""
    first, last = stages
    for facts in (first, last):
        assert facts["view"] == (True, True, True, True)
        assert facts["copy equals the first stage's"] and facts["Tensor.cuda restored"]
        if not facts["cuda"]:
            assert facts["stock synchronize"] == "RuntimeError" and facts["stock setup"] == "RuntimeError"
    for variable in (False, True):
        numpy.testing.assert_array_equal(last[f"received variable={variable}"], sent_tensor(variable).numpy())
        numpy.testing.assert_array_equal(first[f"received variable={variable}"], 2 * sent_tensor(variable).numpy())


def test_gathered_stages_hold_each_parameter_once_and_only_agreeing_copies(stages):
    for facts in stages:
        assert facts["gathered"] == [("shared", [1.0, 1.0]), ("stage 0", [0.0]), ("stage 1", [1.0])]
        assert facts["copies differ"] == "pipeline stages 0 and 1 hold different copies of 'shared' (max |difference| 1)"


def test_pp2_step_equals_the_pp1_step_on_every_stage(pp1, pp2):
    first, last = pp2
    for name, case in CASES.items():
        if case.get("fails"):
            continue
        reference, results = pp1[name]["outcome"], [first[name]["outcome"], last[name]["outcome"]]
        if case.get("optimizer"):
            for stage in results:
                assert_same_step(stage[0], reference[0])
                assert stage[0].update_norm == pytest.approx(reference[0].update_norm, rel=1e-6)
                assert_same_step(stage[1], reference[1])
            assert reference[1].lm_loss < reference[0].lm_loss  # the update trained
            continue
        for stage in results:  # every rank gives the whole result
            assert_same_step(stage, reference)


def test_each_stage_gets_what_it_uses_and_microbatches_cross_each_way_once(pp2):
    first, last = pp2
    for name, case in CASES.items():
        if case.get("fails"):
            continue
        count = 3 * (2 if case.get("optimizer") else 1)  # microbatches a stage ran forward
        packed = ("packed_seq_params",) if case["rows"] != "bshd" else ()
        masks = ("loss_mask",) if case.get("labels", True) or case.get("mtp_mask", "explicit") == "explicit" else ()
        labels = ("labels",) if case.get("labels", True) else ()
        assert first[name]["seen"] == [tuple(sorted(("input_ids", "position_ids") + packed))] * count, name
        # the last stage: labels and masks, and the token ids MTP embeds again
        assert last[name]["seen"] == [tuple(sorted(("input_ids", "position_ids") + packed + masks + labels))] * count
        # [send next, send previous, receive previous, receive next]: activations forward, gradients back
        assert first[name]["sent"] == [count, 0, 0, count], name
        assert last[name]["sent"] == [0, count, count, 0], name


def test_a_stage_whose_forward_raises_raises_on_every_stage_and_the_pool_runs_on(pp1, pp2):
    """A stage's forward error, raised on every stage once stand-in outputs carried the schedule
    through: mtp-loss-mask refusing the unpadded flavour without mtp-packed-roll (its boundary guard
    needs no mask, so the first stage refuses first and the last stage gets its error); an
    out-of-range token on the first stage (whose stand-in activations the last stage computes on).
    The cases after them equal PP1 (test_pp2_step_equals_the_pp1_step_on_every_stage)."""
    first, last = pp2
    refusal = pp1["hybrid thd unpadded rl refused"]["outcome"]
    assert refusal.startswith("ValueError: packed_seq_params.cu_seqlens_q") and "enable mtp-packed-roll" in refusal
    assert first["hybrid thd unpadded rl refused"]["outcome"] == refusal  # its own error, no note
    assert last["hybrid thd unpadded rl refused"]["outcome"] == refusal.replace(
        " []", " ['(raised on pipeline stage 0)']"
    )
    bad_token = pp1["hybrid bshd bad token"]["outcome"]
    assert bad_token == "IndexError: index out of range in self []"
    assert first["hybrid bshd bad token"]["outcome"] == bad_token
    assert last["hybrid bshd bad token"]["outcome"] == bad_token.replace(" []", " ['(raised on pipeline stage 0)']")


def test_microbatches_of_different_shapes_need_variable_seq_lengths_under_pp():
    def arguments(variable_shapes):
        from mtp_overlay.bed.models.tiny_gpt import make_batch

        batches = [make_batch(seq_length=32), make_batch(seq_length=16)]
        return dict(microbatches=batches, loss="3-output", labels=True, mtp_grad_scale=None, per_token=False,
                    update=False, optimizer=None, variable_shapes=variable_shapes)

    check_step_arguments(**arguments(True))
    with pytest.raises(ValueError, match=r"microbatches\[1\] has shape \(2, 16\), microbatches\[0\] \(2, 32\): "
                                         r"under pipeline parallelism .* need config.variable_seq_lengths=True"):
        check_step_arguments(**arguments(False))


def refused_pattern():
    """Worker: the refusal of a pattern with three stages for a pipeline of two."""
    from mtp_overlay.bed.models.tiny_hybrid import build_tiny_hybrid

    try:
        build_tiny_hybrid(hybrid_layer_pattern="*|-|*-/*-")
    except ValueError as error:
        return str(error)


def test_hybrid_pattern_stages_must_match_the_pipeline():
    message = run_ranks_checked(refused_pattern, 2, pp=2, fixes=[])[0]
    assert message == "hybrid_layer_pattern '*|-|*-/*-' has 3 '|'-separated stages, but the pipeline has 2 " \
                      "(give one segment per stage, or none)"


def parity_rows(parallelism, models):
    """{(model, layout): {"stock": Outcome, "overlay": Outcome}} of the parity table at ``parallelism``
    (its spec's ranks, the shared pool), and the TP1 references."""
    spec = parity.PARALLELISMS[parallelism]
    cases = parity.table_cases(parallelism, models)
    outcomes = run_ranks_checked(parity.run_cases, spec["world_size"], tp=spec["tp"], pp=spec["pp"], fixes=[],
                                 args=(cases,), timeout=900)[0]
    references = run_ranks_checked(parity.run_cases, 1, fixes=[], args=(parity.reference_cases(models),))[0]
    references = {(o.case.model, o.case.layout): o for o in references}
    rows = {}
    for outcome in outcomes:
        case = outcome.case
        reference = references[case.model, "bshd" if case.layout == "bshd" else "reference"]
        rows.setdefault((case.model, case.layout), dict(reference=reference))["overlay" if case.fixes else "stock"] = outcome
    return rows


def assert_parity(rows, crash_models=()):
    """Overlay rows equal each sequence alone; stock too except where a fix the overlay carries is needed."""
    for (model, layout), row in rows.items():
        reference = row["reference"].step
        for variant in ("stock", "overlay"):
            outcome = row[variant]
            if variant == "stock" and model in crash_models:
                assert outcome.error.startswith("RuntimeError: Sizes of tensors must match"), (model, layout)
                continue
            assert outcome.error is None, (model, layout, variant, outcome.error)
            mtp, rest, *_ = outcome.compare(row["reference"])
            exact = variant == "overlay" or layout != "unpadded"  # stock unpadded: mtp-packed-roll's shifted targets
            assert outcome.step.lm_loss == pytest.approx(reference.lm_loss, rel=1e-6)
            if exact:
                assert outcome.step.mtp_loss == pytest.approx(reference.mtp_loss, rel=1e-6)
                assert mtp <= 1e-6 and rest <= 1e-6, (model, layout, variant, mtp, rest)
            else:
                assert mtp > 1e-4 and outcome.step.mtp_loss != pytest.approx(reference.mtp_loss, rel=1e-4)


def test_parity_rows_at_pp2_overlay_equals_each_sequence_alone():
    rows = parity_rows("PP2", ("gpt", "hybrid"))
    assert len(rows) == 6
    assert_parity(rows)


@pytest.mark.slow
def test_tp2_pp2_sequence_parallel_steps_and_parity_rows(pp1):
    """TP2xPP2+SP (4 ranks): the step equals PP1's; the parity rows, the HybridModel that does not
    scatter its embedding too (stock's MTP concat crashes on the last stage; every stage raises it)."""
    from mtp_overlay.mtp import padding_multiple

    results = run_ranks_checked(run_steps, 4, tp=2, pp=2, fixes=[], args=(list(SLOW_CASES), True, padding_multiple(1, 2, True)),
                                timeout=900)
    references = run_ranks_checked(run_steps, 1, fixes=[], args=(list(SLOW_CASES), False, padding_multiple(1, 2, True)))[0]
    for name in SLOW_CASES:
        reference = references[name]["outcome"]
        for rank in results:
            outcome = rank[name]["outcome"]
            if isinstance(reference, tuple):
                assert_same_step(outcome[0], reference[0])
                assert outcome[0].update_norm == pytest.approx(reference[0].update_norm, rel=1e-4)
                assert_same_step(outcome[1], reference[1], after_update=True)
            else:
                assert_same_step(outcome, reference)
    rows = parity_rows("TP2xPP2+SP", ("hybrid", "hybrid, scatter=False"))
    assert len(rows) == 6
    assert_parity(rows, crash_models=("hybrid, scatter=False",))
