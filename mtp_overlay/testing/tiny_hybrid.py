"""A tiny stock-megatron-core HybridModel with MTP, built from local (non-TE) modules.

megatron-core 0.19 deprecates GPTModel for HybridModel (Nemotron-H/Super are HybridModels), but
its only shipped hybrid spec (``models/hybrid/hybrid_layer_specs.py``) is made of Transformer Engine
modules, which do not install on a CPU machine. The spec here is assembled from the pieces of
``get_gpt_layer_local_spec()``: attention ('*') is a TransformerLayer holding the input norm and
self-attention, MLP ('-') is ``ssm.mlp_layer.MLPLayer`` holding the pre-MLP norm and MLP, and the
MTP block is ``get_mtp_layer_spec_for_backend(None, LocalSpecProvider())`` whose inner layers
HybridModel builds from the MTP pattern. The final norm ``HybridStack`` hard-codes as ``TENorm``
is swapped for ``WrappedTorchNorm`` by a CPU shim (``cpu_shims``).

With the default pattern ``"*-*-/*-"`` the model holds the same parameters, in the same order and
(from one seed) with the same values as ``tiny_gpt.build_tiny_gpt()`` (2 layers, 1 MTP layer):
``is_hybrid_model=True`` scales the output-layer init by ``num_layers`` (4 pattern layers) where
GPT scales by ``2 * num_layers`` (2 transformer layers). Mamba ('M') layers need ``mamba_ssm``
kernels and are not supported here.
"""

from .tiny_gpt import _device


def local_hybrid_stack_spec(config=None):
    """``ModuleSpec(HybridStack, HybridStackSubmodules)`` of attention, MLP and MTP from local modules.

    ``config``: a config whose ``normalization`` picks the norm (a Megatron-Bridge HybridModelProvider
    calls its ``hybrid_stack_spec`` with itself); None keeps megatron-core's local default.
    """
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gpt = get_gpt_layer_local_submodules(normalization=getattr(config, "normalization", None))
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda
    )
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda)
    mtp_layer = get_mtp_layer_spec_for_backend(mtp_model_layer_spec=None, backend=LocalSpecProvider())
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
            mtp_block_spec=ModuleSpec(
                module=MultiTokenPredictionBlock,
                submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]),
            ),
        ),
    )


def build_tiny_hybrid(
    *,
    seed=1234,
    hybrid_layer_pattern="*-*-/*-",
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    max_sequence_length=64,
    sequence_parallel=False,
    scatter_embedding_sequence_parallel=True,
    **config_overrides,
):
    """A HybridModel (local spec, RoPE, no dropout); MTP depths from the pattern's ``/`` parts.

    TP and CP sizes come from ``parallel_state``; ``num_layers`` and ``mtp_num_layers`` from
    ``hybrid_layer_pattern`` (symbols '*' attention and '-' MLP only). ``config_overrides`` go to
    TransformerConfig; ``scatter_embedding_sequence_parallel`` goes to HybridModel.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parsed = parse_hybrid_pattern(hybrid_layer_pattern)
    symbols = set((parsed.main_pattern or "") + (parsed.mtp_pattern or "")) - {"|"}
    if not parsed.main_pattern or not symbols <= {"*", "-"}:
        raise ValueError(
            f"hybrid_layer_pattern must be attention '*' and MLP '-' layers, with '/'-separated MTP "
            f"depths (e.g. '*-*-/*-'), got {hybrid_layer_pattern!r}"
        )
    settings = dict(
        num_layers=len(parsed.main_pattern.replace("|", "")),
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        mtp_num_layers=parsed.mtp_num_depths or None,
        is_hybrid_model=True,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    config = TransformerConfig(**{**settings, **config_overrides})
    torch.manual_seed(seed)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=local_hybrid_stack_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        hybrid_layer_pattern=hybrid_layer_pattern,
        position_embedding_type="rope",
        scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
    )
    return model.to(_device())
