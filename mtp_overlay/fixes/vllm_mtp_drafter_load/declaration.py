"""vllm-mtp-drafter-load: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

NEMOTRON_H_MTP = "vllm.model_executor.models.nemotron_h_mtp"

DECLARATION = Declaration(
    "vllm-mtp-drafter-load",
    summary="Report a refit that leaves vLLM's MTP drafter stale: parameters never loaded, MTP names dropped, "
    "tensors truncated, or a target refit the drafter never got.",
    symptom="a refit whose MTP weights come in the other naming (`mtp.*` vs positional), too large or not at all, "
    "or a target-only weight update (vLLM >= 0.28 refits the drafter only in its own session), is accepted "
    "silently: the drafter keeps its old head, acceptance falls later",
    distribution="vllm",
    targets={
        "drafter_nemotron_h": NEMOTRON_H_MTP,  # NemotronHMTP.load_weights
        "drafter_deepseek": "vllm.model_executor.models.deepseek_mtp",  # DeepSeekMTP.load_weights
        # vLLM's layerwise reload, where a refit begins and ends: where it is defined, and where it is bound by name
        "reload_layerwise": "vllm.model_executor.model_loader.reload.layerwise",
        "reload": "vllm.model_executor.model_loader.reload",
        "reload_inplace": "vllm.model_executor.model_loader.reload.inplace",
        # drafter freshness: target sessions (the Worker; its probe also reads whether the engine base
        # declares supports_draft_weight_update), reload_weights and the step (both model runners)
        "worker": "vllm.v1.worker.gpu_worker",
        "runner_v1": "vllm.v1.worker.gpu_model_runner",
        "runner_v2": "vllm.v1.worker.gpu.model_runner",
    },
    families={"0.25": ">=0.25.1,<0.26", "0.33": ">=0.33.0,<0.34"},
    provenance=Provenance(
        origin="NeMo-RL PR #3494 (MTP namespace vs positional layer naming; drafter frozen while the trainer's head "
        "moved); verl #6947 and vime PR #351 (target-only weight updates leave the drafter stale)",
        upstream_fix="none (vLLM #43456 reports the silent skip; vLLM PR #46725 added the draft session, and "
        "nothing says when a trainer skips it)",
        bugs=("https://github.com/NVIDIA-NeMo/RL/pull/3494", "https://github.com/vllm-project/vllm/pull/46725"),
    ),
    # on disk: the source patch routes load_weights and the layerwise reload through this helper
    marker=Marker(NEMOTRON_H_MTP, "NemotronHMTP.load_weights", "MTPDrafterRefits"),
)
