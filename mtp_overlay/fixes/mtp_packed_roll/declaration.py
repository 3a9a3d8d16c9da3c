"""mtp-packed-roll: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

MTP = "megatron.core.transformer.multi_token_prediction"

DECLARATION = Declaration(
    "mtp-packed-roll",
    summary="Roll packed MTP labels/loss mask on cu_seqlens_q_padded, masking each sequence's end, over the CP group.",
    symptom="packed (THD) MTP labels and loss mask are rolled on `cu_seqlens_q` while the tensors sit on "
    "`cu_seqlens_q_padded`: with real lengths in `cu_seqlens_q` (NeMo-RL's self-slicing path) the MTP head trains "
    "shifted targets, under CP wrong chunks or an IndexError; each sequence's last real token is never masked; "
    "exchanges run on the world group",
    distribution="megatron-core",
    targets={"mtp": MTP},  # roll_tensor, _roll_tensor_packed_seq
    families={"0.16": ">=0.16.0,<0.17", "0.17-0.19": ">=0.17.0,<0.20"},
    provenance=Provenance(
        origin="NeMo-RL model_slices_context_parallel_inputs path (PR #3494): unpadded cu_seqlens_q under CP",
        upstream_fix="Megatron-LM PR #4494 (dev), #6205/#4495 and #7278 (main, open), #6746 (CP group)",
        bugs=(
            "https://github.com/NVIDIA/Megatron-LM/pull/6205",
            "https://github.com/NVIDIA/Megatron-LM/pull/7278",
            "https://github.com/NVIDIA/Megatron-LM/pull/6746",
        ),
    ),
    # dev's roll reaches the padded boundaries through a helper (_get_packed_roll_cu_seqlens)
    marker=Marker(MTP, "roll_tensor", "cu_seqlens_q_padded"),
    # its CP all-gather must run on every rank of the group, as must theirs (fixes/peers.py)
    reads=("mtp-loss-mask", "mtp-cp-loss-scale"),
    collective=True,
)
