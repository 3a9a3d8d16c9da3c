"""A tiny stock-megatron-core HybridModel with MTP, built from local (non-TE) modules.

megatron-core 0.19 deprecates GPTModel for HybridModel (Nemotron-H/Super are HybridModels), but
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

Mamba ('M') is megatron-core's own ``MambaLayer`` (the local norm, then ``MambaMixer`` with
ColumnParallelLinear in_proj and RowParallelLinear out_proj). Its kernels (``mamba_ssm``'s fused
conv + SSD scan, gated RMSNorm) do not exist on a CPU machine: the test bed's shims stand them in
(``mamba_kernels.mamba_shims``). The tiny mixer has 8 heads of 16 in 2 groups, d_state 8, and scans in
chunks of 8 (``MAMBA_CHUNK_SIZE``, through the mixer spec's ``chunk_size`` as Megatron-Bridge sets
it), so a packed row's sequences start inside chunks; its weights do not depend on the TP size
(`tp_independent_mamba_weights`).

Under pipeline parallelism the pattern's ``|`` marks the stages (``"*-|*-/*-"``: one attention and
one MLP layer per stage, MTP on the last); each rank builds its stage holding the weights of the
model without ``|`` at PP1 (`pipeline.build_stage`).

The zoo model (`build_zoo`, pattern `ZOO_PATTERN`) is the layer mix of Nemotron 3 Super as far as
this test bed can build it: Mamba, attention, MoE and MLP layers in the backbone, and the Super
recipe's MTP (Megatron-Bridge ``recipes/nemotronh/h100/nemotron_3_super.py``: MTP pattern ``"*E"``,
``mtp_num_layers=2``, ``mtp_use_repeated_layer=True``: one shared attention + MoE layer applied
at both depths), with the tiny MoE settings of `MOE_SETTINGS` (the recipe's alltoall dispatcher).
"""

import functools
import zlib

from ..runtime.device import rank_device
from . import pipeline
from ..oracles.tp_layout import tp_shard

# the tiny Mamba mixer: d_inner = 2 * hidden (64) = 128 = 8 heads of 16, in 2 groups (TP2 x CP2 still
# gives each rank a head group's share), d_state 8; chunks of 8 steps
MAMBA_SETTINGS = dict(mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8)
MAMBA_CHUNK_SIZE = 8

# symbol -> layer kind this local spec builds (megatron-core's Symbols: M * - E G D +)
SYMBOLS = {"*": "attention", "-": "MLP", "E": "MoE", "M": "Mamba"}
UNSUPPORTED = {"G": "gated delta net", "D": "DeepSeek sparse attention", "+": "multi-latent attention"}
# the backbone's layer mix (Mamba, attention, MoE, MLP), then the Super recipe's MTP block "*E" at 2
# depths (repeated layer)
ZOO_PATTERN = "M*E-/*E/*E"
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
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
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
            mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
                norm=gpt.input_layernorm, mamba_bda=gpt.self_attn_bda, mixer=ModuleSpec(
                    module=MambaMixer, submodules=MambaMixerSubmodules(
                        in_proj=LocalSpecProvider().column_parallel_linear(),
                        out_proj=LocalSpecProvider().row_parallel_linear())))),
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
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    # the expert count is the config's, read by MoELayer; the spec only needs to be an MoE one
    return with_experts_of_every_rank(get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False))


def with_experts_of_every_rank(spec):
    """``spec`` (megatron-core's local MoE builder, ``partial(MoELayer, submodules=...)``) with its experts
    built by `experts_of_every_rank`: the hybrid stack's MoE layers and Bridge's GPT providers' alike."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not (isinstance(spec, functools.partial) and spec.func is MoELayer and "submodules" in spec.keywords):
        raise TypeError(f"the local MoE spec is not partial(MoELayer, submodules=...) here: {spec!r}")
    submodules = spec.keywords["submodules"]
    experts = functools.partial(experts_of_every_rank, submodules.experts)
    return functools.partial(MoELayer, *spec.args,
                             **dict(spec.keywords, submodules=dataclasses.replace(submodules, experts=experts)))


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

    TP, CP, PP and (with MoE layers) expert parallel sizes come from ``parallel_state``; ``num_layers``
    and ``mtp_num_layers`` from ``hybrid_layer_pattern`` (symbols of `SYMBOLS`: '*' attention, '-' MLP,
    'E' MoE, 'M' Mamba; under PP, ``|`` between the stages, or none: megatron-core then splits the
    layers evenly). A pattern with 'E' gets `MOE_SETTINGS` (``moe_token_dispatcher_type`` one of
    `DISPATCHERS`), one with 'M' `MAMBA_SETTINGS`. ``config_overrides`` go to TransformerConfig (after
    those settings); ``scatter_embedding_sequence_parallel`` goes to HybridModel. Under PP this rank's
    stage, holding the weights the pattern without ``|`` builds at PP1.
    """
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

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
    stages, pp = parsed.main_pattern.count("|") + 1, pipeline.size()
    if stages not in (1, pp):
        raise ValueError(
            f"hybrid_layer_pattern {hybrid_layer_pattern!r} has {stages} '|'-separated stages, but the pipeline "
            f"has {pp} (give one segment per stage, or none)"
        )
    arguments = dict(
        seed=seed, hidden_size=hidden_size, num_attention_heads=num_attention_heads, vocab_size=vocab_size,
        max_sequence_length=max_sequence_length, sequence_parallel=sequence_parallel,
        scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel, **config_overrides,
    )
    if pp == 1:
        return _hybrid(hybrid_layer_pattern, parsed, **arguments)
    whole = hybrid_layer_pattern.replace("|", "")
    return pipeline.build_stage(
        _hybrid, dict(arguments, pattern=whole, parsed=parse_hybrid_pattern(whole)),
        dict(arguments, pattern=hybrid_layer_pattern, parsed=parsed),
    )


def _hybrid(pattern, parsed, *, seed, hidden_size, num_attention_heads, vocab_size, max_sequence_length,
            sequence_parallel, scatter_embedding_sequence_parallel, **config_overrides):
    """The HybridModel of this rank's pipeline stage (all of it without PP), built from ``seed``."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.transformer_config import TransformerConfig

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
    symbols = set((parsed.main_pattern or "") + (parsed.mtp_pattern or "")) - {"|"}
    if "M" in symbols:
        settings.update(MAMBA_SETTINGS)
    if "E" in symbols:
        settings.update(
            MOE_SETTINGS,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )
    if pipeline.size() > 1:
        settings.update(pipeline_model_parallel_size=pipeline.size(), pipeline_dtype=torch.float32)
    settings.update(config_overrides)
    if "E" in symbols and settings["moe_token_dispatcher_type"] not in DISPATCHERS:
        raise ValueError(
            f"moe_token_dispatcher_type must be one of {DISPATCHERS} (flex needs DeepEP/HybridEP kernels), "
            f"got {settings['moe_token_dispatcher_type']!r}"
        )
    config = TransformerConfig(**settings)
    spec = local_hybrid_stack_spec()
    spec.submodules.mamba_layer.submodules.mixer.params["chunk_size"] = MAMBA_CHUNK_SIZE
    torch.manual_seed(seed)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
        **pipeline.stage(),
    )
    tp_independent_mamba_weights(model, seed)
    return model.to(rank_device())


def tp_independent_mamba_weights(model, seed):
    """Give every ``MambaMixer`` in ``model`` weights that do not depend on the TP size (in place).

    megatron-core 0.19 draws conv1d, ``dt_bias`` and ``A_log`` on each TP rank from that rank's
    model-parallel RNG (``ssm/mamba_mixer.py:318,370``, ``get_cuda_rng_tracker().fork()``), and with
    ``use_cpu_initialization`` cuts in_proj's full weight into contiguous row blocks
    (``tensor_parallel/layers.py:184``) while its TP layout is per component: z, x, B, C and dt each
    sharded (the weight's ``partition_sizes``, ``ssm/mamba_mixer.py:305``). From one seed a TP2 model
    is another model than TP1's. Here each of those weights is drawn full-size from a generator
    seeded by ``seed`` and the parameter's name, with upstream's distribution (in_proj normal(0,
    init_method_std); conv1d weight and bias uniform(+-1/sqrt(d_conv)), what its kaiming-uniform init
    gives; dt log-uniform in [0.001, 0.1], floored at 1e-4, stored as its inverse softplus; A uniform
    in [1, 16], stored as its log), and this rank's shard taken component by component
    (`tp_layout.tp_shard`). D, the norm (ones) and out_proj (split along its input, which is its TP
    layout) stay as built. CP ranks hold their TP rank's full tensors, as upstream's do.
    """
    import math

    import torch
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for name, mixer in model.named_modules():
        if not isinstance(mixer, MambaMixer):
            continue
        tp_size, tp_rank = mixer.pg_collection.tp.size(), mixer.pg_collection.tp.rank()
        state = 2 * mixer.ngroups * mixer.d_state  # B and C
        bound = 1 / math.sqrt(mixer.d_conv)
        dt = _drawn(seed, f"{name}.dt", (mixer.nheads,), "uniform_", math.log(1e-3), math.log(1e-1))
        dt = dt.exp().clamp(min=1e-4)
        full = [
            (mixer.in_proj.weight, _drawn(seed, f"{name}.in_proj.weight", (2 * mixer.d_inner + state + mixer.nheads,
                                          mixer.d_model), "normal_", 0.0, mixer.config.init_method_std)),
            (mixer.conv1d_weight, _drawn(seed, f"{name}.conv1d_weight", (mixer.d_inner + state, 1, mixer.d_conv),
                                         "uniform_", -bound, bound)),
            (mixer.conv1d_bias, _drawn(seed, f"{name}.conv1d_bias", (mixer.d_inner + state,), "uniform_",
                                       -bound, bound)),
            (mixer.dt_bias, dt + torch.log(-torch.expm1(-dt))),
            (mixer.A_log, _drawn(seed, f"{name}.A", (mixer.nheads,), "uniform_", 1.0, 16.0).log()),
        ]
        with torch.no_grad():
            for parameter, value in full:
                parameter.copy_(tp_shard(value, parameter, tp_size, tp_rank))


def _drawn(seed, key, shape, fill, *arguments):
    """A float64 tensor of ``shape`` filled in place by ``fill`` ("normal_" or "uniform_") with
    ``arguments``, from a generator seeded by ``seed`` and ``key``: the same on every rank and TP size."""
    import torch

    generator = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
    return getattr(torch.empty(shape, dtype=torch.float64), fill)(*arguments, generator=generator)


def build_zoo(**overrides):
    """`build_tiny_hybrid` of `ZOO_PATTERN` with the Super recipe's repeated MTP layer
    (``mtp_use_repeated_layer=True``); ``overrides`` as for `build_tiny_hybrid` (e.g.
    ``moe_aux_loss_coeff=0.0``, ``moe_token_dispatcher_type="allgather"``, ``sequence_parallel=True``)."""
    return build_tiny_hybrid(**{"hybrid_layer_pattern": ZOO_PATTERN, "mtp_use_repeated_layer": True, **overrides})
