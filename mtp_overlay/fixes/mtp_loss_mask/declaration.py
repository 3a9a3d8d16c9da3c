"""mtp-loss-mask: what it targets, where it comes from, which fix's state it reads (data only)."""

from mtp_overlay.contract import Declaration, Provenance

DECLARATION = Declaration(
    "mtp-loss-mask",
    summary="Route the RL MTP loss mask to GPTModel/HybridModel and check it has the tokens' layout.",
    symptom="a forward without `labels` (RL) trains the MTP head on every token: prompts, padding, filtered samples",
    distribution="megatron-core",
    targets={  # each module's model class: its forward
        "gpt_model": "megatron.core.models.gpt.gpt_model",
        "hybrid_model": "megatron.core.models.hybrid.hybrid_model",
    },
    provenance=Provenance(
        origin="NeMo-RL PR #3494 (MTP loss mask layout); NeMo-RL issue #2869",
        upstream_fix="none: the trainer must pass the mask in the tokens' exact layout (NeMo-RL PR #3494)",
    ),
    # unpadded packed boundaries are fine only where mtp-packed-roll makes the roll use the padded ones
    # and every rank of a CP group must run the same collective fixes (fixes/peers.py)
    reads=("mtp-packed-roll", "mtp-cp-loss-scale"),
    collective=True,
)
