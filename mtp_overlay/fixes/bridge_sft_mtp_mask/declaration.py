"""bridge-sft-mtp-mask: what it targets, where it comes from, which releases its patch fits (data only)."""

from mtp_overlay.contract import Declaration, Provenance

DECLARATION = Declaration(
    "bridge-sft-mtp-mask",
    summary="Pass the SFT batch's label-aligned loss_mask to the model in Bridge's gpt_step, so the MTP loss is "
    "masked like the LM loss.",
    symptom="Bridge's SFT step (`gpt_step.forward_step`) never passes the batch's `loss_mask` to the model: the MTP "
    "head trains on prompts and padding (62 positions where the mask allows 32 in a 2x32 batch)",
    distribution="megatron-bridge",
    targets={
        "gpt_step": "megatron.bridge.training.gpt_step",  # defines _forward_step_common, calls it by name
        "deepseek_v4_step": "megatron.bridge.models.deepseek.deepseek_v4_step",  # binds it by name
    },
    families={"0.6": ">=0.6.0,<0.7"},
    provenance=Provenance(
        origin="Megatron-Bridge issue #6103 (DeepSeek-V4 SFT: mtp_1 loss 15.8 vs 4.42 with the mask)",
        upstream_fix="Megatron-Bridge PR #6105 (open)",
        bugs=("https://github.com/NVIDIA-NeMo/Megatron-Bridge/issues/6103",
              "https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/6105"),
    ),
    # a call made while mtp-loss-mask's input-aligned RL scope is live is refused only where that fix
    # is installed (elsewhere the scope routes nothing)
    reads=("mtp-loss-mask",),
)
