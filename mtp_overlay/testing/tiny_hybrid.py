"""A tiny stock-megatron-core HybridModel with MTP, built from local (non-TE) modules.

megatron-core 0.19.2 deprecates GPTModel for HybridModel (Nemotron-H/Super are HybridModels), but
its only shipped hybrid spec (``models/hybrid/hybrid_layer_specs.py``) is made of Transformer Engine
modules, which do not install on a CPU machine. The spec here is assembled from the pieces of
``get_gpt_layer_local_spec()``: attention ('*') is a TransformerLayer holding the input norm and
self-attention, MLP ('-') is ``ssm.mlp_layer.MLPLayer`` holding the pre-MLP norm and MLP, MoE ('E')
is ``MoETransformerLayer`` holding the pre-MLP norm and megatron-core's own ``MoELayer`` (router,
token dispatcher, ``SequentialMLP`` experts: ``get_moe_module_spec(use_te=False)``, the helper the
hybrid TE spec uses), and the MTP block is ``get_mtp_layer_spec_for_backend(None, LocalSpecProvider())``
whose inner layers HybridModel builds from the MTP pattern. The final norm ``HybridStack``
hard-codes as ``TENorm`` is swapped for ``WrappedTorchNorm`` by a CPU shim (``cpu_shims``).

With the default pattern ``"*-*-/*-"`` the model holds the same parameters, in the same order and
(from one seed) with the same values as ``tiny_gpt.build_tiny_gpt()`` (2 layers, 1 MTP layer):
``is_hybrid_model=True`` scales the output-layer init by ``num_layers`` (4 pattern layers) where
GPT scales by ``2 * num_layers`` (2 transformer layers).

The zoo model (`build_zoo`, pattern `ZOO_PATTERN`) is the layer mix of Nemotron 3 Super as far as
this test bed can build it: attention, MoE and MLP layers in the backbone, and the Super recipe's
MTP (Megatron-Bridge ``recipes/nemotronh/h100/nemotron_3_super.py``: MTP pattern ``"*E"``,
``mtp_num_layers=2``, ``mtp_use_repeated_layer=True``: one shared attention + MoE layer applied
at both depths), with the tiny MoE settings of `MOE_SETTINGS` (the recipe's alltoall dispatcher).
Mamba ('M') layers need the ``mamba_ssm`` kernels and are refused here.
"""

import functools

from .tiny_gpt import _device

# symbol -> layer kind this local spec builds (megatron-core's Symbols: M * - E G D +)
SYMBOLS = {"*": "attention", "-": "MLP", "E": "MoE"}
UNSUPPORTED = {"M": "Mamba needs the mamba_ssm kernels", "G": "gated delta net", "D": "DeepSeek sparse attention",
               "+": "multi-latent attention"}
# the backbone's layer mix, then the Super recipe's MTP block "*E" at 2 depths (repeated layer)
ZOO_PATTERN = "*E*-/*E/*E"
DISPATCHERS = ("allgather", "alltoall")
# a tiny MoE that trains on CPU (4 experts, top-2, load-balancing aux loss; no bias: megatron-core
# allows bias in MoE only with expert tensor parallel size 1)
MOE_SETTINGS = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_aux_loss_coeff=0.01,
    moe_router_load_balancing_type="aux_loss",
    moe_token_dispatcher_type="alltoall",
    add_bias_linear=False,
)


def local_hybrid_stack_spec(config=None):
    """``ModuleSpec(HybridStack, HybridStackSubmodules)`` of attention, MLP, MoE and MTP from local modules.

    ``config``: a config whose ``normalization`` picks the norm (a Megatron-Bridge HybridModelProvider
    calls its ``hybrid_stack_spec`` with itself); None keeps megatron-core's local default. The MoE
    layer's size (experts, top-k, dispatcher) is read from the model's config when it is built.
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
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    gpt = get_gpt_layer_local_submodules(normalization=getattr(config, "normalization", None))
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda
    )
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda)
    moe = TransformerLayerSubmodules(pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=_local_moe(), mlp_bda=gpt.mlp_bda)
    mtp_layer = get_mtp_layer_spec_for_backend(mtp_model_layer_spec=None, backend=LocalSpecProvider())
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
            moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=moe),
            mtp_block_spec=ModuleSpec(
                module=MultiTokenPredictionBlock,
                submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]),
            ),
        ),
    )


def _local_moe():
    """megatron-core's local MoE builder (``MoELayer`` with ``SequentialMLP`` experts), its experts
    built by `experts_of_every_rank`."""
    import dataclasses

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    # the expert count is the config's, read by MoELayer; the spec only needs to be an MoE one
    spec = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)
    if not (isinstance(spec, functools.partial) and spec.func is MoELayer and "submodules" in spec.keywords):
        raise TypeError(f"get_moe_module_spec(use_te=False) is not partial(MoELayer, submodules=...) here: {spec!r}")
    submodules = spec.keywords["submodules"]
    experts = functools.partial(experts_of_every_rank, submodules.experts)
    return functools.partial(MoELayer, submodules=dataclasses.replace(submodules, experts=experts))


def experts_of_every_rank(build_experts, num_local_experts, config, *, pg_collection, name=None):
    """The experts module ``build_experts`` (megatron-core's ``SequentialMLP``) makes, holding the
    same weights at every expert-parallel size.

    With ``use_cpu_initialization`` each expert draws its full weights from the CPU generator in
    turn, so a rank that builds only its own experts gets the first experts' draws (and every later
    layer shifted draws): EP2 would not hold TP1's weights. Here every rank builds all
    ``num_local_experts * ep_size`` experts from the seed, as an EP1 rank does, and keeps its own
    ``ep_rank``-th slice: megatron-core's module, forward and backward, only the other ranks'
    experts dropped.
    """
    import torch

    size, rank = pg_collection.ep.size(), pg_collection.ep.rank()
    experts = build_experts(num_local_experts * size, config, pg_collection=pg_collection, name=name)
    if size > 1:
        keep = list(experts.local_experts)[rank * num_local_experts : (rank + 1) * num_local_experts]
        experts.local_experts = torch.nn.ModuleList(keep)
        experts.num_local_experts = num_local_experts
    return experts


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

    TP, CP and (with MoE layers) expert parallel sizes come from ``parallel_state``; ``num_layers``
    and ``mtp_num_layers`` from ``hybrid_layer_pattern`` (symbols of `SYMBOLS`: '*' attention, '-'
    MLP, 'E' MoE). A pattern with 'E' gets `MOE_SETTINGS` (``moe_token_dispatcher_type`` one of
    `DISPATCHERS`). ``config_overrides`` go to TransformerConfig (after those settings);
    ``scatter_embedding_sequence_parallel`` goes to HybridModel.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parsed = parse_hybrid_pattern(hybrid_layer_pattern)
    symbols = set((parsed.main_pattern or "") + (parsed.mtp_pattern or "")) - {"|"}
    refused = sorted(symbols - set(SYMBOLS))
    if not parsed.main_pattern or refused:
        why = "; ".join(f"{symbol!r}: {UNSUPPORTED.get(symbol, 'unknown')}" for symbol in refused)
        raise ValueError(
            f"hybrid_layer_pattern must hold only {', '.join(f'{s!r} {k}' for s, k in SYMBOLS.items())} "
            f"layers, with '/'-separated MTP depths (e.g. {ZOO_PATTERN!r}), got {hybrid_layer_pattern!r}"
            + (f" (not built here: {why})" if why else "")
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
    if "E" in symbols:
        settings.update(
            MOE_SETTINGS,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )
    settings.update(config_overrides)
    if "E" in symbols and settings["moe_token_dispatcher_type"] not in DISPATCHERS:
        raise ValueError(
            f"moe_token_dispatcher_type must be one of {DISPATCHERS} (flex needs DeepEP/HybridEP kernels), "
            f"got {settings['moe_token_dispatcher_type']!r}"
        )
    config = TransformerConfig(**settings)
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


def build_zoo(**overrides):
    """`build_tiny_hybrid` of `ZOO_PATTERN` with the Super recipe's repeated MTP layer
    (``mtp_use_repeated_layer=True``); ``overrides`` as for `build_tiny_hybrid` (e.g.
    ``moe_aux_loss_coeff=0.0``, ``moe_token_dispatcher_type="allgather"``, ``sequence_parallel=True``)."""
    return build_tiny_hybrid(**{"hybrid_layer_pattern": ZOO_PATTERN, "mtp_use_repeated_layer": True, **overrides})
