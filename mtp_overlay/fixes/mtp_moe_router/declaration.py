"""mtp-moe-router: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

ROUTER = "megatron.core.transformer.moe.router"

DECLARATION = Declaration(
    "mtp-moe-router",
    summary="Build the MTP block's MoE layers as MTP layers (is_mtp_layer) and log their router's aux losses in "
    "the MTP depth's slot.",
    symptom="the hybrid MTP block's MoE router is built as a backbone router: the repeated MTP layer's "
    "load-balancing loss trains 2x (once per depth), is logged in a backbone layer's slot, and its `layer_number` "
    "equals a backbone router's; upstream's flag alone (PR #6748) crashes logging on `*E*E/*E`",
    distribution="megatron-core",
    targets={  # role -> the module whose import installs the fix
        "mtp": "megatron.core.transformer.multi_token_prediction",  # MultiTokenPredictionLayer.__init__
        "router": ROUTER,  # TopKRouter.attach_and_log_load_balancing_loss, apply_z_loss
        "hybrid_stack": "megatron.core.models.hybrid.hybrid_block",  # HybridStack.__init__ (0.18+): read only
        "mamba_stack": "megatron.core.ssm.mamba_block",  # MambaStack.__init__ (0.17; a re-export since): read only
    },
    families={"0.17": ">=0.17.0,<0.18", "0.18": ">=0.18.0,<0.19", "0.19": ">=0.19.0,<0.20"},
    provenance=Provenance(
        origin="Nemotron 3 Super MTP recipes (MTP pattern \"*E\", 2 depths, repeated layer); NeMo-RL PR #3903 "
        "(router replay of MTP layers)",
        upstream_fix="Megatron-LM PR #6748 (the flag, main only) and issue #7172 (the logging slot, open)",
        bugs=(
            "https://github.com/NVIDIA/Megatron-LM/pull/6748",
            "https://github.com/NVIDIA/Megatron-LM/issues/7172",
            "https://github.com/NVIDIA-NeMo/RL/pull/3903",
        ),
    ),
    # the second half (#7172): the router logs an MTP layer by the depth its MTP layer gives it
    marker=Marker(ROUTER, "TopKRouter.attach_and_log_load_balancing_loss", "mtp_depth"),
)
