"""The main job on an embedded default: a tiny stock-megatron-core GPT with one MTP layer trained for
one step on 2 gloo ranks (TP2 + sequence parallel), with each fix off and on.

Run with `scripts/demo.sh` or `mtp-overlay demo`. The model, its MTP layer and the losses are
megatron-core's own; CPU shims stand in for CUDA. What the ranks print (torch's and megatron-core's
warnings) goes to a log file, named at the end, so the results read in one piece.
"""

import os
import tempfile

from mtp_overlay import registry

from .launcher import run_ranks, run_ranks_checked
from .reproducers.mtp_loss_mask import scoped_mask_mtp_positions

SP_SCATTER = "mtp-sp-scatter"
LOSS_MASK = "mtp-loss-mask"
NOT_SCATTERING = dict(sequence_parallel=True, scatter_embedding_sequence_parallel=False)


def train(**model_kwargs):
    """One rank's training step on the embedded default batch."""
    from .tiny_gpt import build_tiny_gpt, make_batch, train_step

    return train_step(build_tiny_gpt(**model_kwargs), make_batch())


def _losses(step):
    return f"loss {step.lm_loss:.5f}  MTP loss {step.mtp_loss:.5f}"


def _last_line(error):
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1] if lines else error


def main(out=print, log=None):
    """Print the status and the steps; return 0 when every fixed run matches TP1.

    ``log``: where the ranks' own output goes (default: a fresh file under the temp folder).
    """
    if log is None:
        descriptor, log = tempfile.mkstemp(prefix="mtp-overlay-demo-", suffix=".log")
        os.close(descriptor)
    out("== mtp-overlay status (this process)")
    for row in registry.status():
        out(f"   {row.name:<28} {row.state:<10} {row.distribution} {row.version or '-'}")
    ok = True

    out("\n== reference: TP1, no fix")
    reference = run_ranks_checked(train, 1, fixes=[], log=log)[0]
    out(f"   {_losses(reference)}")

    out("\n== mtp-sp-scatter: TP2 + sequence parallel, GPTModel(scatter_embedding_sequence_parallel=False)")
    stock = run_ranks(train, 2, tp=2, kwargs=NOT_SCATTERING, fixes=[], log=log)
    failed = [r for r in stock if r.error]
    out(f"   fix off: {'CRASH: ' + _last_line(failed[0].error) if failed else _losses(stock[0].value)}")
    fixed = run_ranks_checked(train, 2, tp=2, kwargs=NOT_SCATTERING, fixes=[SP_SCATTER], log=log)[0]
    match = abs(fixed.lm_loss - reference.lm_loss) < 1e-4 and abs(fixed.mtp_loss - reference.mtp_loss) < 1e-4
    ok &= match and bool(failed)
    out(f"   fix on:  {_losses(fixed)}  ({'matches TP1' if match else 'DIFFERS from TP1'})")

    out("\n== mtp-loss-mask: RL forward (labels=None), trainer scopes a response-only mask of kept samples")
    for label, fixes in (("fix off", []), ("fix on ", [LOSS_MASK])):
        trained, allowed = run_ranks_checked(scoped_mask_mtp_positions, 1, fixes=fixes, log=log)[0]
        ok &= (trained == allowed) == bool(fixes)
        verdict = "only the response tokens" if trained == allowed else "prompts and the filtered sample too"
        out(f"   {label}: MTP head trained on {trained:.0f} positions, mask allows {allowed:.0f} ({verdict})")
    out(f"\n(the ranks' own output: {log})")
    return 0 if ok else 1
