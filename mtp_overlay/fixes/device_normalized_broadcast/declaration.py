"""device-normalized-broadcast: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

PACKED_TENSOR = "vllm.distributed.weight_transfer.packed_tensor"

DECLARATION = Declaration(
    "device-normalized-broadcast",
    summary="Move every tensor of a vLLM weight-refit stream to the communicator's device before packing.",
    symptom="one host tensor in a weight-refit stream breaks `torch.cat` / the communicator",
    distribution="vllm",
    targets={
        "packed_tensor": PACKED_TENSOR,  # the packed producer
        "nccl_engine": "vllm.distributed.weight_transfer.nccl_engine",  # the one-by-one path, the producer by name
    },
    families={"0.25": ">=0.25.1,<0.26", "0.33": ">=0.33.0,<0.34"},
    provenance=Provenance(
        origin="NeMo-RL (weight refit with a non-learnable host constant, e.g. an audio filterbank)",
    ),
    # on disk: the source patch makes the producer and the one-by-one path call this helper
    marker=Marker(PACKED_TENSOR, "packed_nccl_broadcast_producer", "_on_communicator_device"),
)
