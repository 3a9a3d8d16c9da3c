"""bridge-mtp-export: what it targets, where it comes from, which releases its patch fits (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

NEMOTRON_H_BRIDGE = "megatron.bridge.models.nemotronh.nemotron_h_bridge"

DECLARATION = Declaration(
    "bridge-mtp-export",
    summary="Export a repeated-layer NemotronH's MTP as the one layer it has, with its MTP pattern, so the HF config "
    "builds vLLM's drafter.",
    symptom="Bridge's NemotronH export writes a repeated-layer model's MTP repetitions as `num_nextn_predict_layers` "
    "(2 for one shared layer applied twice): vLLM's `NemotronHMTP` refuses the config; an unfinalized provider's "
    "export drops `mtp_hybrid_override_pattern` (the drafter gets HF's default layers)",
    distribution="megatron-bridge",
    targets={
        "nemotron_h_bridge": NEMOTRON_H_BRIDGE,  # NemotronHBridge.megatron_to_hf_config
    },
    families={"0.6": ">=0.6.0,<0.7"},
    provenance=Provenance(
        origin="Megatron-Bridge issue #5946 (Nemotron 3.5 Lightning export refused by vLLM)",
        upstream_fix="Megatron-Bridge PR #5948 (main, after 067f987; the depth only; no release yet)",
        bugs=("https://github.com/NVIDIA-NeMo/Megatron-Bridge/issues/5946",
              "https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/5948"),
    ),
    # the export reads whether the MTP layer is repeated (stock never looks)
    marker=Marker(NEMOTRON_H_BRIDGE, "NemotronHBridge.megatron_to_hf_config", "mtp_use_repeated_layer"),
)
