"""bridge-mtp-off: what it targets, where it comes from, which releases its patch fits (data only)."""

from mtp_overlay.contract import Declaration, Provenance

DECLARATION = Declaration(
    "bridge-mtp-off",
    summary="Build no MTP section when a HybridModelProvider's mtp_num_layers is a numeric zero (0, 0.0, False; "
    "None keeps the one shared layer).",
    symptom="`mtp_num_layers: 0` on a repeated-layer NemotronH (Bridge's import of an MTP checkpoint) still builds "
    "the MTP block: the first training step raises `AssertionError` in `HybridModel.forward`",
    distribution="megatron-bridge",
    targets={
        "hybrid_provider": "megatron.bridge.models.hybrid.hybrid_provider",  # HybridModelProvider.finalize
    },
    families={"0.6": ">=0.6.0,<0.7"},
    provenance=Provenance(
        origin="NeMo-RL PR #4003 (turning MTP off for a NemotronH checkpoint with an MTP layer)",
        upstream_fix="none in Megatron-Bridge (NeMo-RL PR #4003, open, clears the MTP settings on its side)",
        bugs=("https://github.com/NVIDIA-NeMo/RL/pull/4003",),
    ),
)
