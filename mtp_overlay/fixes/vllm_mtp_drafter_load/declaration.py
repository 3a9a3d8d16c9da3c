"""vllm-mtp-drafter-load: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

NEMOTRON_H_MTP = "vllm.model_executor.models.nemotron_h_mtp"

DECLARATION = Declaration(
    "vllm-mtp-drafter-load",
    summary="Report a refit that leaves vLLM's MTP drafter with parameters never loaded or MTP names dropped.",
    symptom="a refit whose MTP weights come in the other naming (`mtp.*` vs positional) or not at all is accepted "
    "silently: the drafter keeps its old head, acceptance falls later",
    distribution="vllm",
    targets={
        "drafter_nemotron_h": NEMOTRON_H_MTP,  # NemotronHMTP.load_weights
        "drafter_deepseek": "vllm.model_executor.models.deepseek_mtp",  # DeepSeekMTP.load_weights
        # vLLM's layerwise reload, where a refit begins and ends: where it is defined, and where it is bound by name
        "reload_layerwise": "vllm.model_executor.model_loader.reload.layerwise",
        "reload": "vllm.model_executor.model_loader.reload",
        "reload_inplace": "vllm.model_executor.model_loader.reload.inplace",
    },
    families={"0.25": ">=0.25.1,<0.26", "0.33": ">=0.33.0,<0.34"},
    provenance=Provenance(
        origin="NeMo-RL PR #3494 (MTP namespace vs positional layer naming; drafter frozen while the trainer's head moved)",
        upstream_fix="none (vLLM #43456 reports the silent skip)",
        bugs=("https://github.com/NVIDIA-NeMo/RL/pull/3494",),
    ),
    # on disk: the source patch routes load_weights and the layerwise reload through this helper
    marker=Marker(NEMOTRON_H_MTP, "NemotronHMTP.load_weights", "MTPDrafterRefits"),
)
