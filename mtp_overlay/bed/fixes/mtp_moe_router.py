"""mtp-moe-router on stock megatron-core: the hybrid MTP block's MoE router is built as a backbone router.

Megatron-core's own ``MultiTokenPredictionBlock`` builds the Nemotron 3 Super MTP block (pattern
``"*E"``, 2 depths, one repeated layer; the ``*`` an identity, the ``E`` megatron-core's
``MoETransformerLayer`` with ``MoELayer``, ``TopKRouter``, allgather dispatcher, ``SequentialMLP``
experts, aux loss on) through each release's hybrid stack (``HybridStack`` 0.18+, ``MambaStack``
0.17); its MoE layer runs once per depth, as the repeated layer does, and ``MoEAuxLossAutoScaler``
alone puts gradient on the router (the output times 0). The same block with ``is_mtp_layer`` set by
hand (`bed.steps.moe`'s reference semantics) is the reference. The bug shows when the stock router's
aux-loss gradient is not the reference's, or its loss is logged outside the MTP depth's slot
(``num_layers + 1``; stock logs at ``layer_number``, PR #6748's flag alone at ``layer_number +
num_layers``, the layer's place in the MTP pattern).
"""

from ..runtime.launcher import run_ranks_checked

NUM_LAYERS, DEPTHS, PATTERN = 2, 2, "*E"


def reproduce():
    facts = run_ranks_checked(stock_mtp_router, 1, fixes=[])[0]
    depth_slot = NUM_LAYERS + 1
    shows = facts["ratio"] != 1.0 or facts["slots"] != [depth_slot]
    return shows, (
        f"MTP block {PATTERN!r} at {DEPTHS} depths (repeated layer), its MoE layer once per depth: the router is "
        f"built with is_mtp_layer={facts['flag']}; its aux-loss gradient is {facts['ratio']:.3f}x the flagged "
        f"reference's; logged in slot {facts['slots']} of {NUM_LAYERS + DEPTHS} (the MTP depth's: {depth_slot})"
    )


def stock_mtp_router():
    """Rank worker: {flag, ratio (stock / flagged MTP router aux-loss gradient), slots (1-based, where
    stock logged the MTP router's load-balancing loss)}."""
    import torch

    stock = _measure(flag=False)
    flagged = _measure(flag=True)
    scale = float(torch.dot(stock["grad"], flagged["grad"]) / torch.dot(flagged["grad"], flagged["grad"]))
    exact = torch.allclose(stock["grad"], scale * flagged["grad"], rtol=1e-6, atol=0)
    return dict(flag=stock["flag"], ratio=round(scale, 6) if exact else float("nan"), slots=stock["slots"])


def _measure(flag):
    import torch

    block = _block()
    layer = block.layers[0].mtp_model_layer.layers[PATTERN.index("E")]
    moe = layer.mlp
    if flag:
        for module in (layer, moe, moe.router):
            module.is_mtp_layer = True
    _clear_tracker()
    generator = torch.Generator().manual_seed(7)
    for _ in range(DEPTHS):
        hidden = torch.randn(8, 2, block.config.hidden_size, generator=generator)
        output = moe(hidden)
        output = output[0] if isinstance(output, tuple) else output
        (output.sum() * 0).backward()
    return dict(flag=moe.router.is_mtp_layer, grad=moe.router.weight.grad.detach().flatten().clone(),
                slots=_logged_slots())


def _block():
    """The release's MTP block of PATTERN (the release's own classes, local specs), from one seed."""
    import inspect

    import torch
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayerSubmodules

    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules as StackSubmodules
    except ImportError:  # 0.17: the hybrid stack is ssm.mamba_block's MambaStack
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as StackSubmodules

    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=32, num_attention_heads=4, mtp_num_layers=DEPTHS,
        mtp_use_repeated_layer=True, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather", add_bias_linear=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    moe = TransformerLayerSubmodules(mlp=get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False))
    stack = StackSubmodules(moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=moe))
    spec = MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec_for_backend(mtp_model_layer_spec=None, backend=LocalSpecProvider())])
    parameters = inspect.signature(MultiTokenPredictionBlock.__init__).parameters
    keyword = "hybrid_submodules" if "hybrid_submodules" in parameters else "mamba_submodules"
    torch.manual_seed(1234)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    return MultiTokenPredictionBlock(config=config, spec=spec, pg_collection=groups, mtp_layer_pattern=PATTERN,
                                     mtp_num_depths=DEPTHS, **{keyword: stack})


def _clear_tracker():
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # 0.17: moe_utils' layer-wise tracker
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
        return
    destroy_moe_metrics_tracker()


def _logged_slots():
    """The 1-based slots holding a logged load-balancing loss."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        values = get_moe_metrics_tracker().metrics["load_balancing_loss"].values
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        values = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    return [index + 1 for index, value in enumerate(values.tolist()) if value != 0]
