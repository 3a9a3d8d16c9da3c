"""verify on a Nemotron VL / Omni config, without ranks (~5 s): the shrink keeps the language model's shape,
replaces the vision tower and keeps the image token on its side of the vocabulary; the data sample carries
image placeholders; and the position oracle for combined (text + image) sequences equals the test bed's
``llava_oracle`` (plain torch, written independently from ``LLaVAModel._preprocess_data``'s convention)
on the very microbatch the engine builds. The real runs are in test_verify_runs.py (slow)."""

import json
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_overlay.bed.oracles import llava_oracle
from mtp_overlay.bed.engines.verify import multimodal_microbatch
from mtp_overlay.verification import data, oracle, vision
from mtp_overlay.verification.layout import Layout

CONFIGS = Path(__file__).parent / "configs"
OMNI = json.loads((CONFIGS / "nemotron_omni_like" / "config.json").read_text())
IMAGE_TOKEN, TOKENS_PER_IMAGE = 127, 4  # an id no drawn text token has (reserved below); CLIP 32x32, patch 16
PROPERTY = settings(max_examples=120, deadline=None)


def clip_llava(img_seq_len):
    """What ``multimodal_microbatch`` reads off a built LLaVAModel: its image token, ``img_seq_len`` and the
    CLIP tower's geometry (32 x 32 images, patch 16, one class token, dropped: 4 embeddings per image)."""
    tower = types.SimpleNamespace(img_h=32, img_w=32, patch_dim=16, class_token_len=1, add_class_token=True)
    return types.SimpleNamespace(image_token_index=IMAGE_TOKEN, sound_token_index=-300, img_seq_len=img_seq_len,
                                 vision_model=tower, _drop_vision_class_token=True)


@st.composite
def samples(draw):
    shapes = []
    for _ in range(draw(st.integers(1, 4))):
        tokens = draw(st.integers(1, 14))
        images = draw(st.sets(st.integers(0, tokens - 1), max_size=min(3, tokens)))
        shapes.append(data.Shape(tokens, draw(st.integers(0, tokens)), tuple(sorted(images))))
    return data.draw(shapes, 128, seed=draw(st.integers(0, 1000)), reserved=(IMAGE_TOKEN,))


@PROPERTY
@given(samples(), st.integers(1, 3), st.sampled_from([1, TOKENS_PER_IMAGE]))
def test_the_combined_oracle_is_llava_oracles_on_the_engines_microbatch(sequences, depth, img_seq_len):
    """Every (sequence, combined slot, target) the product's oracle allows is what ``llava_oracle.mtp_pairs``
    derives from the engine's microbatch (one row per sequence, zeros after its end; Omni's counting of
    embeddings, ``img_seq_len`` 1, and VL's of tiles alike), and none targets an image slot."""
    plan = dict(sequences=[list(s.tokens) for s in sequences], prompts=[s.prompt for s in sequences], seed=0)
    batch = multimodal_microbatch(plan, clip_llava(img_seq_len))
    assert batch["images"].shape == (sum(len(s.images) for s in sequences), 3, 32, 32)
    assert batch["num_image_tiles"].tolist() == [TOKENS_PER_IMAGE // img_seq_len] * batch["images"].shape[0]
    layout = llava_oracle.combine(batch["input_ids"], image_token_index=IMAGE_TOKEN, tokens_per_image=TOKENS_PER_IMAGE,
                                  labels=batch["labels"], loss_mask=batch["loss_mask"], fill_id=IMAGE_TOKEN)
    expected = llava_oracle.mtp_pairs(layout, depth)
    allowed = oracle.allowed(sequences, depth, "sft", TOKENS_PER_IMAGE)
    assert allowed == expected
    assert llava_oracle.image_targets(layout, expected, depth) == set()
    assert oracle.image_slot_targets(sequences, allowed, depth, TOKENS_PER_IMAGE) == []
    if not any(s.images for s in sequences):  # no image: the language model's oracle
        assert allowed == oracle.allowed(sequences, depth, "sft")


@PROPERTY
@given(samples(), st.integers(1, 2), st.data())
def test_pairs_at_image_slots_are_llava_oracles(sequences, depth, drawn):
    """On any set of trained pairs (a wrong one included), the pairs whose label or predicted slot is an
    image slot are ``llava_oracle.image_targets``' where the slot lies in the sequence."""
    plan = dict(sequences=[list(s.tokens) for s in sequences], prompts=[s.prompt for s in sequences], seed=0)
    batch = multimodal_microbatch(plan, clip_llava(1))
    layout = llava_oracle.combine(batch["input_ids"], image_token_index=IMAGE_TOKEN, tokens_per_image=TOKENS_PER_IMAGE,
                                  labels=batch["labels"], loss_mask=batch["loss_mask"], fill_id=IMAGE_TOKEN)
    real = [(row, slot) for row, length in enumerate(layout.lengths) for slot in range(max(length - depth - 1, 0))]
    picked = drawn.draw(st.sets(st.sampled_from(real), max_size=12)) if real else set()
    trained = {(row, slot, 1) for row, slot in picked}
    assert set(oracle.image_slot_targets(sequences, trained, depth, TOKENS_PER_IMAGE)) == \
        llava_oracle.image_targets(layout, trained, depth)


def test_the_omni_config_keeps_its_language_model_and_replaces_its_vision_tower():
    from test_shrink import megatron_refusals

    layout = Layout(tp=2, sp=True)
    shrunk = vision.shrink_multimodal(OMNI, layout)
    llm, given = shrunk.values["llm_config"], OMNI["llm_config"]
    assert set(llm["hybrid_override_pattern"]) == set(given["hybrid_override_pattern"])  # every layer kind
    for key in ("mtp_hybrid_override_pattern", "num_nextn_predict_layers", "mtp_use_repeated_layer",
                "num_experts_per_tok", "n_shared_experts", "tie_word_embeddings"):
        assert llm[key] == given[key], key
    assert megatron_refusals(llm, layout) == []
    changed = {change.key for change in shrunk.changes}
    assert {"llm_config.hidden_size", "llm_config.vocab_size", "vision tower", "projector_hidden_size",
            "sound_config"} <= changed
    tower = next(change for change in shrunk.changes if change.key == "vision tower")
    assert "radio" in str(tower.original) and "CLIP ViT" in str(tower.value) and "no CPU stand-in" in tower.why
    assert "sound_config" not in shrunk.values and shrunk.values["architectures"] == OMNI["architectures"]
    assert shrunk.mtp_depth == given["num_nextn_predict_layers"] and shrunk.mtp_pattern == "*E"
    assert shrunk.multimodal.image_token == OMNI["img_context_token_id"]  # 18: a vocabulary id, kept
    assert shrunk.multimodal.provider == {"sound_context_token_id": OMNI["sound_context_token_id"]}
    assert shrunk.multimodal.reserved == (OMNI["img_context_token_id"], OMNI["sound_context_token_id"])
    assert [line.split(":")[0] for line in shrunk.multimodal.not_run] == ["sound"]
    assert dict(shrunk.kept)["scatter_embedding_sequence_parallel"].startswith("False (LLaVAModel builds")


@pytest.mark.parametrize("token, expected", [
    (18, 18),  # inside the shrunk vocabulary: kept
    (131000, vision.IMAGE_ID),  # a vocabulary id the shrink cuts off: the top of the shrunk vocabulary
    (131072, 131072),  # outside the real vocabulary (131072 ids): outside the shrunk one, as it is
    (-200, -200),  # LLaVAModel's default placeholder (never a vocabulary id)
])
def test_the_image_token_keeps_its_side_of_the_vocabulary(token, expected):
    shrunk = vision.shrink_multimodal({**OMNI, "img_context_token_id": token}, Layout())
    assert shrunk.multimodal.image_token == expected and shrunk.values["img_context_token_id"] == expected
    inside = 0 <= token < OMNI["llm_config"]["vocab_size"]
    assert (0 <= expected < shrunk.vocab) == inside
    assert dict(shrunk.kept)["image token"] == ("a vocabulary id" if inside else "outside the vocabulary")


def test_the_sample_carries_image_placeholders_and_never_draws_a_reserved_id(tmp_path):
    default = data.sample(None, 128, images=True, reserved=(18, 27))
    assert [s.images for s in default.sequences] == list(data.DEFAULT_IMAGES)
    for sequence in default.sequences:
        assert [t for t in sequence.tokens if t == data.IMAGE] == [data.IMAGE] * len(sequence.images)
        assert all(sequence.tokens[at] == data.IMAGE for at in sequence.images)
        assert not {18, 27, 0} & set(sequence.tokens)
    assert all(not s.images for s in data.sample(None, 128).sequences)  # a language model's default has none
    path = tmp_path / "sample.jsonl"
    path.write_text('{"tokens": 96, "prompt": 24, "images": [8, 9, 80]}\n{"tokens": 6}\n')
    sample = data.sample(path, 128, images=True)  # scaled by 1/4: 8 and 9 meet at 2
    assert [(s.length, s.prompt, s.images) for s in sample.sequences] == [(24, 6, (2, 20)), (2, 0, ())]
    assert "image positions scaled with their sequences" in sample.note
