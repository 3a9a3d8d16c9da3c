"""bridge-mtp-off on stock megatron-bridge: a repeated-layer NemotronH provider with ``mtp_num_layers=0``
still builds an MTP block, and Bridge's first training step raises."""

from ..steps.bridge_step import mtp_off_cases
from ..runtime.launcher import run_ranks_checked


def reproduce():
    [case] = run_ranks_checked(mtp_off_cases, 1, args=((0,),), fixes=[], timeout=900)[0]
    step = f"raised {case.error.rstrip(': ')} (at {case.error_at})" if case.error else "trained"
    return case.mtp_block or case.error is not None, (
        f"repeated-layer NemotronH, mtp_num_layers=0: finalized pattern {case.pattern!r}, MTP block built: "
        f"{case.mtp_block}; Bridge's first step {step}"
    )
