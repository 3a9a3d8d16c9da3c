"""mtp-multimodal on real megatron-core (the pinned release): MTP on a LLaVAModel trains, on exactly the
positions the combined mask allows, and equals its language model run on the hand-built combined ids.

Every case runs megatron-core's own LLaVAModel (tiny: CLIP ViT, MLP projector, HybridModel language
model with MTP; ``mtp_overlay.bed.models.tiny_llava``) on gloo ranks. Judged against the test bed's two
independent references: ``llava_oracle`` (plain torch: the combined layout and the (slot, target)
pairs each MTP depth may train) and ``CombinedIdsReference`` (the same modules, the language model
called directly with the oracle's combined ids and mask, sharded as LLaVAModel shards).

Layouts and the fixes each needs besides this one (and mtp-loss-mask, whose forward hook hands the
combined inputs on): TP1 none; TP2+SP mtp-sp-scatter (LLaVAModel builds its language model with
``scatter_embedding_sequence_parallel=False``); CP2 mtp-cp-loss-scale (else the CP2 MTP loss is a
mean of per-rank means: the cross-layout check below). The reference runs with the same fixes.
"""

import os

import numpy
import pytest
import torch
from pins import MEGATRON_CORE

from mtp_overlay.bed.oracles import llava_oracle
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.cases import failure_of, use_fixes
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.steps.megatron_step import relative_error
from mtp_overlay.bed.fixes import reproduce

FIX, LOSS_MASK, SP_SCATTER, CP_LOSS_SCALE = "mtp-multimodal", "mtp-loss-mask", "mtp-sp-scatter", "mtp-cp-loss-scale"
LAYOUTS = {
    "tp1": dict(world_size=1, tp=1, cp=1, sp=False, fixes=()),
    "tp2_sp": dict(world_size=2, tp=2, cp=1, sp=True, fixes=(SP_SCATTER,)),
    "cp2": dict(world_size=2, tp=1, cp=2, sp=False, fixes=(CP_LOSS_SCALE,)),
}
# image placeholder positions per sample of the step's two microbatches (16 text tokens, 4 embeddings
# per image): combined lengths 19 and 22 (padded to 20 / 24 for TP2+SP / CP2)
STEP_BATCHES = ([[0], [5]], [[2, 9], []])
RL_BATCH = [[3], [6, 13]]
PATTERNS = {"mtp": "*-*-/*-", "mtp2": "*-*-/*-/*-"}  # one and two MTP depths (two at TP1 only)
IMAGE_TOKEN, VOCAB, TOKENS_PER_TILE, MAX_LENGTH = 127, 128, 4, 64  # tiny_llava's defaults
TOLERANCE = 1e-6




def _batch(positions, seed=0):
    from mtp_overlay.bed.models.tiny_llava import make_llava_batch

    return make_llava_batch(positions, seed=seed)


def _oracle(positions, seed=0):
    """The oracle's combined layout of ``_batch(positions, seed)`` (labels and label-aligned mask)."""
    batch = _batch(positions, seed)
    return llava_oracle.combine(
        batch["input_ids"], image_token_index=IMAGE_TOKEN, tokens_per_image=TOKENS_PER_TILE, labels=batch["labels"],
        loss_mask=batch["loss_mask"], fill_id=llava_oracle.mtp_fill_id(IMAGE_TOKEN, VOCAB), max_length=MAX_LENGTH)


def _cp_slots(local_length):
    """The global combined slots of this CP rank's ``local_length`` slots."""
    from megatron.core import parallel_state

    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    return llava_oracle.cp_positions(local_length * cp, cp, rank)


def _pairs(records, count):
    """{(microbatch, depth): trained (sample, global slot, target)} and, as a control, every
    (sample, global slot, target) whose loss was computed (trained or not), from record_mtp's records."""
    depths = len(records) // count
    trained, computed = {}, {}
    for index in range(count):
        for depth in range(depths):
            record = records[index * depths + depth]
            slots, targets = _cp_slots(record["targets"].shape[1]), record["targets"]
            every = [(int(b), int(slots[p]), int(targets[b, p])) for b in range(targets.shape[0])
                     for p in range(targets.shape[1])]
            trained[index, depth + 1] = {pair for pair, on in zip(every, record["trained"].flatten().tolist()) if on}
            computed[index, depth + 1] = set(every)
    return trained, computed


def _build(layout, pattern):
    from mtp_overlay.bed.models import tiny_llava

    return tiny_llava.build_tiny_llava(hybrid_layer_pattern=pattern, sequence_parallel=LAYOUTS[layout]["sp"])


def _step(model):
    """Megatron's own step (2-output loss, gradients only) over the two microbatches of STEP_BATCHES."""
    from mtp_overlay.bed.steps.megatron_step import MegatronStep

    microbatches = [_batch(positions, seed) for seed, positions in enumerate(STEP_BATCHES)]
    return MegatronStep(model, optimizer=None).step(microbatches, loss="2-output", update=False)


def _recorded_step(model, results, key):
    """``_step`` with record_mtp: the result under ``key``, its trained and computed pairs beside it."""
    from mtp_overlay.bed.models.packed import record_mtp

    with record_mtp(model) as records:
        results[key] = _step(model)
    results[key + "/pairs"], results[key + "/computed"] = _pairs(records, len(STEP_BATCHES))


def step_cases(layout):
    """Rank worker: Megatron's step on the tiny LLaVAModel with MTP, stock (the crash) and with the fix,
    and on the combined-ids reference with the same fixes; the trained MTP pairs of both."""
    import functools

    from mtp_overlay.bed.models import tiny_llava

    spec, build = LAYOUTS[layout], functools.partial(_build, layout)
    results = {}
    use_fixes(spec["fixes"])  # stock for this fix: the layout's other fixes only
    results["stock"] = failure_of(lambda: _step(build(PATTERNS["mtp"])))
    use_fixes(spec["fixes"] + (LOSS_MASK, FIX))
    for name, pattern in PATTERNS.items():
        if name != "mtp" and layout != "tp1":
            continue
        _recorded_step(build(pattern), results, f"llava/{name}")
        _recorded_step(tiny_llava.CombinedIdsReference(build(pattern)), results, f"reference/{name}")
    results.update(rl_cases(build))
    results["wrong fill"] = wrong_fill(build)
    import mtp_overlay

    mtp_overlay.uninstall(only=[LOSS_MASK])  # its forward hook gone, this fix still installed
    results["without the loss-mask hook"] = failure_of(lambda: _step(build(PATTERNS["mtp"])))
    use_fixes(())
    return results


def patched_cases(layout):
    """Rank worker on a megatron-core carrying the DEP-3 patch: the step and the RL forward with the
    layout's other fixes only, then with this fix (and mtp-loss-mask) installed too; its state."""
    import functools

    import mtp_overlay

    spec, build = LAYOUTS[layout], functools.partial(_build, layout)
    results = {}
    for name, fixes in (("patched", spec["fixes"]), ("patched+hook", spec["fixes"] + (LOSS_MASK, FIX))):
        use_fixes(fixes)
        _recorded_step(build(PATTERNS["mtp"]), results, name)
        results[name + "/rl"] = rl_cases(build, reference=False)["rl/llava"]
        results[name + "/state"] = mtp_overlay.status(only=[FIX])[0].state
    use_fixes(())
    return results


def _sharding():
    from megatron.core import parallel_state

    return dict(tp=parallel_state.get_tensor_model_parallel_world_size(),
                cp=parallel_state.get_context_parallel_world_size(),
                sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1,
                cp_rank=parallel_state.get_context_parallel_rank())


def rl_reference_call(reference, batch, input_mask):
    """The language model run directly on the oracle's combined ids and input-aligned mask, without
    labels, its inputs sharded as LLaVAModel shards them (``CombinedIdsReference.forward``'s way)."""
    from megatron.core import tensor_parallel

    from mtp_overlay.bed.models import tiny_llava

    layout = tiny_llava.combined_layout(reference, dict(input_ids=batch["input_ids"]))
    sharding = _sharding()
    embeddings = reference.combined_embeddings(batch["images"], layout)
    embeddings = llava_oracle.shard(embeddings.transpose(0, 1), pad_value=0.0, **sharding).transpose(0, 1)
    if sharding["sequence_parallel"]:
        embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
    ids = llava_oracle.shard(layout.ids, pad_value=llava_oracle.mtp_fill_id(IMAGE_TOKEN, VOCAB), **sharding)
    mask = llava_oracle.shard(input_mask, pad_value=0, **sharding)
    output = reference.language_model(input_ids=ids, position_ids=None, attention_mask=None,
                                      decoder_input=embeddings.contiguous(), labels=None, loss_mask=mask)
    return output, mask


def _rl_run(model, call):
    """One forward (``call``) and backward of a loss on the logits: the MTP loss's gradient comes in
    through MTPLossAutoScaler; the logits, the returned mask, the trained pairs, every gradient."""
    from mtp_overlay.bed.models.packed import record_mtp

    model.zero_grad(set_to_none=True)
    with record_mtp(model) as records:
        output, mask = call()
    output.float().square().mean().backward()
    grads = {name: param.grad.detach().clone().numpy() for name, param in model.named_parameters()
             if param.grad is not None}
    trained, computed = _pairs(records, 1)
    return dict(logits=output.detach().numpy(), mask=None if mask is None else mask.numpy(), grads=grads,
                pairs=trained, computed=computed, losses=[record["losses"].numpy() for record in records])


def rl_cases(build, reference=True):
    """Rank worker part: LLaVAModel forwards without labels (RL), the caller's input-aligned mask given
    (or scoped, or none at TP1), against the reference run on the oracle's combined ids and mask."""
    from mtp_overlay import mtp
    from mtp_overlay.bed.models import tiny_llava

    batch = _batch(RL_BATCH, seed=3)
    call = dict(images=batch["images"], input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=None, labels=None)
    layout = _oracle(RL_BATCH, seed=3)
    input_mask = llava_oracle.input_aligned_mask(batch["input_ids"], batch["loss_mask"], layout,
                                                 image_token_index=IMAGE_TOKEN)
    results = {}
    llava = build(PATTERNS["mtp"])
    results["rl/llava"] = _rl_run(llava, lambda: llava(**call, loss_mask=batch["loss_mask"]))
    if _sharding()["tp"] * _sharding()["cp"] == 1:
        def scoped():
            with mtp.loss_mask_scope(batch["loss_mask"]):
                return llava(**call)
        results["rl/scoped"] = _rl_run(llava, scoped)
        results["rl/no mask"] = _rl_run(llava, lambda: llava(**call))
    if reference:
        model = tiny_llava.CombinedIdsReference(build(PATTERNS["mtp"]))
        results["rl/reference"] = _rl_run(model, lambda: rl_reference_call(model, batch, input_mask))
    return results


def wrong_fill(build):
    """Control: the fix with 0 at image slots instead of the image token (the rule of Megatron-LM main):
    the step's MTP loss; it must differ from the reference's, or the comparison could not tell."""
    from mtp_overlay.fixes.mtp_multimodal import llava

    rule = llava.fill_id
    llava.fill_id = lambda image_token_index, vocab_size: 0
    try:
        return _step(build(PATTERNS["mtp"])).mtp_loss
    finally:
        llava.fill_id = rule


_runs = {}


def steps(layout):
    """``step_cases`` on every rank of ``layout`` (one rank run per layout, shared by its tests)."""
    if layout not in _runs:
        spec = LAYOUTS[layout]
        _runs[layout] = run_ranks_checked(step_cases, spec["world_size"], tp=spec["tp"], cp=spec["cp"], fixes=[],
                                          args=(layout,), timeout=600)
    return _runs[layout]


def _union(ranks, key):
    """Each CP rank trains its own slots: the (microbatch, depth) -> pairs of all ranks together."""
    found = {}
    for results in ranks:
        for index, pairs in results[key].items():
            found.setdefault(index, set()).update(pairs)
    return found


def _relative(value, reference):
    return abs(value - reference) / abs(reference)


EVERY_LAYOUT = ["tp1", pytest.param("tp2_sp", marks=pytest.mark.slow), pytest.param("cp2", marks=pytest.mark.slow)]
OTHER_LAYOUTS = [pytest.param("tp2_sp", marks=pytest.mark.slow), pytest.param("cp2", marks=pytest.mark.slow)]


# ------------------------------------------------------------------ SFT (labels) through Megatron's step


@pytest.mark.parametrize("layout", EVERY_LAYOUT)
def test_stock_crashes_the_fix_trains_exactly_the_combined_masks_positions(layout):
    ranks = steps(layout)
    expected = ("TypeError: embedding(): argument 'indices' (position 2) must be Tensor, not NoneType"
                if LAYOUTS[layout]["tp"] == 1 else  # TP>1: VocabParallelEmbedding compares the ids first (layers.py:338)
                "TypeError: '<' not supported between instances of 'NoneType' and 'int'")
    assert [results["stock"] for results in ranks] == [expected] * len(ranks)
    for results in ranks:  # the fix without the hook that hands its inputs on: a clear refusal instead
        assert results["without the loss-mask hook"].startswith(f"RuntimeError: fix '{FIX}' builds the combined")
        assert f"fix '{LOSS_MASK}', whose GPTModel/HybridModel.forward hook" in results["without the loss-mask hook"]
    layouts = [_oracle(positions, seed) for seed, positions in enumerate(STEP_BATCHES)]
    for name in PATTERNS if layout == "tp1" else ["mtp"]:
        trained, computed = _union(ranks, f"llava/{name}/pairs"), _union(ranks, f"llava/{name}/computed")
        depths = len(ranks[0][f"llava/{name}"].mtp_tokens)
        assert sorted(trained) == [(index, depth) for index in range(len(layouts)) for depth in range(1, depths + 1)]
        for (index, depth), pairs in trained.items():
            oracle = layouts[index]
            assert pairs == llava_oracle.mtp_pairs(oracle, depth), (layout, name, index, depth)
            assert llava_oracle.image_targets(oracle, pairs, depth) == set(), (layout, name, index, depth)
            # the MTP loss is computed at every slot, image-bound targets included: only the mask keeps them out
            assert llava_oracle.image_targets(oracle, computed[index, depth], depth), (layout, name, index, depth)
        counts = tuple(float(sum(len(trained[index, depth]) for index in range(len(layouts))))
                       for depth in range(1, depths + 1))
        assert ranks[0][f"llava/{name}"].mtp_tokens == counts  # what Megatron logs: the same positions


@pytest.mark.parametrize("layout", EVERY_LAYOUT)
def test_mtp_loss_and_gradients_equal_the_combined_ids_reference(layout):
    for rank, results in enumerate(steps(layout)):
        for name in PATTERNS if layout == "tp1" else ["mtp"]:
            llava, reference = results[f"llava/{name}"], results[f"reference/{name}"]
            assert results[f"llava/{name}/pairs"] == results[f"reference/{name}/pairs"], (layout, rank, name)
            assert _relative(llava.lm_loss, reference.lm_loss) <= TOLERANCE, (layout, rank, name)
            for got, expected in zip(llava.mtp_losses, reference.mtp_losses, strict=True):
                assert _relative(got, expected) <= TOLERANCE, (layout, rank, name)
            for part in ("mtp", "lm", "encoder"):
                assert llava.relative_error(reference, part) <= TOLERANCE, (layout, rank, name, part)
            assert llava.grads["mtp"].size and not llava.zero_grad_params, (layout, rank, name)
        # control: 0 at image slots (another fill rule) changes the MTP loss far beyond the tolerance
        assert _relative(results["wrong fill"], results["reference/mtp"].mtp_loss) > 100 * TOLERANCE


@pytest.mark.parametrize("layout", OTHER_LAYOUTS)
def test_every_layout_trains_like_tp1(layout):
    base, result = steps("tp1")[0]["llava/mtp"], steps(layout)[0]["llava/mtp"]
    assert _relative(result.mtp_loss, base.mtp_loss) <= TOLERANCE and _relative(result.lm_loss, base.lm_loss) <= TOLERANCE
    for part in ("mtp", "lm", "encoder"):
        assert result.relative_error(base, part) <= 1e-5, (layout, part)


# ------------------------------------------------------------------ RL (labels=None), the caller's input-aligned mask


@pytest.mark.parametrize("layout", EVERY_LAYOUT)
def test_rl_forward_trains_the_callers_positions_and_returns_the_combined_mask(layout):
    ranks = steps(layout)
    batch, oracle = _batch(RL_BATCH, seed=3), _oracle(RL_BATCH, seed=3)
    mask = llava_oracle.input_aligned_mask(batch["input_ids"], batch["loss_mask"], oracle, image_token_index=IMAGE_TOKEN)
    trained = _union([results["rl/llava"] for results in ranks], "pairs")
    expected = llava_oracle.unlabelled_mtp_pairs(oracle, mask, 1)
    assert trained == {(0, 1): expected} and llava_oracle.unlabelled_image_targets(oracle, expected, 1) == set()
    assert len(expected) == int(mask[:, 2:].sum())  # depth 1 trains slot p where the mask allows slot p + 2
    for rank, results in enumerate(ranks):
        fixed, reference = results["rl/llava"], results["rl/reference"]
        numpy.testing.assert_array_equal(fixed["mask"], reference["mask"], err_msg=f"{layout} rank {rank}: mask")
        assert fixed["pairs"] == reference["pairs"], (layout, rank)
        assert numpy.abs(fixed["logits"] - reference["logits"]).max() <= TOLERANCE, (layout, rank)
        assert fixed["grads"].keys() == reference["grads"].keys() and fixed["grads"], (layout, rank)
        for name, grad in reference["grads"].items():
            assert relative_error(fixed["grads"][name], grad) <= TOLERANCE, (layout, rank, name)
    if layout == "tp1":
        results = ranks[0]
        assert results["rl/scoped"]["pairs"] == results["rl/llava"]["pairs"]  # the loss_mask_scope route
        assert results["rl/scoped"]["grads"].keys() == results["rl/llava"]["grads"].keys()
        texts = llava_oracle.input_aligned_mask(batch["input_ids"], torch.ones_like(batch["loss_mask"]), oracle,
                                                image_token_index=IMAGE_TOKEN)
        unmasked = llava_oracle.unlabelled_mtp_pairs(oracle, texts, 1)  # no mask: every text slot, never an image
        assert results["rl/no mask"]["pairs"] == {(0, 1): unmasked} and len(unmasked) > len(expected)
        assert llava_oracle.unlabelled_image_targets(oracle, unmasked, 1) == set()


# ------------------------------------------------------------------ MimoModel (ids already combined, one slot per embedding)

MIMO_IMAGES = [[3], [6, 7]]  # image-token slots per sample (no encoder: their embeddings are zeros)
MIMO_LAYOUTS = {"tp1": dict(world_size=1, cp=1, fixes=()), "cp2": dict(world_size=2, cp=2, fixes=(CP_LOSS_SCALE,))}


def _mimo_oracle(labelled):
    """(batch, oracle layout): MimoModel's combined layout is its input layout; image slots are IMAGE,
    their mask 0, and (with labels) so is every slot whose label is the image token."""
    batch = _batch(MIMO_IMAGES, seed=5)
    ids, labels = batch["input_ids"], batch["labels"]
    image = ids == IMAGE_TOKEN
    kinds = torch.where(image, llava_oracle.IMAGE, llava_oracle.TEXT)
    mask = batch["loss_mask"].masked_fill(image | (labels == IMAGE_TOKEN) if labelled else image, 0)
    layout = llava_oracle.CombinedLayout(ids, kinds, labels if labelled else None, mask,
                                         torch.full_like(ids, -1), (ids.shape[1],) * ids.shape[0])
    return batch, layout


def mimo_cases():
    """Rank worker: MimoModel forwards (with labels, and without: RL) with MTP, stock and with the fix,
    against its language model run directly on the same embeddings with the oracle's ids and mask."""
    from megatron.core import parallel_state

    from mtp_overlay.bed.models import tiny_llava

    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    spec = MIMO_LAYOUTS["cp2" if cp > 1 else "tp1"]

    def build():
        return tiny_llava.build_tiny_mimo(special_token_ids={"images": IMAGE_TOKEN})

    def local(tensor):
        return llava_oracle.shard(tensor, tp=1, cp=cp, sequence_parallel=False, cp_rank=rank, pad_value=0)

    def reference_call(model, batch, labels, mask):
        ids = batch["input_ids"]
        text = model.get_text_embeddings(ids, batch["position_ids"], model.special_token_ids)
        embeddings = model.align_embeddings_by_token_positions({"text": text}, ids, model.special_token_ids)
        embeddings = local(embeddings.transpose(0, 1)).transpose(0, 1).contiguous()
        output = model.language_model(input_ids=local(ids), position_ids=batch["position_ids"], attention_mask=None,
                                      decoder_input=embeddings, labels=None if labels is None else local(labels),
                                      loss_mask=local(mask))
        return output, local(mask)

    results = {}
    for labelled in (True, False):
        batch, oracle = _mimo_oracle(labelled)
        labels = batch["labels"] if labelled else None
        call = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                    labels=labels, loss_mask=batch["loss_mask"])
        kind = "sft" if labelled else "rl"
        use_fixes(spec["fixes"])
        model = build()
        results[f"{kind}/stock"] = failure_of(lambda: model(**call))
        use_fixes(spec["fixes"] + (LOSS_MASK, FIX))
        model = build()
        results[f"{kind}/fixed"] = _rl_run(model, lambda: model(**call))
        model = build()
        results[f"{kind}/reference"] = _rl_run(model, lambda: reference_call(model, batch, labels, oracle.loss_mask))
    use_fixes(())
    return results


_mimo_runs = {}


def mimo_steps(layout):
    if layout not in _mimo_runs:
        spec = MIMO_LAYOUTS[layout]
        _mimo_runs[layout] = run_ranks_checked(mimo_cases, spec["world_size"], cp=spec["cp"], fixes=[], timeout=600)
    return _mimo_runs[layout]


@pytest.mark.parametrize("layout", ["tp1", pytest.param("cp2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["sft", "rl"])
def test_mimo_stock_crashes_the_fix_trains_the_text_targets_and_equals_the_direct_call(layout, kind):
    ranks = mimo_steps(layout)
    _, oracle = _mimo_oracle(kind == "sft")
    if kind == "sft":
        expected = llava_oracle.mtp_pairs(oracle, 1)
        assert expected and llava_oracle.image_targets(oracle, expected, 1) == set()
    else:
        expected = llava_oracle.unlabelled_mtp_pairs(oracle, oracle.loss_mask, 1)
        assert expected and llava_oracle.unlabelled_image_targets(oracle, expected, 1) == set()
    assert _union([results[f"{kind}/fixed"] for results in ranks], "pairs") == {(0, 1): expected}
    for rank, results in enumerate(ranks):
        assert results[f"{kind}/stock"] == "TypeError: embedding(): argument 'indices' (position 2) must be Tensor, not NoneType"
        fixed, reference = results[f"{kind}/fixed"], results[f"{kind}/reference"]
        assert fixed["pairs"] == reference["pairs"] and fixed["grads"].keys() == reference["grads"].keys()
        assert numpy.abs(fixed["logits"] - reference["logits"]).max() <= TOLERANCE, (layout, kind, rank)
        for name, grad in reference["grads"].items():
            assert relative_error(fixed["grads"][name], grad) <= TOLERANCE, (layout, kind, rank, name)


def omni_case():
    """Rank worker (TP1): Megatron-Bridge 0.6's Nemotron Omni provider's model (NemotronOmniModel around
    LLaVAModel, RADIO ViT, HybridModel with MTP), a text-only batch with labels: stock, then with the fix."""
    from mtp_overlay.bed.models import tiny_llava

    batch = _batch([[], []])
    for key in ("input_ids", "labels"):  # the sound token stays out of the text (tiny_llava.build_bridge_omni)
        batch[key][batch[key] == tiny_llava.OMNI_SOUND_TOKEN_INDEX] = 1
    call = dict(images=torch.zeros(0, 3, 16, 16), input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    results = {}
    for name, fixes in (("stock", ()), ("fixed", (LOSS_MASK, FIX))):
        use_fixes(fixes)
        model = tiny_llava.build_bridge_omni(mtp_hybrid_override_pattern="*-")
        try:
            results[name] = _rl_run(model.llava_model, lambda model=model: model(**call))["pairs"]
        except Exception as exc:  # noqa: BLE001 - the stock failure is the result
            results[name] = f"{type(exc).__name__}: {exc}"
    use_fixes(())
    return results


@pytest.mark.slow
@pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)
def test_bridge_nemotron_omni_model_crashes_on_stock_and_trains_the_masks_positions_with_the_fix():
    results = run_ranks_checked(omni_case, 1, fixes=[], timeout=900)[0]
    assert results["stock"] == "TypeError: embedding(): argument 'indices' (position 2) must be Tensor, not NoneType"
    batch = _batch([[], []])
    for key in ("input_ids", "labels"):
        batch[key][batch[key] == 126] = 1  # tiny_llava.OMNI_SOUND_TOKEN_INDEX
    oracle = llava_oracle.combine(batch["input_ids"], image_token_index=IMAGE_TOKEN, tokens_per_image=TOKENS_PER_TILE,
                                  labels=batch["labels"], loss_mask=batch["loss_mask"], fill_id=IMAGE_TOKEN)
    assert results["fixed"] == {(0, 1): llava_oracle.mtp_pairs(oracle, 1)}


def test_the_reproducer_shows_the_stock_crash():
    shows, evidence = reproduce(FIX)
    assert shows, evidence
    assert "TypeError" in evidence and "input_ids" in evidence


# ------------------------------------------------------------------ the combined layout, against the oracle (no ranks)

# image positions per sample, tiles per image (None: one each), language max length (None: 64)
LAYOUT_CASES = {
    "start": ([[0], [0]], None, None),
    "middle": ([[5], [9]], None, None),
    "two images and none": ([[2, 9], []], None, None),
    "no image": ([[], []], None, None),
    "end and consecutive": ([[15], [3, 4]], None, None),
    "multi-tile": ([[3], [6]], (2, 1), None),
    "truncated": ([[2, 9], []], None, 18),
}


@pytest.mark.parametrize("image_token", [IMAGE_TOKEN, -200])  # a vocabulary id, and LLaVA's default placeholder
@pytest.mark.parametrize("name", list(LAYOUT_CASES))
def test_combined_ids_and_input_mask_equal_the_oracles(name, image_token):
    from mtp_overlay.fixes.mtp_multimodal import combined

    positions, tiles, max_length = LAYOUT_CASES[name]
    batch = _batch(positions)
    input_ids = batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE_TOKEN, image_token)
    tiles = torch.tensor(tiles or [1] * int((input_ids == image_token).sum()), dtype=torch.int)
    fill = combined.fill_id(image_token, VOCAB)
    oracle = llava_oracle.combine(input_ids, image_token_index=image_token, tokens_per_image=(tiles * 4).tolist(),
                                  fill_id=fill, max_length=max_length or MAX_LENGTH)
    is_image, slot = combined.text_slots(input_ids, image_token, tiles, TOKENS_PER_TILE)
    ids = combined.place(input_ids, is_image, slot, oracle.length, fill)
    numpy.testing.assert_array_equal(ids.numpy(), oracle.ids.numpy())
    mask = combined.place(batch["loss_mask"], is_image, slot, oracle.length, 0)
    expected = llava_oracle.input_aligned_mask(input_ids, batch["loss_mask"], oracle, image_token_index=image_token)
    numpy.testing.assert_array_equal(mask.numpy(), expected.numpy())
    assert fill == (IMAGE_TOKEN if image_token == IMAGE_TOKEN else 0) == llava_oracle.mtp_fill_id(image_token, VOCAB)


def test_combined_layout_waits_for_no_device_value(monkeypatch):
    """Placing, padding and slicing the ids read no tensor value on the host (on a GPU: a sync): no
    ``.item()``, ``.tolist()``, ``bool()``, ``.nonzero()`` and no boolean-mask indexing on the way."""
    import types

    from mtp_overlay.fixes import combined_inputs
    from mtp_overlay.fixes.mtp_multimodal import llava

    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a tensor value (a device sync)")

    batch = _batch([[2, 9], []])
    tiles = torch.ones(2, dtype=torch.int)
    model = types.SimpleNamespace(context_parallel_lm=1, tensor_model_parallel_size_lm=2, sequence_parallel_lm=True,
                                  pre_process=True, img_seq_len=TOKENS_PER_TILE,
                                  language_model=types.SimpleNamespace(vocab_size=VOCAB))
    arguments = dict(input_ids=batch["input_ids"], loss_mask=batch["loss_mask"], image_token_index=IMAGE_TOKEN,
                     num_image_tiles=tiles, use_inference_kv_cache=False, is_packed_dynamic_res=False)
    getitem = torch.Tensor.__getitem__

    def indexed(tensor, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts):
            refuse()  # a boolean mask's result size is known only on the host
        return getitem(tensor, index)

    for name in ("item", "tolist", "__bool__", "nonzero", "any", "all"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch.Tensor, "__getitem__", indexed)
    state = combined_inputs.Combined(None)
    embeddings = torch.zeros(22, 2, 8)  # [S, b, h]: the combined length, 2 samples, as _preprocess_data returns it
    llava.build(model, state, (embeddings, None, None), arguments.get)
    llava.shard(llava, model, state, None)
    monkeypatch.undo()
    oracle = _oracle([[2, 9], []])
    numpy.testing.assert_array_equal(state.ids.numpy(), llava_oracle.shard(oracle.ids, pad_value=IMAGE_TOKEN, tp=2, cp=1,
                                                                          sequence_parallel=True, cp_rank=0).numpy())
    assert state.built_mask and state.loss_mask.shape == state.ids.shape == (2, 22)


# ------------------------------------------------------------------ probe, requirement, wrappers (fresh interpreters)

LLAVA_FILE = "megatron/core/models/multimodal/llava_model.py"
MTP_FILE = "megatron/core/transformer/multi_token_prediction.py"
REPORT = """
import json, warnings
warnings.simplefilter("ignore")
import mtp_overlay
from mtp_overlay import registry
import megatron.core.models.multimodal.llava_model as llava
import megatron.core.models.mimo.model.base as mimo
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
rows = {row.name: row for row in mtp_overlay.status(only=[%r, %r])}
try:
    registry.get(%r).check_loss_mask_hook()  # what each multimodal forward with MTP asks first
    check = None
except RuntimeError as exc:
    check = str(exc)
def wrapping(owner, attribute):  # the fixes whose wrapper sits on owner.attribute
    return sorted(name for name in registry.names() if (owner, attribute) in registry.lifecycle(name).wrapped())
targets = {"LLaVAModel." + name: (llava.LLaVAModel, name)
           for name in ("forward", "_preprocess_data", "_process_embedding_token_parallel")}
targets.update({"MimoModel." + name: (mimo.MimoModel, name) for name in ("forward", "_shard_language_inputs")})
targets.update({"GPTModel.forward": (GPTModel, "forward"), "HybridModel.forward": (HybridModel, "forward")})
print(json.dumps({
    "state": rows[%r].state, "reason": rows[%r].reason, "version": rows[%r].version,
    "loss_mask": [rows[%r].state, rows[%r].reason], "check": check,
    "by_target": {module: list(found) for module, found in registry.lifecycle(%r)._target_states.items()},
    "wrappers": {key: wrapping(*value) for key, value in targets.items()},
}))
""" % ((FIX, LOSS_MASK, FIX) + (FIX,) * 3 + (LOSS_MASK,) * 2 + (FIX,))
WRAPPED = ["LLaVAModel._preprocess_data", "LLaVAModel._process_embedding_token_parallel", "LLaVAModel.forward",
           "MimoModel._shard_language_inputs", "MimoModel.forward"]


def _wrapped(row):
    """The attributes this fix's wrappers sit on, per the report."""
    return sorted(key for key, fixes in row["wrappers"].items() if FIX in fixes)


def _report(site="", **env):
    from mtp_overlay.bed.runtime.releases import run_json

    return run_json(str(site), REPORT, env={**os.environ, **env})


def _edited_copy(tmp_path, *edits, version=None, file=None):
    """A private megatron-core (the venv's, or ``version`` side by side) whose ``file`` (default:
    llava_model.py) has ``edits``."""
    from mtp_overlay.bed.runtime.releases import link_installed, release_site

    file = file or LLAVA_FILE
    site = link_installed("megatron-core", tmp_path / "site", site=version and release_site("megatron-core", version),
                          copies=[file])
    path = site / file
    source = path.read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path.write_text(source)
    return site


def test_stock_needs_the_fix_its_wrappers_sit_on_llava_and_the_language_model_keeps_one():
    row = _report()
    assert row["version"] == MEGATRON_CORE and row["state"] == "installed" and row["check"] is None, row["reason"]
    assert "LLaVAModel.forward calls its language model without input_ids and loss_mask" in row["reason"]
    assert "MimoModel calls its language model without input_ids and loss_mask (3 of its 3 calls" in row["reason"]
    wrappers = row["wrappers"]
    assert _wrapped(row) == WRAPPED
    # one wrapper, two reasons: the language model's forward carries mtp-loss-mask's, not this fix's:
    # mtp-loss-mask hands on this fix's combined inputs (the declaration requires it); other fixes
    # (mtp-logprob-skip) may wrap it too
    for method in ("GPTModel.forward", "HybridModel.forward"):
        assert LOSS_MASK in wrappers[method] and FIX not in wrappers[method], (method, wrappers[method])
    from mtp_overlay import declarations

    assert declarations.load(FIX).requires == (LOSS_MASK,)


def test_without_mtp_loss_mask_the_fix_refuses_to_install():
    row = _report(MTP_OVERLAY_DISABLE=LOSS_MASK)
    assert row["state"] == "failed" and f"requires fix '{LOSS_MASK}', which is disabled" in row["reason"]
    assert all(FIX not in fixes for fixes in row["wrappers"].values())


def test_where_mtp_loss_mask_drifted_a_multimodal_mtp_forward_refuses_naming_it(tmp_path):
    """Its forward hook hands the combined inputs on: where mtp-loss-mask drifts (here: a
    process_mtp_loss that cannot derive RL labels, as before 0.19), each multimodal forward with MTP
    raises, saying why (the step cases show the same on a real forward)."""
    edit = ("    input_ids: Optional[Tensor] = None,\n) -> Tensor:", "    token_ids: Optional[Tensor] = None,\n) -> Tensor:")
    row = _report(_edited_copy(tmp_path, edit, file=MTP_FILE))
    assert row["loss_mask"][0] == "drifted" and row["state"] == "installed"
    assert f"fix '{LOSS_MASK}', whose GPTModel/HybridModel.forward hook hands them" in row["check"]
    assert "is drifted" in row["check"]


@pytest.mark.slow
def test_megatron_core_0_18_is_drift_its_mtp_cannot_roll_llavas_position_ids(tmp_path):
    """0.18.2 has 0.19's LLaVAModel, but its MTP ``roll_tensor`` refuses the ``position_ids=None``
    LLaVAModel passes (the stock crash there is in that roll): ids alone would not make MTP run."""
    row = _report(_edited_copy(tmp_path, version="0.18.2"))
    assert row["version"] == "0.18.2" and row["state"] == "drifted" and "roll_tensor" in row["reason"], row["reason"]
    assert not any(key.startswith("LLaVAModel.") for key in _wrapped(row))


LANGUAGE_MODEL_CALL = "        output = self.language_model(\n            input_ids=None,\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edits", "reason"),
    [
        # Megatron-LM main's shape (PRs #6010, #6260): combined ids and the mask passed, the ids never sliced
        ([(LANGUAGE_MODEL_CALL, "        output = self.language_model(\n            input_ids=combined_ids,\n"),
          ("            packed_seq_params=packed_seq_params,\n        )\n\n        return output, new_loss_mask",
           "            packed_seq_params=packed_seq_params,\n            loss_mask=new_loss_mask,\n        )\n\n"
           "        return output, new_loss_mask")],
         "does not slice combined_ids with the embeddings"),
        ([("    def _preprocess_data(\n", "    def _preprocess_inputs(\n")], "LLaVAModel has no _preprocess_data"),
        ([(LANGUAGE_MODEL_CALL, "        output = self.decoder_model(\n            input_ids=None,\n")],
         "makes no self.language_model(...) call"),
    ],
    ids=["ids not sliced", "renamed method", "no language-model call"],
)
def test_an_unknown_shape_is_drift_naming_it(tmp_path, edits, reason):
    row = _report(_edited_copy(tmp_path, *edits))
    assert row["state"] == "drifted" and reason in row["reason"], row["reason"]
    assert _wrapped(row) == WRAPPED[3:]  # LLaVAModel left alone, MimoModel still fixed


# ------------------------------------------------------------------ the DEP-3 source patch

PATCH = ("patches", FIX, "megatron-core", "0.19.patch")


def _patch_cli(capsys, *args):
    import json

    from mtp_overlay.cli import main

    capsys.readouterr()
    code = main(["patch", *args, "--json"])
    return code, {row["fix"]: row for row in json.loads(capsys.readouterr().out or "[]")}


def _patched_copy(tmp_path, version=None):
    import subprocess
    from pathlib import Path

    site = _edited_copy(tmp_path, version=version)
    subprocess.run(["git", "apply", "-p1", str(Path(__file__).resolve().parents[3].joinpath(*PATCH))], cwd=site,
                   check=True)
    return site


@pytest.mark.parametrize("version", [MEGATRON_CORE, "0.19.0"])
def test_patch_applies_checks_and_reverts_byte_exactly(version, tmp_path, capsys):
    import hashlib

    from mtp_overlay.patching.manifest import load

    site = _edited_copy(tmp_path, version=None if version == MEGATRON_CORE else version)
    path, where = site / LLAVA_FILE, ("--site-packages", str(site), "--only", FIX)
    released = path.read_bytes()
    images = load().images["megatron-core"][version][LLAVA_FILE]
    assert hashlib.sha256(released).hexdigest() == images[frozenset()]
    code, rows = _patch_cli(capsys, "check", *where)
    assert code == 0 and rows[FIX]["state"] == "needed" and rows[FIX]["variant"] == PATCH[-1]
    code, rows = _patch_cli(capsys, "apply", *where)
    assert code == 0 and rows[FIX]["action"] == "patched"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == images[frozenset([FIX])]
    code, rows = _patch_cli(capsys, "revert", *where)
    assert code == 0 and path.read_bytes() == released


def test_the_patched_source_is_redundant_to_the_probe_and_left_unwrapped(tmp_path):
    row = _report(_patched_copy(tmp_path))
    state, reason = row["by_target"]["megatron.core.models.multimodal.llava_model"]
    assert state == "redundant" and "LLaVAModel.forward passes input_ids=mtp_input_ids (sliced for CP/SP" in reason
    assert _wrapped(row) == WRAPPED[3:]  # LLaVAModel left to its patched source, MimoModel still fixed


@pytest.mark.slow
def test_the_patched_source_trains_like_the_hook_and_the_hook_stands_down_on_it(tmp_path, monkeypatch):
    """CP2 (padding and CP slicing of the ids, the RL mask built and sliced) through Megatron's step:
    the patched megatron-core alone, and with the overlay's hook installed on it, equal the hook."""
    hooked = steps("cp2")
    monkeypatch.syspath_prepend(str(_patched_copy(tmp_path)))  # spawned ranks import the patched copy
    patched = run_ranks_checked(patched_cases, 2, cp=2, fixes=[], args=("cp2",), timeout=600)
    for rank, (hook, results) in enumerate(zip(hooked, patched, strict=True)):
        assert results["patched+hook/state"] == "redundant" and results["patched/state"] != "installed"
        for name in ("patched", "patched+hook"):
            step, expected = results[name], hook["llava/mtp"]
            assert (step.lm_loss, step.mtp_losses, step.mtp_tokens) == (expected.lm_loss, expected.mtp_losses,
                                                                        expected.mtp_tokens), (rank, name)
            for part in ("mtp", "lm", "encoder"):
                numpy.testing.assert_array_equal(step.grads[part], expected.grads[part], err_msg=f"{rank} {name} {part}")
            assert results[name + "/pairs"] == hook["llava/mtp/pairs"], (rank, name)
            rl, expected_rl = results[name + "/rl"], hook["rl/llava"]
            numpy.testing.assert_array_equal(rl["mask"], expected_rl["mask"], err_msg=f"{rank} {name} RL mask")
            assert rl["pairs"] == expected_rl["pairs"] and numpy.array_equal(rl["logits"], expected_rl["logits"])
