"""mtp-sp-scatter: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

MTP = "megatron.core.transformer.multi_token_prediction"

DECLARATION = Declaration(
    "mtp-sp-scatter",
    summary="Scatter the MTP embedding to the sequence-parallel region under SP/CP.",
    symptom="a model built with `scatter_embedding_sequence_parallel=False` (Nemotron VL/Omni, multimodal "
    "wrappers) never scatters the MTP embedding: under TP+SP the MTP concat crashes",
    distribution="megatron-core",
    targets={"mtp": MTP},  # MultiTokenPredictionLayer._get_embeddings
    families={
        "0.14-0.15": ">=0.14.0,<0.16",
        "0.16": ">=0.16.0,<0.17",
        "0.17": ">=0.17.0,<0.18",
        "0.18": ">=0.18.0,<0.19",
        "0.19": ">=0.19.0,<0.20",
    },
    provenance=Provenance(
        origin="NeMo-RL (Nemotron Omni MTP under TP+SP)",
        upstream_fix="Megatron-LM PR #6256 (commit 67700f79)",
        first_fixed_release="0.20.0",
        bugs=("https://github.com/NVIDIA/Megatron-LM/pull/6256",),
        backport_of="https://github.com/NVIDIA/Megatron-LM/commit/67700f79",
    ),
    marker=Marker(MTP, "MultiTokenPredictionLayer._get_embeddings", "scatter_to_sequence_parallel_region"),
)
