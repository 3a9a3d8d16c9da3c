"""bridge-sft-mtp-mask on stock megatron-bridge: Bridge's own SFT step (``gpt_step.forward_step``
through Megatron's schedule) trains the MTP head on more positions than the batch's loss mask allows."""

from ..steps.bridge_step import sft_mtp_cases
from ..runtime.launcher import run_ranks_checked


def reproduce():
    cases = run_ranks_checked(sft_mtp_cases, 1, fixes=[], timeout=900)[0]
    seen = "; ".join(f"{case.kind} ({case.built}): MTP trained {len(case.trained)} positions, the mask allows "
                     f"{len(case.allowed)}" for case in cases)
    return any(case.trained != case.allowed for case in cases), f"stock Bridge forward_step, TP1: {seen}"
