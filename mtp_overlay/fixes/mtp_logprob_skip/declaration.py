"""mtp-logprob-skip: what it targets, where it comes from, which fix's wrapper it sits outside (data only)."""

from mtp_overlay.contract import Declaration, Provenance

DECLARATION = Declaration(
    "mtp-logprob-skip",
    summary="Skip the MTP block in forwards that cannot train it (grad disabled, or the trainer's mtp_block_scope).",
    symptom="an RL step's logprob forwards (reference and old policy, under `torch.no_grad()`) run the whole MTP "
    "block and its vocabulary GEMMs for nothing and, in train mode, record their MTP loss and acceptance in the "
    "tracker the training step logs",
    distribution="megatron-core",
    targets={
        "mtp": "megatron.core.transformer.multi_token_prediction",  # MultiTokenPredictionBlock.forward
        "gpt_model": "megatron.core.models.gpt.gpt_model",  # GPTModel.forward, process_mtp_loss as bound there
        "hybrid_model": "megatron.core.models.hybrid.hybrid_model",  # likewise for HybridModel
    },
    provenance=Provenance(
        origin="RL post-training (NeMo-RL, AReaL PR #1653): logprob-only forwards of MTP models",
        upstream_fix="Megatron-LM PR #6119 (main, not in 0.19.x): HybridModel.forward(compute_mtp_loss=...), "
        "passed by the caller; GPTModel has none",
        bugs=("https://github.com/NVIDIA/Megatron-LM/pull/6119", "https://github.com/inclusionAI/AReaL/pull/1653"),
    ),
    # both wrap process_mtp_loss in the model modules: a skipped forward must not reach theirs
    after=("mtp-cp-loss-scale",),
)
