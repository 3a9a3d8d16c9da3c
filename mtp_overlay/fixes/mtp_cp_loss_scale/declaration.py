"""mtp-cp-loss-scale: what it targets, where it comes from, which releases its patch fits (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

MTP = "megatron.core.transformer.multi_token_prediction"

DECLARATION = Declaration(
    "mtp-cp-loss-scale",
    summary="Normalise the MTP loss by CP-global token counts (one 2-scalar all-reduce per MTP depth).",
    symptom="under context parallelism each CP rank's MTP loss is normalised by its own token counts: the MTP "
    "gradient at CP=2 is off by 0.32 (relative, 40% prompt mask), 0.11 with per-token loss; the logged MTP loss is "
    "a mean of per-rank means",
    distribution="megatron-core",
    targets={
        "mtp": MTP,  # defines process_mtp_loss, roll_tensor, MTPLossLoggingHelper
        "gpt_model": "megatron.core.models.gpt.gpt_model",  # binds process_mtp_loss by name
        "hybrid_model": "megatron.core.models.hybrid.hybrid_model",  # likewise
    },
    families={"0.19": ">=0.19.0,<0.20"},
    provenance=Provenance(
        origin="NeMo-RL (MTP under context parallelism); Megatron-LM issue #7452",
        upstream_fix="Megatron-LM PR #7498 (open)",
        bugs=("https://github.com/NVIDIA/Megatron-LM/pull/7498", "https://github.com/NVIDIA/Megatron-LM/issues/7452"),
    ),
    marker=Marker(MTP, "process_mtp_loss", "all_reduce"),
    # both wrap roll_tensor: this fix's wrapper must sit outside mtp-packed-roll's, whose unpacked-CP
    # roll never calls the function it wraps
    after=("mtp-packed-roll",),
    # its CP all-reduce must run on every rank of the group, as must theirs (fixes/peers.py)
    reads=("mtp-loss-mask", "mtp-packed-roll"),
    collective=True,
)
