"""mtp-multimodal: what it targets, where it comes from, which fix's hook it needs (data only)."""

from mtp_overlay.contract import Declaration, Provenance

DECLARATION = Declaration(
    "mtp-multimodal",
    summary="Give the MTP block of a multimodal model (LLaVAModel, MimoModel) the combined-length token ids and "
    "loss mask.",
    symptom="MTP on a LLaVAModel (Nemotron VL/Omni) or MimoModel crashes in the first forward: its language model "
    "gets `input_ids=None` and no loss mask, so the MTP block has no ids to embed (and would train on image slots)",
    distribution="megatron-core",
    targets={
        "llava": "megatron.core.models.multimodal.llava_model",  # LLaVAModel
        "mimo": "megatron.core.models.mimo.model.base",  # MimoModel
    },
    # LLaVAModel's patch: one llava_model.py from 0.18.0 to 0.19.2, but before 0.19 MTP cannot roll
    # LLaVA's position_ids=None (MimoModel: runtime hook only)
    families={"0.19": ">=0.19.0,<0.20"},
    provenance=Provenance(
        origin="NeMo-RL (Nemotron Omni GRPO with MTP, PR #3494); Megatron-Bridge 0.6.2 builds Omni/VL as LLaVAModel",
        upstream_fix="Megatron-LM PR #6010 (the loss mask) and #6260 (combined input_ids), on main only; main "
        "does not slice the ids for CP/SP",
        bugs=("https://github.com/NVIDIA/Megatron-LM/pull/6010", "https://github.com/NVIDIA/Megatron-LM/pull/6260"),
    ),
    # the combined inputs reach the language model through mtp-loss-mask's GPTModel/HybridModel.forward
    # hook (one wrapper, two reasons): without it installed this fix cannot work
    requires=("mtp-loss-mask",),
)
