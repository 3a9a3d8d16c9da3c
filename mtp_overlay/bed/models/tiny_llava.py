"""A tiny stock-megatron-core LLaVAModel with an MTP HybridModel, its batches, and the combined-ids reference.

Megatron-Bridge 0.6 builds Nemotron VL / Omni as megatron-core's ``LLaVAModel``
(``models/multimodal/llava_model.py``; ``nemotron_omni_provider.py:333``): a language config with
``language_model_type="nemotron5-hybrid..."`` makes the language model a ``HybridModel``
(``llava_model.py:236-254``, ``scatter_embedding_sequence_parallel=False``) whose MTP layers the
provider keeps. Here: that HybridModel from the test bed's local spec (``tiny_hybrid``, pattern
``"*-*-/*-"``), a one-layer CLIP ViT (hidden 32, 32x32 images, patch 16: 4 patches, the class token
dropped: 4 embeddings per image) from ``get_vit_layer_with_local_spec()``, and an MLP projector made
of the language spec's MLP submodules (as Bridge's providers derive it). Construction on a CPU runs
inside ``multimodal_stand_ins.llava_construction_stand_ins()`` (CLIP's norm fallback and ``.cuda()``, LLaVA's
TE-version check for CP).

``CombinedIdsReference`` holds the same modules and runs the language model *directly* on the
hand-built combined layout of ``llava_oracle`` (ids, labels, loss mask, sharded for CP/SP as
LLaVAModel shards), with ``input_ids`` given: the reference an MTP fix for LLaVAModel must equal.
Without MTP, LLaVAModel and the reference agree already (the test bed checks it at TP1, TP2+SP and
CP2), which is what makes the reference trustworthy.
"""

import functools

from ..runtime.device import rank_device
from ..oracles import llava_oracle

IMAGE_TOKEN_INDEX = 127  # a real vocabulary id, as Nemotron Omni's (a positive image_token_index)
IMG_SIZE, PATCH_DIM = 32, 16
# what the vision tower and projector take from the language config (their SP and CP stay off)
ENCODER_SETTINGS = ("tensor_model_parallel_size", "use_cpu_initialization", "hidden_dropout", "attention_dropout")


def build_tiny_llava(
    *,
    seed=1234,
    hybrid_layer_pattern="*-*-/*-",
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    max_sequence_length=64,
    vision_hidden_size=32,
    vision_attention_heads=2,
    image_token_index=IMAGE_TOKEN_INDEX,
    drop_vision_class_token=True,
    sequence_parallel=False,
    stand_ins=None,
    **config_overrides,
):
    """A LLaVAModel: HybridModel language model (MTP depths from the pattern's ``/`` parts), CLIP ViT,
    MLP projector; identical weights at any TP/CP from one seed (``use_cpu_initialization``).

    TP and CP sizes come from ``parallel_state``; the vision tower and projector run with sequence
    and context parallelism off (as Bridge's providers configure them). ``config_overrides`` go to
    the language TransformerConfig. ``stand_ins``: the ``shim.Shim`` list swapped in for the
    construction; None: ``multimodal_stand_ins.llava_stand_ins()`` on a CPU rank (`device.rank_device`), else none.
    """
    import torch
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import ModelType
    from megatron.core.transformer.spec_utils import get_submodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..runtime import multimodal_stand_ins, shim
    from .tiny_hybrid import local_hybrid_stack_spec

    language = language_config(hybrid_layer_pattern, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                               sequence_parallel=sequence_parallel, **config_overrides)
    language.language_model_type = "nemotron5-hybrid"  # llava_model.py:236: the language model is a HybridModel
    common = {name: getattr(language, name) for name in ENCODER_SETTINGS}
    vision = TransformerConfig(**common, num_layers=1, hidden_size=vision_hidden_size,
                               num_attention_heads=vision_attention_heads)
    vision.vision_model_type = "clip"
    projection = TransformerConfig(**common, num_layers=1, hidden_size=hidden_size, ffn_hidden_size=hidden_size,
                                   num_attention_heads=num_attention_heads)
    spec = local_hybrid_stack_spec()
    projection_spec = get_submodules(spec.submodules.mlp_layer.submodules.mlp)  # the language MLP's, as Bridge's

    torch.manual_seed(seed)
    if stand_ins is None:
        stand_ins = multimodal_stand_ins.llava_stand_ins() if rank_device().type == "cpu" else []
    with shim.swapped(stand_ins):
        model = LLaVAModel(
            language_transformer_config=language,
            language_transformer_layer_spec=spec,
            language_vocab_size=vocab_size,
            language_max_sequence_length=max_sequence_length,
            vision_transformer_config=vision,
            vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
            drop_vision_class_token=drop_vision_class_token,
            vision_projection_config=projection,
            vision_projection_layer_spec=projection_spec,
            vision_projection_type="mlp",
            language_position_embedding_type="rope",
            img_h=IMG_SIZE,
            img_w=IMG_SIZE,
            patch_dim=PATCH_DIM,
            hybrid_layer_pattern=hybrid_layer_pattern,
            image_token_index=image_token_index,
        )
    # LLaVAModel sets no model_type (the schedule reads it); its builder does, as Megatron-Bridge's
    # does for every provided model (models/model_provider.py:751)
    model.model_type = ModelType.encoder_or_decoder
    return model.to(rank_device())


def language_config(hybrid_layer_pattern, *, hidden_size=64, num_attention_heads=4, sequence_parallel=False,
                    **config_overrides):
    """The HybridModel TransformerConfig of the multimodal models here (as ``tiny_hybrid``'s): layers
    and MTP depths from ``hybrid_layer_pattern`` (attention '*' and MLP '-' only), TP/CP from
    ``parallel_state``, CPU initialisation, no dropout."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern
    from megatron.core.transformer.transformer_config import TransformerConfig

    parsed = parse_hybrid_pattern(hybrid_layer_pattern)
    symbols = set((parsed.main_pattern or "") + (parsed.mtp_pattern or "")) - {"|"}
    if not parsed.main_pattern or not symbols <= {"*", "-"}:
        raise ValueError(
            f"hybrid_layer_pattern must be attention '*' and MLP '-' layers, with '/'-separated MTP "
            f"depths (e.g. '*-*-/*-'), got {hybrid_layer_pattern!r}"
        )
    return TransformerConfig(**{
        "num_layers": len(parsed.main_pattern.replace("|", "")),
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "sequence_parallel": sequence_parallel,
        "mtp_num_layers": parsed.mtp_num_depths or None,
        "is_hybrid_model": True,
        "use_cpu_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        **config_overrides,
    })


def build_tiny_mimo(*, seed=1234, hybrid_layer_pattern="*-*-/*-", vocab_size=128, max_sequence_length=64,
                    special_token_ids=None, **config_overrides):
    """megatron-core's ``MimoModel`` (``models/mimo/model/base.py``) around the same HybridModel, no
    modality encoders: its forward still hands the language model ``input_ids=None`` with the combined
    ``decoder_input`` (``base.py:845-853``), so MTP meets the same missing ids.

    ``special_token_ids``: modality name -> token id (MimoModelConfig's); without an encoder for it,
    its slots hold zero embeddings (``align_embeddings_by_token_positions`` places the text around
    them): the combined layout of a batch with that modality, its embeddings aside."""
    import torch
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.models.mimo import MimoModel, MimoModelConfig
    from megatron.core.transformer.enums import ModelType
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .tiny_hybrid import local_hybrid_stack_spec

    language = ModuleSpec(module=HybridModel, params=dict(
        config=language_config(hybrid_layer_pattern, **config_overrides), hybrid_stack_spec=local_hybrid_stack_spec(),
        vocab_size=vocab_size, max_sequence_length=max_sequence_length, hybrid_layer_pattern=hybrid_layer_pattern,
        position_embedding_type="rope",
    ))
    torch.manual_seed(seed)
    model = MimoModel(MimoModelConfig(language_model_spec=language, modality_submodules_spec={},
                                      special_token_ids=dict(special_token_ids or {})))
    model.model_type = ModelType.encoder_or_decoder
    return model.to(rank_device())


OMNI_SOUND_TOKEN_INDEX = 126  # an id make_llava_batch's text may hold: callers keep it out of their text


def build_bridge_omni(*, seed=1234, hybrid_layer_pattern="*-*-", mtp_hybrid_override_pattern="*-",
                      sound_context_token_id=OMNI_SOUND_TOKEN_INDEX):
    """Megatron-Bridge 0.6's ``NemotronOmniModelProvider.provide()``, tiny, on this rank:
    ``NemotronOmniModel`` around megatron-core's ``LLaVAModel`` (RADIO ViT, HybridModel with MTP).

    What it takes on a CPU (TP1; the provider is made directly, not from a Hugging Face config):
    Bridge imported through the TE import stand-in (``bridge.import_bridge``); the RADIO ViT-H sizes
    that ``_build_vision_config`` hard-codes (``nemotron_omni_provider.py:98-122``: 32 layers, hidden
    1280) shrunk in a subclass; ``language_model_type="nemotron5-hybrid"`` (the field defaults to
    ``""``, :70, which makes LLaVAModel build a GPTModel from the hybrid spec); the provider module's
    TE specs swapped for local ones (``bridge.bridge_vl_local_specs``) and the test bed's local
    provider overrides (``bridge.local_overrides``: local attention, fusions off; the process-wide
    attention-backend variables are put back after the build, as ``parity`` does); and a
    ``sound_context_token_id`` no text token has: LLaVAModel treats every ``input_ids ==
    sound_token_index`` position as a sound slot even without sound (``llava_model.py:659``, its
    sound embeddings are an empty tensor, :1203), and with the default 0 a text token 0 makes
    ``_preprocess_data`` fail (``torch.cat`` of no clips, :672). Images would need RADIO's
    dynamic-resolution packed (THD, non-causal) vision attention, which the CPU attention stand-in
    does not provide: text-only batches (``images`` of shape [0, 3, h, w]) run.
    """
    import dataclasses

    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    from . import bridge
    from ..runtime import multimodal_stand_ins

    bridge.import_bridge()
    from megatron.bridge.models.nemotron_omni.nemotron_omni_provider import NemotronOmniModelProvider

    @dataclasses.dataclass
    class TinyOmniProvider(NemotronOmniModelProvider):
        def _build_vision_config(self, language_cfg):
            vision = super()._build_vision_config(language_cfg)
            vision.num_layers, vision.hidden_size, vision.num_attention_heads = 1, 32, 2
            vision.ffn_hidden_size, vision.kv_channels, vision.num_query_groups = 64, 16, 2
            return vision

    provider = TinyOmniProvider(
        hybrid_layer_pattern=hybrid_layer_pattern, mtp_hybrid_override_pattern=mtp_hybrid_override_pattern,
        mtp_num_layers=1 if mtp_hybrid_override_pattern else None, hidden_size=64, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, ffn_hidden_size=128, vocab_size=128, make_vocab_size_divisible_by=1,
        seq_length=64, image_token_index=IMAGE_TOKEN_INDEX, sound_context_token_id=sound_context_token_id,
        vision_proj_ffn_hidden_size=64, language_model_type="nemotron5-hybrid",
    )
    overrides = dict(use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    overrides.update(bridge.local_overrides(provider))
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=overrides)
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(seed)
    with bridge.bridge_vl_local_specs(), multimodal_stand_ins.llava_construction_stand_ins(), bridge.own_attention_backend():
        model = provider.provide()
    return model.to(rank_device())


def build_bridge_vl(provider, *, seed=1234, sequence_parallel=False, recipe=None):
    """The model a Megatron-Bridge Nemotron VL / Omni ``provider`` (not finalized, as
    ``AutoBridge.from_hf_config(...).to_megatron_provider()`` returns it) builds for this rank, with a CLIP
    ViT for its RADIO vision tower; and the list of what that substitution changed.

    Bridge's own ``provide()`` (``NemotronOmniModel`` or ``NemotronVLModel`` around megatron-core's
    ``LLaVAModel``, its HybridModel language model from the provider) through `bridge.build_provided`
    (this rank's TP / CP, CPU initialisation, no dropout, local specs; ``recipe`` fields on top), inside
    ``bridge.bridge_vl_local_specs`` (the provider modules' TE specs), ``llava_construction_stand_ins``
    and ``bridge_vl_clip_vision`` (RADIO -> a one-layer CLIP ViT, 32 x 32 images, patch 16: the list it
    fills is returned). The wrapper gets the ``model_type`` Bridge's ``provide_distributed_model`` sets
    on every provided model (``models/model_provider.py:751``), which the schedule reads, and its
    LLaVAModel the one `build_tiny_llava` gives (what `CombinedIdsReference` takes over).
    """
    from megatron.core.transformer.enums import ModelType

    from . import bridge
    from ..runtime import multimodal_stand_ins

    substituted = []
    with bridge.bridge_vl_local_specs(), multimodal_stand_ins.llava_construction_stand_ins(), \
            multimodal_stand_ins.bridge_vl_clip_vision(substituted):
        model = bridge.build_provided(provider, seed=seed, sequence_parallel=sequence_parallel,
                                      scatter_embedding_sequence_parallel=False, recipe=recipe)
    model.model_type = model.llava_model.model_type = ModelType.encoder_or_decoder
    return model, substituted


def tokens_per_image(model):
    """Embeddings per image tile, from the model's CLIP geometry and class-token handling (first
    principles; LLaVAModel's own count is ``model.img_seq_len``)."""
    vision = model.vision_model
    return llava_oracle.image_tokens(
        vision.img_h, vision.img_w, vision.patch_dim, class_token_len=vision.class_token_len,
        drop_class_token=model._drop_vision_class_token, add_class_token=vision.add_class_token,
    )


def make_llava_batch(image_positions, *, seq_length=16, vocab_size=128, image_token_index=IMAGE_TOKEN_INDEX,
                     prompt=4, seed=0):
    """A batch with an image placeholder at each of ``image_positions`` (one list per sample).

    Keys: ``input_ids`` [b, seq_length] (random text ids, never the image token, and the
    placeholders), ``labels`` (the same stream shifted left by one, so a label may name a
    placeholder, as LLaVA's own convention), ``loss_mask`` (float, 0 over the first ``prompt``
    tokens), ``position_ids``, and ``images`` [num_images, 3, 32, 32] in reading order.
    """
    import torch

    if not isinstance(image_positions, (list, tuple)) or not image_positions:
        raise ValueError(
            f"image_positions must be a non-empty list of per-sample position lists, got {image_positions!r}")
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab_size - 1, (len(image_positions), seq_length + 1), generator=generator)
    stream[stream == image_token_index] = 0
    count = 0
    for b, positions in enumerate(image_positions):
        for position in positions:
            if not isinstance(position, int) or not 0 <= position < seq_length:
                raise ValueError(f"image_positions[{b}] must hold ints in [0, {seq_length}), got {positions!r}")
            stream[b, position] = image_token_index
            count += 1
    loss_mask = torch.ones(len(image_positions), seq_length)
    loss_mask[:, :prompt] = 0
    return {
        "input_ids": stream[:, :-1].contiguous(),
        "labels": stream[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq_length).repeat(len(image_positions), 1),
        "images": torch.randn(count, 3, IMG_SIZE, IMG_SIZE, generator=generator),
    }


def combined_layout(model, batch, *, num_image_tiles=None):
    """The oracle's CombinedLayout of ``batch`` for ``model`` (a LLaVAModel or CombinedIdsReference):
    ``llava_oracle.mtp_fill_id`` at image slots; ``num_image_tiles``: tiles per image (default 1 each)."""
    per_tile = tokens_per_image(model)
    images = int((batch["input_ids"] == model.image_token_index).sum())
    tiles = [1] * images if num_image_tiles is None else [int(count) for count in num_image_tiles]
    return llava_oracle.combine(
        batch["input_ids"].cpu(), image_token_index=model.image_token_index,
        tokens_per_image=[count * per_tile for count in tiles],
        labels=_cpu(batch.get("labels")), loss_mask=_cpu(batch.get("loss_mask")),
        fill_id=llava_oracle.mtp_fill_id(model.image_token_index, model.language_model.vocab_size),
        max_length=model._language_max_sequence_length,
    )


def language_model_call(model, batch):
    """LLaVAModel's language model called as ``LLaVAModel.forward`` calls it (``llava_model.py:1267-1276``):
    ``input_ids=None``, ``position_ids=None``, ``decoder_input`` (here the embeddings of the combined
    ids, full sequence at TP1), the combined ``labels``, no ``loss_mask``. Returns its output."""
    layout = combined_layout(model, batch)
    device = next(model.parameters()).device
    embeddings = model.language_model.embedding(input_ids=layout.ids.to(device), position_ids=None)
    return model.language_model(
        input_ids=None, position_ids=None, attention_mask=None, decoder_input=embeddings,
        labels=layout.labels.to(device),
    )


def __getattr__(name):
    """``CombinedIdsReference`` is made on first use: importing this module imports no megatron-core."""
    if name == "CombinedIdsReference":
        return _combined_ids_reference_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _combined_ids_reference_class():
    from megatron.core.transformer.module import MegatronModule

    class CombinedIdsReference(MegatronModule):
        """LLaVAModel's vision tower, projector and language model, with the language model run directly
        on the oracle's combined layout: what an MTP fix for LLaVAModel must equal.

        ``forward`` takes LLaVAModel's arguments (full-length text ``input_ids`` with placeholders,
        ``labels``, ``loss_mask``, ``images``); it embeds the images (class tokens dropped as the model
        is configured) and the combined ids, puts each image's embeddings at its slots (zeros at padding,
        as LLaVAModel), shards embeddings, ids, labels and mask for CP/SP with ``llava_oracle.shard``
        (and megatron-core's sequence-parallel scatter for the embeddings), and calls the language model
        with ``input_ids`` (the combined ids) and ``loss_mask`` (the combined mask). Returns
        ``(output, loss_mask)`` like LLaVAModel. Holds ``llava``'s modules (same parameter names):
        build it from its own LLaVAModel to compare against another one built from the same seed.
        """

        def __init__(self, llava):
            super().__init__(config=llava.config)
            self.vision_model, self.vision_projection = llava.vision_model, llava.vision_projection
            self.language_model = llava.language_model
            self.image_token_index, self.img_seq_len = llava.image_token_index, llava.img_seq_len
            self._drop_vision_class_token = llava._drop_vision_class_token
            self._language_max_sequence_length = llava._language_max_sequence_length
            self.model_type = llava.model_type

        def set_input_tensor(self, input_tensor):
            """Megatron's schedule hands the model its pipeline input ([None] without pipelining); like
            LLaVAModel with encoder and decoder on one stage, the vision model holds it."""
            self.vision_model.set_input_tensor(input_tensor[0] if isinstance(input_tensor, list) else input_tensor)

        def combined_embeddings(self, images, layout):
            """[combined_length, batch, hidden]: the embedding of ``layout.ids`` at text slots, each image's
            projected vision embeddings (class tokens dropped as configured) at its slots, zeros at padding."""
            import torch

            device = next(self.parameters()).device
            text = self.language_model.embedding(input_ids=layout.ids.to(device), position_ids=None)  # [S, b, h]
            kinds = layout.kinds.to(device).transpose(0, 1).unsqueeze(-1)
            if images.shape[0] == 0:  # a batch without images: LLaVAModel runs no vision tower either
                return torch.where(kinds == llava_oracle.TEXT, text, 0.0)
            vision = self.vision_model(images)  # [images, class tokens + patches, h_vision]
            if self._drop_vision_class_token:
                vision = vision[:, self.vision_model.class_token_len:, :]
            vision = self.vision_projection(vision.permute(1, 0, 2).contiguous())  # [tokens, images, h]
            rows = vision.permute(1, 0, 2).reshape(-1, vision.shape[-1])  # image after image, token after token
            placed = rows[layout.image_rows.clamp(min=0).to(device)].transpose(0, 1)  # [S, b, h]
            return torch.where(kinds == llava_oracle.IMAGE, placed, torch.where(kinds == llava_oracle.TEXT, text, 0.0))

        def forward(self, images, input_ids, position_ids, attention_mask, labels=None, loss_mask=None,
                    num_image_tiles=None, **kwargs):
            """LLaVAModel's arguments (``position_ids`` unused: LLaVAModel's RoPE language model gets none
            either, ``llava_model.py:1269``); returns ``(output, this rank's combined loss mask)``.

            ``num_image_tiles``: LLaVAModel's count per image of its ``img_seq_len`` embeddings (one tile
            of `tokens_per_image` each by default; Nemotron Omni's provider sets ``img_seq_len = 1`` and
            counts embeddings, ``nemotron_omni_provider.py:374-379``): the reference embeds one tile per
            image from its vision geometry and refuses counts that say otherwise."""
            from megatron.core import parallel_state, tensor_parallel

            if kwargs:
                raise TypeError(f"CombinedIdsReference.forward: unsupported arguments {sorted(kwargs)}")
            if labels is None:
                raise ValueError("CombinedIdsReference needs labels and loss_mask (the SFT layout of LLaVAModel)")
            if num_image_tiles is not None:
                per_image = [int(count) * self.img_seq_len for count in num_image_tiles.tolist()]
                if any(count != tokens_per_image(self) for count in per_image):
                    raise ValueError(
                        f"num_image_tiles {num_image_tiles.tolist()} x img_seq_len {self.img_seq_len} must give one "
                        f"tile of {tokens_per_image(self)} embeddings per image (the reference's vision geometry)")
            layout = combined_layout(self, dict(input_ids=input_ids, labels=labels, loss_mask=loss_mask))
            device = input_ids.device
            embeddings = self.combined_embeddings(images, layout)  # [S, b, h]

            tp = parallel_state.get_tensor_model_parallel_world_size()
            cp = parallel_state.get_context_parallel_world_size()
            sharding = dict(tp=tp, cp=cp, sequence_parallel=self.config.sequence_parallel,
                            cp_rank=parallel_state.get_context_parallel_rank())
            embeddings = llava_oracle.shard(embeddings.transpose(0, 1), pad_value=0.0, **sharding).transpose(0, 1)
            if self.config.sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
            fill = llava_oracle.mtp_fill_id(self.image_token_index, self.language_model.vocab_size)
            ids = llava_oracle.shard(layout.ids, pad_value=fill, **sharding).to(device)
            local_labels = llava_oracle.shard(layout.labels, pad_value=llava_oracle.IGNORE_INDEX, **sharding).to(device)
            local_mask = llava_oracle.shard(layout.loss_mask, pad_value=0, **sharding).to(device)
            output = self.language_model(
                input_ids=ids, position_ids=None, attention_mask=attention_mask, decoder_input=embeddings.contiguous(),
                labels=local_labels, loss_mask=local_mask,
            )
            return output, local_mask

    return CombinedIdsReference


def _cpu(tensor):
    return None if tensor is None else tensor.cpu()
