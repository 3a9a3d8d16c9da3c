"""Scoped CPU stand-ins for the multimodal builds (test scaffolding; each for a block, `shim.swapped`).

megatron-core's LLaVAModel (scoped to its construction, used by ``bed.models.tiny_llava``):

* ``llava_construction_stand_ins()``: CLIPViTModel's norm fallback without TE
  (``models/vision/clip_vit_model.py:20-22``) gets ``WrappedTorchNorm``, its ``.cuda()`` (``:124``)
  stays on the CPU, and LLaVAModel's TE-version assert for CP (``models/multimodal/llava_model.py:211``)
  is answered as TE 1.10 would (`cp_attention.exact_attention` stands in for TE's).

Megatron-Bridge 0.6's Nemotron VL / Omni providers:

* ``bridge_vl_clip_vision(substituted)``: the RADIO ViT those providers build runs images only through
  its dynamic-resolution packed (THD, non-causal) attention, which has no CPU stand-in: inside the
  block their ``LLaVAModel(...)`` call gets a one-layer CLIP ViT instead (`CLIP_VISION`), every other
  argument as Bridge passes it (used by ``bed.models.tiny_llava.build_bridge_vl``).
"""

import contextlib
import functools
import types

from .shim import Shim, swapped


@contextlib.contextmanager
def llava_construction_stand_ins():
    """Inside the block, megatron-core 0.19's ``LLaVAModel`` with a CLIP ViT constructs on a CPU
    without Transformer Engine: ``swapped(llava_stand_ins())``. Construction only
    (``bed.models.tiny_llava`` builds inside the block); the forward needs none of them."""
    with swapped(llava_stand_ins()):
        yield


def llava_stand_ins():
    """The Shims of `llava_construction_stand_ins`, one per upstream line (fresh replacements each call):

    * ``models/vision/clip_vit_model.py:20-22``: without Transformer Engine the default norm
      ``NORM_IMPL`` falls back to ``torch.nn.LayerNorm``, which ``build_module`` then calls with
      ``config=`` (TypeError). ``CLIPViTModel`` takes ``ln_pre_impl`` / ``ln_post_impl``, but
      ``LLaVAModel`` never passes them (``models/multimodal/llava_model.py:289``): a CLIPViTModel
      built in the block gets megatron-core's ``WrappedTorchNorm`` (the local spec's norm, a
      ``torch.nn.LayerNorm`` for ``normalization="LayerNorm"``) where its caller names none.
    * ``clip_vit_model.py:124``: ``torch.arange(seq_length).expand(1, -1).cuda()``; the ``torch``
      that module sees in the block makes that ``arange`` answer ``.cuda()`` with itself (CPU).
    * ``llava_model.py:211``: a language model with context parallelism asserts
      ``is_te_min_version("1.10.0")`` (TE's CP attention); on a CPU the test bed's exact attention
      (`cp_attention.exact_attention`) stands in for it, so the check is answered as TE 1.10.0 would answer it.
    """
    from megatron.core.models.multimodal import llava_model
    from megatron.core.models.vision import clip_vit_model

    clip = clip_vit_model.CLIPViTModel
    clip_init = vars(clip)["__init__"]

    @functools.wraps(clip_init)
    def init_with_torch_norm(self, transformer_config, transformer_layer_spec, *args, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        for index, name in enumerate(("ln_pre_impl", "ln_post_impl")):
            if len(args) <= index:
                kwargs.setdefault(name, WrappedTorchNorm)
        clip_init(self, transformer_config, transformer_layer_spec, *args, **kwargs)

    return [
        Shim(clip, "__init__", init_with_torch_norm),
        Shim(clip_vit_model, "torch", _HostArangeTorch()),
        Shim(llava_model, "is_te_min_version", _te_1_10_min_version),
    ]


class _HostArangeTorch(types.ModuleType):
    """``torch`` as ``clip_vit_model`` sees it in `llava_construction_stand_ins`: ``arange`` returns a
    tensor whose ``.cuda()`` is itself (on the CPU); everything else is torch's own attribute."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    def arange(self, *args, **kwargs):
        import torch

        return torch.arange(*args, **kwargs).as_subclass(_host_tensor_class())


@functools.cache
def _host_tensor_class():
    import torch

    class HostTensor(torch.Tensor):
        """A CPU tensor (and what is computed from it) whose ``.cuda()`` answers a plain CPU tensor."""

        def cuda(self, *args, **kwargs):
            return self.as_subclass(torch.Tensor)

    return HostTensor


def _te_1_10_min_version(version, check_equality=True):
    """``megatron.core.utils.is_te_min_version`` answered for Transformer Engine 1.10.0."""
    from packaging.version import Version

    stand_in, asked = Version("1.10.0"), Version(version)
    return stand_in >= asked if check_equality else stand_in > asked


# the vision tower ``bridge_vl_clip_vision`` builds: LLaVAModel arguments, then the ViT's config fields
# (heads of 16 channels; at TP > 2 one head per TP rank), and the projector's FFN cap
CLIP_VISION = dict(img_h=32, img_w=32, patch_dim=16, pixel_shuffle=False, dynamic_resolution=False)
CLIP_LAYERS, CLIP_HEAD_DIM, CLIP_HEADS, PROJECTOR_FFN = 1, 16, 2, 128
CLIP_WHY = {
    "vision_model_type": "RADIO runs images only through its dynamic-resolution packed (THD, non-causal) vision "
                         "attention, which has no CPU stand-in: megatron-core's CLIPViTModel (local spec) instead",
    "img_h": "CPU size: 2 x 2 patches of 16", "img_w": "CPU size: 2 x 2 patches of 16", "patch_dim": "CPU size",
    "dynamic_resolution": "CLIP tiles have one fixed size (no imgs_sizes, no vision packed_seq_params)",
    "pixel_shuffle": "off: a shuffle of 2 x 2 patches would leave one embedding per image",
    "vision": "CPU size", "projector": "CPU size",
}


@contextlib.contextmanager
def bridge_vl_clip_vision(substituted):
    """Inside the block, the Nemotron VL / Omni providers' ``LLaVAModel(...)`` gets a CLIP ViT for RADIO.

    Megatron-Bridge 0.6 builds the vision tower of Nemotron VL and Omni as RADIO ViT-H
    (``nemotron_omni_provider.py:333-372``, ``nemotron_vl_provider.py:327-354``: 32 layers, hidden 1280,
    512 x 512 dynamic-resolution images, pixel shuffle). RADIO takes images only as packed
    dynamic-resolution rows through non-causal THD attention (``llava_model.py:1081-1100``), which the
    test bed's exact attention does not stand in for. In the block, ``LLaVAModel`` as those two provider
    modules see it is megatron-core's own class called with Bridge's arguments except: the vision config
    a copy of Bridge's with ``vision_model_type="clip"``, `CLIP_LAYERS` layer(s) of `CLIP_HEADS` heads
    of `CLIP_HEAD_DIM` (at TP > 2 one head per TP rank), the `CLIP_VISION` arguments, and the
    projector's FFN at most `PROJECTOR_FFN`. Bridge's class-token drop (``drop_vision_class_token=True``)
    stays: a 32 x 32 image gives 4 embeddings. ``substituted`` (a list) gets one dict per changed value:
    ``name``, ``bridge`` (what Bridge passed), ``built``, ``why``.
    """
    import copy

    from megatron.bridge.models.nemotron_omni import nemotron_omni_provider
    from megatron.bridge.models.nemotron_vl import nemotron_vl_provider
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    def record(name, bridge, built, why):
        if bridge != built:
            substituted.append(dict(name=name, bridge=bridge, built=built, why=why))

    def with_clip(**arguments):
        vision = copy.deepcopy(arguments["vision_transformer_config"])
        tp = vision.tensor_model_parallel_size
        heads = max(CLIP_HEADS, tp)
        sizes = dict(vision_model_type="clip", num_layers=CLIP_LAYERS, num_attention_heads=heads,
                     num_query_groups=heads, kv_channels=CLIP_HEAD_DIM, hidden_size=heads * CLIP_HEAD_DIM,
                     ffn_hidden_size=2 * heads * CLIP_HEAD_DIM)
        for name, value in sizes.items():
            record(f"vision.{name}", getattr(vision, name), value,
                   CLIP_WHY["vision_model_type" if name == "vision_model_type" else "vision"])
            setattr(vision, name, value)
        projection = copy.deepcopy(arguments["vision_projection_config"])
        ffn = min(projection.ffn_hidden_size, PROJECTOR_FFN)
        record("vision_projection.ffn_hidden_size", projection.ffn_hidden_size, ffn, CLIP_WHY["projector"])
        projection.ffn_hidden_size = ffn
        for name, value in CLIP_VISION.items():
            record(name, arguments.get(name), value, CLIP_WHY[name])
        return LLaVAModel(**{**arguments, **CLIP_VISION, "vision_transformer_config": vision,
                             "vision_projection_config": projection})

    with swapped([Shim(module, "LLaVAModel", with_clip) for module in (nemotron_omni_provider, nemotron_vl_provider)]):
        yield


# --- Megatron-Bridge 0.6's training step (gpt_step) on a machine without its optional packages ---------

# importer module -> the dotted roots its import statements get stand-ins for (only those it imports
# unguarded; the upstream lines are in `bridge_training_import_stand_ins`)
