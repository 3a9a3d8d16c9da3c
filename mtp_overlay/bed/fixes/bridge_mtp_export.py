"""bridge-mtp-export on stock megatron-bridge: the HF config Bridge exports for a repeated-layer NemotronH
is refused by vLLM's real MTP drafter, and a provider exported unfinalized loses its MTP pattern."""

from ..steps.bridge_step import MTP_REPEATS, export_case, exported_drafters
from ..runtime.launcher import run_ranks_checked


def reproduce():
    finalized, unfinalized = run_ranks_checked(export_cases, 1, fixes=[], timeout=900)[0]
    [drafter] = exported_drafters([finalized.config])
    built = f"refused: {drafter.error} (at {drafter.error_at})" if drafter.error else f"built {drafter.num_mtp_layers} layer(s)"
    dropped = "mtp_hybrid_override_pattern" not in unfinalized.exported
    return drafter.error is not None or dropped, (
        f"one shared MTP layer applied {MTP_REPEATS} times exports num_nextn_predict_layers="
        f"{finalized.config['num_nextn_predict_layers']}; vLLM's NemotronHMTP {built}; exported unfinalized: "
        f"mtp_hybrid_override_pattern {'dropped' if dropped else 'kept'}"
    )


def export_cases():
    """Rank worker: the `export_case` of a finalized and of an unfinalized provider."""
    return export_case(finalize=True), export_case(finalize=False)
