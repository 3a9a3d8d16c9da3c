"""Shrink a Nemotron VL / Omni config and keep its shape: its language model as `shrink` shrinks any, its
vision tower kept but tiny, and what cannot run on a CPU named.

Megatron-Bridge 0.6.2 builds the Hugging Face architectures ``NemotronH_Nano_VL_V2`` and
``NemotronH_Nano_Omni_Reasoning_V3`` (``models/nemotron_vl``, ``models/nemotron_omni``) as megatron-core's
``LLaVAModel``: a RADIO ViT, an MLP projector and a HybridModel language model whose config sits in
the HF config's ``llm_config`` (``nemotron_omni_bridge.py:98-104``). Here:

* ``llm_config`` goes through `shrink.shrink` (every structural choice kept: layer pattern, MTP pattern
  and depth, repeated layer, GQA ratio, MoE top-k, ...); its changes are named ``llm_config.<key>``;
* the vision tower is kept, tiny: RADIO runs images only through its dynamic-resolution packed (THD,
  non-causal) attention, which has no CPU stand-in, so the test bed builds a one-layer CLIP ViT in its
  place (32 x 32 images, patch 16, Bridge's class-token drop: 4 embeddings per image) and says, per
  LLaVAModel argument, what it substituted (`VISION`: the plan; the engine reports what it built);
* the image token keeps its side of the vocabulary: a vocabulary id stays one (moved to the top of the
  shrunk vocabulary if the shrink cuts it off), an id outside it stays outside (LLaVAModel, and the MTP
  fix, treat the two differently: ``llava_model.py:1224``);
* the sound encoder (Parakeet, ``sound_config``) is not built and the batches hold no sound: said as
  not run. Sound slots would need the test bed to run HF's Parakeet encoder, which it does not.

Everything else (``projector_hidden_size`` aside: CPU size) is handed to Bridge as the config has it.
Pure Python: the checks run before any process starts.
"""

from __future__ import annotations

import dataclasses

from .layout import Layout
from .shrink import FFN, VOCAB, Change, Multimodal, Shrunk, shrink

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

# what marks a Hugging Face config as multimodal, and where a Nemotron VL / Omni config keeps its language model
MULTIMODAL_KEYS = ("vision_config", "audio_config", "sound_config", "vision_tower", "mm_projector_type")
LANGUAGE_KEY = "llm_config"
# the vision tower the test bed builds instead of RADIO (bed/runtime/multimodal_stand_ins.py CLIP_VISION, CLIP_LAYERS)
VISION = dict(model="CLIP ViT (megatron-core CLIPViTModel)", layers=1, image_size=32, patch=16, class_token="dropped")
VISION_WHY = ("RADIO runs images only through its dynamic-resolution packed (THD, non-causal) attention, which has "
              "no CPU stand-in")
SCATTER = "False (LLaVAModel builds its language model so whatever the provider says: llava_model.py:239,257)"
SOUND_ID = VOCAB - 2  # the sound token when the config names none (or 0): an id no text token is drawn from
PADDING = 0  # the batches' padding id (data.draw never draws it)
IMAGE_ID = VOCAB - 1  # where an in-vocabulary image token the shrink would cut off goes


def is_multimodal(values: Mapping[str, object]) -> bool:
    """Whether a Hugging Face config has a vision tower or audio encoder (`MULTIMODAL_KEYS`)."""
    return any(values.get(key) for key in MULTIMODAL_KEYS)


def check_multimodal(values: Mapping[str, object], name: str) -> None:
    """ValueError naming ``--hf-config`` for a multimodal config verify cannot build: one whose language
    model is not an ``llm_config`` (the families Megatron-Bridge builds as something else than
    megatron-core's LLaVAModel, which fix mtp-multimodal does not reach)."""
    found = [key for key in MULTIMODAL_KEYS if values.get(key)]
    if not isinstance(values.get(LANGUAGE_KEY), dict):
        raise ValueError(
            f"--hf-config {name}: a multimodal config ({', '.join(found)}) without {LANGUAGE_KEY}: verify runs the "
            "Nemotron VL / Omni layout (the language model's config in llm_config), which Megatron-Bridge builds "
            "as megatron-core's LLaVAModel; other vision-language families are not built by the test bed"
        )


# the vision side's keys, per key space (shrink.KEYSPACES): a Hugging Face config's (nemotron_omni_bridge.py:
# 106-120) and a Bridge VL / Omni provider's fields (nemotron_omni_provider.py:66-99, 205-210)
KEYS = {
    "hf": dict(image="img_context_token_id", sound="sound_context_token_id", projector="projector_hidden_size",
               sound_encoder="sound_config"),
    "provider": dict(image="image_token_index", sound="sound_context_token_id", projector="vision_proj_ffn_hidden_size",
                     sound_encoder="has_sound"),
}
PROVIDER_FIELDS = tuple(KEYS["provider"].values())  # what the engine describes of a VL / Omni provider


def shrink_multimodal(values: Mapping[str, object], layout: Layout, *, mtp_num_layers: int | None = None,
                      repeated_layer: bool | None = None, layers: str = "auto") -> Shrunk:
    """The CPU-size twin of a Nemotron VL / Omni Hugging Face config (module docstring): `shrink`'s of
    its ``llm_config`` (with ``mtp_num_layers``, ``repeated_layer`` and ``layers`` as `shrink` takes
    them; changes named ``llm_config.<key>``), the whole config as ``values``, `Multimodal` as
    ``multimodal``."""
    llm = values.get(LANGUAGE_KEY)
    if not isinstance(llm, dict):
        raise ValueError(f"a multimodal config needs its language model's config in {LANGUAGE_KEY}")
    language = shrink(llm, layout, keyspace="hf", mtp_num_layers=mtp_num_layers, repeated_layer=repeated_layer,
                      layers=layers)
    config = {key: value for key, value in values.items() if key != KEYS["hf"]["sound_encoder"]}
    config[LANGUAGE_KEY] = language.values
    changes = [dataclasses.replace(change, key=f"{LANGUAGE_KEY}.{change.key}") for change in language.changes]
    vision = values.get("vision_config")
    tower = vision.get("model_type") if isinstance(vision, dict) else None
    video = isinstance(vision, dict) and bool(vision.get("separate_video_embedder"))
    return _vision_side(values, config, changes, language, "hf", _vocab(llm), tower, video)


def shrink_provider_multimodal(fields: Mapping[str, object], layout: Layout, *, mtp_num_layers: int | None = None,
                               repeated_layer: bool | None = None, layers: str = "auto") -> Shrunk:
    """The CPU-size twin of a Megatron-Bridge Nemotron VL / Omni provider's fields (as the engine describes
    them: `shrink.PROVIDER_FIELDS` and `PROVIDER_FIELDS`): `shrink_multimodal` in the provider's key space."""
    language = shrink(fields, layout, keyspace="provider", mtp_num_layers=mtp_num_layers,
                      repeated_layer=repeated_layer, layers=layers)
    vocab = fields.get("vocab_size")
    tower = fields.get("vision_model_type")
    return _vision_side(fields, dict(language.values), list(language.changes), language, "provider",
                        vocab if isinstance(vocab, int) else None, tower if isinstance(tower, str) else None, False)


def _vision_side(given: Mapping[str, object], values: dict[str, object], changes: list[Change], language: Shrunk,
                 keyspace: str, real_vocab: int | None, tower: object, video: bool) -> Shrunk:
    """``language`` (the language model's `Shrunk`) with ``values`` and ``changes`` completed by the vision
    side of ``given`` (the config or fields as given): the tower, the projector, the image and sound tokens."""
    keys = KEYS[keyspace]
    changes.append(Change("vision tower", f"{tower or 'the config'}'s ViT", f"{VISION['model']}, {VISION['layers']} "
                          f"layer, {VISION['image_size']}x{VISION['image_size']} images, patch {VISION['patch']}, "
                          f"class token {VISION['class_token']}", VISION_WHY))
    projector = given.get(keys["projector"])
    if isinstance(projector, int) and projector > FFN:
        values[keys["projector"]] = FFN
        changes.append(Change(keys["projector"], projector, FFN, "CPU size"))
    image = _token(given.get(keys["image"]), real_vocab, language.vocab, IMAGE_ID)
    if image is not None and image != given.get(keys["image"]):
        values[keys["image"]] = image
        changes.append(Change(keys["image"], given.get(keys["image"]), image,
                              "the image token keeps its side of the vocabulary"))
    sound = _token(given.get(keys["sound"]), real_vocab, language.vocab, SOUND_ID)
    sound = SOUND_ID if sound in (None, PADDING) else sound  # a provider's 0 means none was given
    not_run = []
    if given.get(keys["sound_encoder"]):
        if keyspace == "provider":
            values[keys["sound_encoder"]] = False
        changes.append(Change(keys["sound_encoder"], given.get(keys["sound_encoder"]) if keyspace == "provider"
                              else "the sound encoder", "not built" if keyspace == "hf" else False,
                              "the test bed runs no sound encoder (HF's Parakeet): the batches hold no sound clips"))
        not_run.append("sound: the config's sound encoder is not built and the batches hold no sound clips; MTP "
                       "positions around sound slots are not checked")
    if video:
        not_run.append("video: the temporal video embedder (RADIO's) is not built; the batches hold images only")
    side = "Bridge's default" if image is None else "a vocabulary id" if 0 <= image < language.vocab else \
        "outside the vocabulary"
    kept = [(what, SCATTER if what == "scatter_embedding_sequence_parallel" else value)
            for what, value in language.kept]
    kept.append(("image token", side))
    reserved = tuple(sorted({sound} | ({image} if image is not None else set())))
    multimodal = Multimodal(image_token=image, reserved=reserved, provider=dict(sound_context_token_id=sound),
                            not_run=tuple(not_run), vision=dict(VISION))
    return dataclasses.replace(language, values=values, changes=tuple(changes), kept=tuple(kept), multimodal=multimodal)


def _token(value: object, real_vocab: int | None, vocab: int, top: int) -> int | None:
    """A special token's id in the shrunk vocabulary of ``vocab`` ids: inside stays inside (at ``top``
    where the shrink cuts it off), outside stays outside (``vocab`` or above: unchanged if already)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    inside = value >= 0 and (real_vocab is None or value < real_vocab)
    if inside:
        return value if value < vocab else top
    return value if value < 0 or value >= vocab else vocab


def _vocab(llm: Mapping[str, object]) -> int | None:
    vocab = llm.get("vocab_size")
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


