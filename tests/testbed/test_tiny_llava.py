"""megatron-core's LLaVAModel with an MTP HybridModel in the test bed (mtp_overlay.bed.models.tiny_llava).

What a fix for MTP on multimodal models is judged by, checked here on stock megatron-core 0.19:

* the CPU stand-ins of LLaVAModel's construction, each needed (the build fails without it) and
  checked against a reference;
* the first-principles combined layout (``llava_oracle``) equals what ``LLaVAModel._preprocess_data``
  builds (labels, loss mask, and the embeddings at every text, image and padding slot) on batches
  with images at the start, in the middle, at the end, two, consecutive, none, multi-tile, truncated;
  its CP/SP sharding equals ``_process_embedding_token_parallel``'s;
* the stock crash: with MTP, LLaVAModel (and its language model called as LLaVAModel calls it, and
  MimoModel) raise the TypeError of the missing ``input_ids``; without MTP they run;
* Megatron's own step: without MTP, LLaVAModel equals the language model run directly on the
  hand-built combined ids and mask (``CombinedIdsReference``) at TP1, TP2+SP and CP2, and every layout
  equals TP1; with MTP the reference trains exactly the oracle's (position, target) pairs, none an
  image slot, and its MTP loss and gradients agree across layouts: the target of the fix.
"""

import numpy
import pytest
import torch

from mtp_overlay.bed.oracles import llava_oracle
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.cases import failure_of, use_fixes
from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.steps.megatron_step import relative_error

SP_SCATTER, CP_LOSS_SCALE = "mtp-sp-scatter", "mtp-cp-loss-scale"
LAYOUTS = {
    "tp1": dict(world_size=1, tp=1, cp=1, sp=False, fixes=()),
    # the reference's MTP embedding needs mtp-sp-scatter (LLaVAModel builds scatter=False); under CP
    # its MTP loss equals TP1's with mtp-cp-loss-scale
    "tp2_sp": dict(world_size=2, tp=2, cp=1, sp=True, fixes=(SP_SCATTER,)),
    "cp2": dict(world_size=2, tp=1, cp=2, sp=False, fixes=(CP_LOSS_SCALE,)),
}
# image placeholder positions per sample (16 text tokens, 4 embeddings per image tile)
BATCHES = {
    "start": [[0], [0]],
    "middle": [[5], [9]],
    "two images and none": [[2, 9], []],
    "no image": [[], []],
    "end and consecutive": [[15], [3, 4]],
}
MULTI_TILE = ([[3], [6]], (2, 1))  # 2 tiles for the first image
TRUNCATED = ("two images and none", 18)  # language max sequence length below the combined 22
# name -> (image positions, tiles per image or None, language max sequence length or None)
PREPROCESS_CASES = {
    **{name: (positions, None, None) for name, positions in BATCHES.items()},
    "multi-tile": (MULTI_TILE[0], MULTI_TILE[1], None),
    "truncated": (BATCHES[TRUNCATED[0]], None, TRUNCATED[1]),
}
IMAGE_TOKEN, VOCAB, TOKENS_PER_TILE, MAX_LENGTH = 127, 128, 4, 64  # tiny_llava's defaults
STEP_BATCHES = ([[0], [5]], [[2, 9], []])  # two microbatches of combined lengths 19 and 22
SLICED_BATCHES = ("middle", "two images and none")  # combined 19 (padded to 20) and 22 (24 under CP2)
TYPE_ERROR = "TypeError: embedding(): argument 'indices' (position 2) must be Tensor, not NoneType"
# at TP>1 VocabParallelEmbedding compares the ids with its vocabulary range first (layers.py:338)
TP_TYPE_ERROR = "TypeError: '<' not supported between instances of 'NoneType' and 'int'"




def _batch(positions, seed=0):
    from mtp_overlay.bed.models.tiny_llava import make_llava_batch

    return make_llava_batch(positions, seed=seed)


def _forward(model, batch, **extra):
    return model(images=batch["images"], input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                 attention_mask=None, labels=batch["labels"], loss_mask=batch["loss_mask"], **extra)


def _pairs(records, microbatches):
    """{(microbatch, depth): trained (sample, global slot, target)} from record_mtp's records."""
    from megatron.core import parallel_state

    cp, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    depths = len(records) // len(microbatches)
    pairs = {}
    for index in range(len(microbatches)):
        for depth in range(depths):
            record = records[index * depths + depth]
            slots = llava_oracle.cp_positions(record["targets"].shape[1] * cp, cp, rank)
            trained = torch.nonzero(record["trained"], as_tuple=True)
            pairs[index, depth + 1] = {
                (int(b), int(slots[p]), int(record["targets"][b, p])) for b, p in zip(*trained)
            }
    return pairs


def step_cases(layout):
    """Rank worker: Megatron's step on LLaVAModel and on the combined-ids reference, without MTP and
    (stock, LLaVAModel crashing) with MTP; the reference's trained MTP pairs."""
    from mtp_overlay.bed.models import tiny_llava
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.models.packed import record_mtp

    spec = LAYOUTS[layout]
    microbatches = [_batch(positions, seed) for seed, positions in enumerate(STEP_BATCHES)]

    def build(pattern):
        return tiny_llava.build_tiny_llava(hybrid_layer_pattern=pattern, sequence_parallel=spec["sp"])

    def step(model):
        return MegatronStep(model, optimizer=None).step(microbatches, loss="2-output", update=False)

    results = {}
    use_fixes(())
    results["llava"] = step(build("*-*-"))
    results["reference"] = step(tiny_llava.CombinedIdsReference(build("*-*-")))
    results["llava/mtp"] = failure_of(lambda: step(build("*-*-/*-")))
    patterns = {"reference/mtp": "*-*-/*-"}
    if layout == "tp1":
        patterns["reference/mtp2"] = "*-*-/*-/*-"  # two MTP depths
        swapped = [dict(batch, images=batch["images"].flip(0)) for batch in microbatches]
        model = tiny_llava.CombinedIdsReference(build("*-*-"))
        results["reference/images swapped"] = MegatronStep(model, optimizer=None).step(
            swapped, loss="2-output", update=False)
    use_fixes(spec["fixes"])
    for name, pattern in patterns.items():
        reference = tiny_llava.CombinedIdsReference(build(pattern))
        with record_mtp(reference) as records:
            results[name] = step(reference)
        results[name + "/pairs"] = _pairs(records, microbatches)
    use_fixes(())
    return results


def slicing_cases():
    """Rank worker (TP2+SP or CP2): LLaVAModel's own ``_process_embedding_token_parallel`` on embeddings
    that hold each slot's index (+1; zeros are padding), labels and mask, against ``llava_oracle``."""
    from megatron.core import parallel_state

    from mtp_overlay.bed.models import tiny_llava

    tp = parallel_state.get_tensor_model_parallel_world_size()
    model = tiny_llava.build_tiny_llava(hybrid_layer_pattern="*-*-", sequence_parallel=tp > 1)
    cp = model.context_parallel_lm
    sharding = dict(tp=tp, cp=cp, sequence_parallel=model.sequence_parallel_lm,
                    cp_rank=parallel_state.get_context_parallel_rank())
    results = {}
    for name in SLICED_BATCHES:
        layout = tiny_llava.combined_layout(model, _batch(BATCHES[name]))
        batch, length = layout.ids.shape
        index = (torch.arange(length) + 1 + 1000 * torch.arange(batch)[:, None]).float()  # [b, S]
        embeddings = index[..., None].expand(batch, length, 8).contiguous()
        if cp == 1:
            embeddings = embeddings.transpose(0, 1).contiguous()  # LLaVAModel's layout without CP: [S, b, h]
        got, labels, mask, _ = model._process_embedding_token_parallel(
            embeddings, layout.labels, layout.loss_mask, None)
        expected = llava_oracle.shard(index, pad_value=0.0, **sharding)  # [b, S_local]
        if model.sequence_parallel_lm:
            rank = parallel_state.get_tensor_model_parallel_rank()
            expected = expected[:, llava_oracle.sequence_parallel_positions(expected.shape[1], tp, rank)]
        results[name] = dict(
            embeddings=(got[..., 0].transpose(0, 1).numpy(), expected.numpy()),
            labels=(labels.numpy(),
                    llava_oracle.shard(layout.labels, pad_value=llava_oracle.IGNORE_INDEX, **sharding).numpy()),
            mask=(mask.numpy(), llava_oracle.shard(layout.loss_mask, pad_value=0, **sharding).numpy()),
        )
    return results


def build_without(attribute):
    """build_tiny_llava with every construction stand-in but the one that swaps ``attribute``; the error."""
    from mtp_overlay.bed.models import tiny_llava
    from mtp_overlay.bed.runtime import multimodal_stand_ins

    others = [shim for shim in multimodal_stand_ins.llava_stand_ins() if shim.attribute != attribute]
    return failure_of(lambda: tiny_llava.build_tiny_llava(hybrid_layer_pattern="*-*-", stand_ins=others))


def tp1_cases():
    """Rank worker (TP1): the stand-ins, the oracle against _preprocess_data, the stock crash."""
    from megatron.core.models.multimodal import llava_model
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mtp_overlay.bed.runtime import multimodal_stand_ins, shim
    from mtp_overlay.bed.models import tiny_llava

    results = {}
    # --- stand-ins: each needed, each against a reference
    original = (vars(CLIPViTModel)["__init__"], clip_vit_model.torch, llava_model.is_te_min_version)
    vision = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True)

    def clip():
        return CLIPViTModel(vision, get_vit_layer_with_local_spec(), img_h=32, img_w=32, patch_dim=16)

    for attribute in ("__init__", "torch"):  # CLIPViTModel alone
        others = [shim for shim in multimodal_stand_ins.llava_stand_ins() if shim.attribute != attribute]
        with shim.swapped(others):
            results[f"without {attribute}"] = failure_of(clip)
    with multimodal_stand_ins.llava_construction_stand_ins():
        model = clip()
    torch.nn.init.normal_(model.ln_pre.weight)
    torch.nn.init.normal_(model.ln_pre.bias)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        reference = torch.nn.functional.layer_norm(
            x, (32,), model.ln_pre.weight, model.ln_pre.bias, vision.layernorm_epsilon)
    with torch.no_grad():
        difference = float((model.ln_pre(x) - reference).abs().max())
    results["ln_pre"] = (type(model.ln_pre).__name__, difference)
    results["position_ids"] = (type(model.position_ids), model.position_ids.device.type, model.position_ids.tolist())
    after = (vars(CLIPViTModel)["__init__"], clip_vit_model.torch, llava_model.is_te_min_version)
    results["restored"] = all(now is then for now, then in zip(after, original))
    results["LLaVAModel without __init__"] = build_without("__init__")
    results["LLaVAModel without torch"] = build_without("torch")

    # --- the oracle against _preprocess_data
    llava = tiny_llava.build_tiny_llava(hybrid_layer_pattern="*-*-/*-")
    reference = tiny_llava.CombinedIdsReference(llava)
    results["img_seq_len"] = (llava.img_seq_len, tiny_llava.tokens_per_image(llava))
    preprocess = {}
    for name, (positions, tiles, max_length) in PREPROCESS_CASES.items():
        batch = _batch(positions)
        if tiles is not None:
            batch["images"] = torch.randn(sum(tiles), 3, 32, 32, generator=torch.Generator().manual_seed(1))
        tiles = torch.tensor(tiles if tiles is not None else [1] * len(batch["images"]), dtype=torch.int)
        saved = llava._language_max_sequence_length
        llava._language_max_sequence_length = max_length or saved  # what the constructor argument sets
        try:
            preprocess[name] = _preprocess(llava, reference, batch, tiles)
        finally:
            llava._language_max_sequence_length = saved
    results["preprocess"] = preprocess

    # --- the stock crash, and the same calls without MTP
    batch = _batch(STEP_BATCHES[0])
    results["llava/mtp"] = failure_of(lambda: _forward(llava, batch))
    results["language model/mtp"] = failure_of(lambda: tiny_llava.language_model_call(llava, batch))
    plain = tiny_llava.build_tiny_llava(hybrid_layer_pattern="*-*-")
    output, mask = _forward(plain, batch)
    results["llava"] = (tuple(output.shape), tuple(mask.shape), float(mask.sum()))
    results["language model"] = tuple(tiny_llava.language_model_call(plain, batch).shape)
    layout = tiny_llava.combined_layout(plain, batch)
    results["layout"] = (layout.length, float(layout.loss_mask.sum()))
    for name, pattern in (("mimo/mtp", "*-*-/*-"), ("mimo", "*-*-")):
        mimo = tiny_llava.build_tiny_mimo(hybrid_layer_pattern=pattern)
        text = _batch([[], []])

        def call(mimo=mimo, text=text):
            output, _ = mimo(input_ids=text["input_ids"], position_ids=text["position_ids"], labels=text["labels"],
                             loss_mask=text["loss_mask"])
            return tuple(output.shape)
        results[name] = failure_of(call) or call()
    return results


def _preprocess(llava, reference, batch, tiles):
    """LLaVAModel._preprocess_data on ``batch`` (inputs prepared as LLaVAModel.forward prepares them):
    its labels and mask, and how far its embeddings are from the oracle-built ones (the reference's)."""
    from mtp_overlay.bed.models import tiny_llava

    ids = batch["input_ids"].clone()
    ids[ids == llava.image_token_index] = 0  # llava_model.py:1223-1224
    text = llava.language_model.embedding(input_ids=ids, position_ids=batch["position_ids"]).transpose(1, 0)
    if len(batch["images"]):
        vision = llava.vision_model(batch["images"])[:, llava.vision_model.class_token_len:, :]
        vision = llava.vision_projection(vision.permute(1, 0, 2).contiguous())
    else:  # llava_model.py:995-998
        vision = torch.zeros(0, 0, 0)
    embeddings, labels, mask = llava._preprocess_data(
        vision, text.contiguous(), batch["input_ids"], batch["loss_mask"], batch["labels"], False, None,
        llava.image_token_index, tiles)
    layout = tiny_llava.combined_layout(llava, batch, num_image_tiles=tiles)
    built = reference.combined_embeddings(batch["images"], layout)
    same_shape = embeddings.shape == built.shape
    return dict(labels=labels.numpy(), mask=mask.numpy(),
                embeddings=float((embeddings - built).abs().max()) if same_shape else tuple(embeddings.shape))


def omni_cases():
    """Rank worker (TP1): the Bridge 0.6 Nemotron Omni provider's LLaVAModel, text-only, with and without MTP."""
    from mtp_overlay.bed.models import tiny_llava

    batch = _batch([[], []])
    for key in ("input_ids", "labels"):  # the sound token stays out of the text (build_bridge_omni)
        batch[key][batch[key] == tiny_llava.OMNI_SOUND_TOKEN_INDEX] = 1
    results = {}
    for name, mtp in (("mtp", "*-"), ("plain", None)):
        model = tiny_llava.build_bridge_omni(mtp_hybrid_override_pattern=mtp)
        llava = model.llava_model
        results[name + "/built"] = (
            f"{type(model).__name__} -> {type(llava).__name__}({type(llava.vision_model).__name__}, "
            f"{type(llava.language_model).__name__}, mtp={llava.language_model.mtp_process})")

        def call(model=model):
            output, mask = _forward(model, dict(batch, images=torch.zeros(0, 3, 16, 16)))
            return tuple(output.shape)
        results[name] = failure_of(call) or call()
    return results


def oracle_layout(positions, *, tiles=None, max_length=None, seed=0):
    """The oracle's layout of ``_batch(positions, seed)`` for tiny_llava's model, built here (no rank)."""
    batch = _batch(positions, seed)
    tiles = tiles or [1] * len(batch["images"])
    return llava_oracle.combine(
        batch["input_ids"], image_token_index=IMAGE_TOKEN, tokens_per_image=[t * TOKENS_PER_TILE for t in tiles],
        labels=batch["labels"], loss_mask=batch["loss_mask"], fill_id=llava_oracle.mtp_fill_id(IMAGE_TOKEN, VOCAB),
        max_length=max_length or MAX_LENGTH,
    )


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tp1():
    return run_ranks_checked(tp1_cases, 1, fixes=[], timeout=600)[0]


@pytest.fixture(scope="module")
def steps():
    runs = {}
    for name, spec in LAYOUTS.items():
        runs[name] = run_ranks_checked(step_cases, spec["world_size"], tp=spec["tp"], cp=spec["cp"], fixes=[],
                                       args=(name,), timeout=600)
    return runs


@pytest.fixture(scope="module")
def sliced():
    return {name: run_ranks_checked(slicing_cases, 2, tp=spec["tp"], cp=spec["cp"], fixes=[], timeout=300)
            for name, spec in LAYOUTS.items() if spec["world_size"] == 2}


# ------------------------------------------------------------------ stand-ins


def test_each_llava_construction_stand_in_is_needed_and_matches_its_reference(tp1):
    norm_error = "LayerNorm.__init__() got an unexpected keyword argument 'config'"
    assert norm_error in tp1["without __init__"] and norm_error in tp1["LLaVAModel without __init__"]
    if not torch.cuda.is_available():  # clip_vit_model.py:124 calls .cuda(): no driver (or, in a fork, no re-init)
        for name in ("without torch", "LLaVAModel without torch"):
            assert tp1[name].startswith("RuntimeError") and ("CUDA" in tp1[name] or "NVIDIA" in tp1[name]), tp1[name]
    name, difference = tp1["ln_pre"]
    assert name == "LayerNorm" and difference < 1e-6  # torch's layer norm with the module's own weights
    kind, device, values = tp1["position_ids"]
    assert kind is torch.Tensor and device == "cpu" and values == [list(range(5))]  # 4 patches + class token
    assert tp1["restored"]


def test_te_version_stand_in_answers_as_te_1_10_and_is_needed_for_cp():
    from mtp_overlay.bed.runtime.multimodal_stand_ins import _te_1_10_min_version

    assert _te_1_10_min_version("1.10.0") and _te_1_10_min_version("1.9.1")
    assert not _te_1_10_min_version("1.10.1") and not _te_1_10_min_version("1.10.0", check_equality=False)
    errors = run_ranks_checked(build_without, 2, cp=2, fixes=[], args=("is_te_min_version",), timeout=300)
    assert errors == ["AssertionError: Context Parallelism in LLaVA requires TE v1.10 or higher"] * 2
    # with it, CP2 trains like TP1 (the exact CP attention stands in for TE's): the step tests below


# ------------------------------------------------------------------ the oracle


def test_oracle_image_tokens_follow_the_clip_geometry_and_class_token_handling(tp1):
    assert tp1["img_seq_len"] == (TOKENS_PER_TILE, TOKENS_PER_TILE)  # LLaVAModel's own count, and the oracle's
    assert llava_oracle.image_tokens(32, 32, 16, drop_class_token=False) == 5
    assert llava_oracle.image_tokens(32, 32, 16, add_class_token=False, drop_class_token=False) == 4
    with pytest.raises(ValueError, match="multiples of patch_dim"):
        llava_oracle.image_tokens(30, 32, 16)


@pytest.mark.parametrize("name", list(PREPROCESS_CASES))
def test_oracle_layout_equals_preprocess_data(tp1, name):
    positions, tiles, max_length = PREPROCESS_CASES[name]
    layout = oracle_layout(positions, tiles=tiles, max_length=max_length)
    case = tp1["preprocess"][name]
    numpy.testing.assert_array_equal(case["labels"], layout.labels.numpy(), err_msg=f"{name}: labels")
    numpy.testing.assert_array_equal(case["mask"], layout.loss_mask.numpy(), err_msg=f"{name}: loss mask")
    assert case["embeddings"] == 0.0, f"{name}: embeddings differ (max |diff|, or LLaVA's shape): {case['embeddings']}"
    # the ids are the text in the combined layout: where the mask trains slot p, its label is slot p+1's id
    for b in range(layout.ids.shape[0]):
        for p in range(layout.length - 1):
            if layout.loss_mask[b, p] and p + 1 < layout.lengths[b]:
                assert int(layout.labels[b, p]) == int(layout.ids[b, p + 1]), (name, b, p)
    if max_length is not None:
        assert layout.length == max_length < max(oracle_layout(positions).lengths)


@pytest.mark.parametrize("name", list(BATCHES))
def test_oracle_mtp_pairs_never_target_an_image_slot_and_a_mask_of_ones_would(name):
    layout = oracle_layout(BATCHES[name])
    unsafe = bool((layout.kinds != llava_oracle.TEXT).any())  # image or padding slots
    for depth in (1, 2, 3):
        pairs = llava_oracle.mtp_pairs(layout, depth)
        assert pairs and not llava_oracle.image_targets(layout, pairs, depth)
        # what MTP trains when the combined mask does not reach it (stock: loss_mask None -> ones)
        ones = llava_oracle.CombinedLayout(layout.ids, layout.kinds, layout.labels, torch.ones_like(layout.loss_mask),
                                           layout.image_rows, layout.lengths)
        assert bool(llava_oracle.image_targets(layout, llava_oracle.mtp_pairs(ones, depth), depth)) == unsafe


def test_oracle_refuses_bad_input():
    ids = torch.tensor([[1, 127, 2]])
    with pytest.raises(ValueError, match="one positive count per image placeholder"):
        llava_oracle.combine(ids, image_token_index=127, tokens_per_image=[4, 4])
    with pytest.raises(ValueError, match="together"):
        llava_oracle.combine(ids, image_token_index=127, tokens_per_image=4, labels=ids)
    with pytest.raises(ValueError, match="input_ids' shape"):
        llava_oracle.combine(ids, image_token_index=127, tokens_per_image=4, labels=ids[:, :2], loss_mask=ids[:, :2])
    with pytest.raises(ValueError, match="depth must be a positive int"):
        llava_oracle.mtp_pairs(llava_oracle.combine(ids, image_token_index=127, tokens_per_image=4), 0)
    assert llava_oracle.mtp_fill_id(127, 128) == 127 and llava_oracle.mtp_fill_id(-200, 128) == 0


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2"])
def test_oracle_sharding_equals_process_embedding_token_parallel(sliced, layout):
    for rank, results in enumerate(sliced[layout]):
        for name, parts in results.items():
            for part, (got, expected) in parts.items():
                numpy.testing.assert_array_equal(got, expected, err_msg=f"{layout} rank {rank} {name}: {part}")


# ------------------------------------------------------------------ the stock crash


def test_stock_mtp_crashes_in_llava_its_language_model_and_mimo_without_mtp_they_run(tp1):
    assert tp1["llava/mtp"] == TYPE_ERROR
    assert tp1["language model/mtp"] == TYPE_ERROR
    assert tp1["mimo/mtp"] == TYPE_ERROR
    layout = oracle_layout(STEP_BATCHES[0])
    length, trained = layout.length, float(layout.loss_mask.sum())
    assert tp1["llava"] == ((2, length), (2, length), trained) and (length, trained) == (19, 22.0)
    assert tp1["language model"] == (2, length)
    assert tp1["mimo"] == (2, 16)  # text only: MimoModel's ids are already the combined sequence


# ------------------------------------------------------------------ Megatron's step


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_without_mtp_llava_equals_the_combined_ids_reference(steps, layout):
    for rank, results in enumerate(steps[layout]):
        llava, reference = results["llava"], results["reference"]
        assert abs(llava.lm_loss - reference.lm_loss) <= 1e-6 * abs(reference.lm_loss), (layout, rank)
        for part in ("lm", "encoder"):
            assert llava.relative_error(reference, part) <= 1e-6, (layout, rank, part)
        assert not llava.zero_grad_params and llava.grads["encoder"].size and not llava.grads["mtp"].size
    if layout != "tp1":  # every layout trains like TP1
        base, results = steps["tp1"][0]["llava"], steps[layout][0]["llava"]
        assert abs(results.lm_loss - base.lm_loss) <= 1e-6 * base.lm_loss
        assert all(results.relative_error(base, part) <= 1e-5 for part in ("lm", "encoder")), layout


def test_step_reference_is_sensitive_to_where_the_images_go(steps):
    """The parity above could not hold with the images misplaced: swapping them changes the step."""
    results = steps["tp1"][0]
    assert abs(results["reference/images swapped"].lm_loss - results["llava"].lm_loss) > 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_step_with_mtp_stock_llava_crashes_the_reference_trains_the_oracle_pairs(steps, layout):
    expected = TYPE_ERROR if LAYOUTS[layout]["tp"] == 1 else TP_TYPE_ERROR
    assert [results["llava/mtp"] for results in steps[layout]] == [expected] * len(steps[layout])
    layouts = [oracle_layout(positions, seed=seed) for seed, positions in enumerate(STEP_BATCHES)]
    for name in ("reference/mtp", "reference/mtp2") if layout == "tp1" else ("reference/mtp",):
        trained = {}
        for results in steps[layout]:  # each CP rank trains its own slots
            for key, pairs in results[name + "/pairs"].items():
                trained.setdefault(key, set()).update(pairs)
        depths = len(steps[layout][0][name].mtp_tokens)
        assert sorted(trained) == [(index, depth) for index in range(len(layouts)) for depth in range(1, depths + 1)]
        for (index, depth), pairs in trained.items():
            assert pairs == llava_oracle.mtp_pairs(layouts[index], depth), (layout, name, index, depth)
            assert not llava_oracle.image_targets(layouts[index], pairs, depth)
        counts = tuple(float(sum(len(trained[index, depth]) for index in range(len(layouts))))
                       for depth in range(1, depths + 1))
        assert steps[layout][0][name].mtp_tokens == counts  # what Megatron logs: the same positions


@pytest.mark.parametrize("layout", ["tp2_sp", "cp2"])
def test_step_with_mtp_the_reference_agrees_across_layouts(steps, layout):
    base, result = steps["tp1"][0]["reference/mtp"], steps[layout][0]["reference/mtp"]
    assert abs(result.mtp_loss - base.mtp_loss) <= 1e-6 * base.mtp_loss
    assert abs(result.lm_loss - base.lm_loss) <= 1e-6 * base.lm_loss
    for part in ("mtp", "lm", "encoder"):
        assert result.relative_error(base, part) <= 1e-5, (layout, part)


# ------------------------------------------------------------------ Bridge's Nemotron Omni provider


@pytest.mark.slow
@pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)
def test_bridge_nemotron_omni_provider_builds_a_llava_model_that_crashes_with_mtp():
    results = run_ranks_checked(omni_cases, 1, fixes=[], timeout=600)[0]
    assert results["mtp/built"] == "NemotronOmniModel -> LLaVAModel(RADIOViTModel, HybridModel, mtp=True)"
    assert results["plain/built"] == "NemotronOmniModel -> LLaVAModel(RADIOViTModel, HybridModel, mtp=False)"
    assert results["mtp"] == TYPE_ERROR
    assert results["plain"] == (2, 16)


# ------------------------------------------------------------------ the step's multimodal arguments


def _step_arguments(**change):
    from mtp_overlay.bed.steps.megatron_step import check_step_arguments

    arguments = dict(microbatches=[_batch(STEP_BATCHES[0])], loss="2-output", labels=True, mtp_grad_scale=None,
                     per_token=False, update=False, optimizer=None)
    arguments.update(change)
    return check_step_arguments(**arguments)


def _without_images(batch):
    return {key: value for key, value in batch.items() if key != "images"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(labels=False), "multimodal microbatches need labels=True"),
        (dict(loss="nemo-rl", per_token=True), "multimodal microbatches need labels=True and loss"),
        (dict(mtp_grad_scale="global-valid-tokens"), "without mtp_grad_scale='global-valid-tokens'"),
        (dict(microbatches=[_batch(STEP_BATCHES[0]), _without_images(_batch(STEP_BATCHES[0]))]),
         "either every microbatch holds 'images' or none does"),
        (dict(microbatches=[dict(_batch(STEP_BATCHES[0]), images=torch.zeros(3, 32, 32))]),
         r"\['images'\] must be a \[num_images, channels, h, w\] tensor"),
    ],
)
def test_multimodal_step_arguments_are_refused_naming_the_argument(change, message):
    _step_arguments()  # the plain multimodal microbatch is accepted
    with pytest.raises(ValueError, match=message):
        _step_arguments(**change)
