"""hf-media-placeholders: what it targets and where it comes from (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

PROCESSING = "transformers.processing_utils"

DECLARATION = Declaration(
    "hf-media-placeholders",
    summary="Literal media placeholders in a multimodal message's text are removed before the processor's chat "
    "template renders it.",
    symptom="a message with structured images whose text also writes `<image>` renders the literal copies as "
    "placeholders (Nemotron Omni's template: 2 for 1 image): more placeholders than projected features, the "
    "multimodal step aborts",
    distribution="transformers",
    targets={"processing": PROCESSING},  # ProcessorMixin.apply_chat_template
    provenance=Provenance(
        origin="NeMo-RL PR #3494 (Nemotron Super Omni rollouts: 392 rows with one image and two literal `<image>`)",
        upstream_fix="none (NeMo-RL PR #3494's sanitize_image_placeholders works around it)",
        bugs=("https://github.com/NVIDIA-NeMo/RL/pull/3494",),
    ),
    # upstream taking care of literal placeholders in text must read the processor's own placeholder
    marker=Marker(PROCESSING, "ProcessorMixin.apply_chat_template", "image_token"),
)
