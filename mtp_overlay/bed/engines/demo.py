"""The main job on an embedded default: tiny stock-megatron-core MTP models trained on gloo ranks, each
fix off and on: a GPTModel at TP2 + sequence parallel, an RL forward with a response-only mask, a
HybridModel on a packed (THD) batch with real sequence lengths under context parallelism, a
multimodal LLaVAModel (images and text) whose HybridModel language model has an MTP depth, and the
Nemotron 3 Super recipe's MTP block with its repeated MoE layer.

Run with `scripts/demo.sh` or `mtp-overlay demo`. The models, their MTP layers and the losses are
megatron-core's own; CPU shims stand in for CUDA. What the ranks print (torch's and megatron-core's
warnings) goes to a log file, named at the end, so the results read in one piece.
"""

import os
import tempfile

from mtp_overlay import registry

from ..runtime.launcher import RankPool
from ..fixes.mtp_loss_mask import scoped_mask_mtp_positions
from ..fixes.mtp_moe_router import DEPTHS, NUM_LAYERS, PATTERN, stock_mtp_router
from ..fixes.mtp_multimodal import llava_mtp_forward

SP_SCATTER = "mtp-sp-scatter"
LOSS_MASK = "mtp-loss-mask"
PACKED_ROLL = "mtp-packed-roll"
MULTIMODAL = "mtp-multimodal"
MOE_ROUTER = "mtp-moe-router"
NOT_SCATTERING = dict(sequence_parallel=True, scatter_embedding_sequence_parallel=False)
# four sequences of a packed RL batch, their prompt lengths, each padded to a multiple of 2*CP = 4
LENGTHS, PROMPTS, PAD_MULTIPLE = (9, 12, 6, 4), (2, 0, 3, 1), 4


def train(**model_kwargs):
    """One rank's training step on the embedded default batch."""
    from ..models.tiny_gpt import build_tiny_gpt, make_batch, train_step

    return train_step(build_tiny_gpt(**model_kwargs), make_batch())


def packed_rl_step():
    """One rank's RL step (labels=None) of the tiny HybridModel on the packed batch, laid out on the
    padded boundaries with the real ones in cu_seqlens_q (NeMo-RL's self-slicing path); the MTP
    targets it trained, in sequence numbering, and the mean MTP loss over them."""
    from ..models.packed import make_packed_row, run_packed, run_reference
    from ..models.tiny_hybrid import build_tiny_hybrid

    model = build_tiny_hybrid()
    if model.config.context_parallel_size == 1:  # the reference: each sequence alone, unpadded
        row = make_packed_row(LENGTHS, prompts=PROMPTS)
        result, real = run_reference(model, row, labels=False).portable(), None
    else:
        row = make_packed_row(LENGTHS, pad_multiple=PAD_MULTIPLE, flavour="unpadded", prompts=PROMPTS)
        result, real = run_packed(model, row, labels=False).portable(), row.real_slots().numpy()
    losses = result.mtp[0]["losses"][result.mtp[0]["trained"]]
    return result.trained(real), float(losses.mean())


def _losses(step):
    return f"loss {step.lm_loss:.5f}  MTP loss {step.mtp_loss:.5f}"


def _last_line(error):
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1] if lines else error


def main(out=print, log=None):
    """Print the status and the steps; return 0 when every fixed run matches its reference.

    ``log``: where the ranks' own output goes (default: a fresh file under the temp folder).
    """
    if log is None:
        descriptor, log = tempfile.mkstemp(prefix="mtp-overlay-demo-", suffix=".log")
        os.close(descriptor)
    out("== mtp-overlay status (this process)")
    for row in registry.status():
        out(f"   {row.name:<28} {row.state:<10} {row.distribution} {row.version or '-'}")
    ok = True
    with RankPool(1, log=log) as tp1, RankPool(2, tp=2, log=log) as tp2, RankPool(2, cp=2, log=log) as cp2:
        out("\n== reference: TP1, no fix")
        reference = tp1.run_checked(train, fixes=[])[0]
        out(f"   {_losses(reference)}")

        out("\n== mtp-sp-scatter: TP2 + sequence parallel, GPTModel(scatter_embedding_sequence_parallel=False)")
        stock = tp2.run(train, kwargs=NOT_SCATTERING, fixes=[])
        failed = [r for r in stock if r.error]
        out(f"   fix off: {'CRASH: ' + _last_line(failed[0].error) if failed else _losses(stock[0].value)}")
        fixed = tp2.run_checked(train, kwargs=NOT_SCATTERING, fixes=[SP_SCATTER])[0]
        match = abs(fixed.lm_loss - reference.lm_loss) < 1e-4 and abs(fixed.mtp_loss - reference.mtp_loss) < 1e-4
        ok &= match and bool(failed)
        out(f"   fix on:  {_losses(fixed)}  ({'matches TP1' if match else 'DIFFERS from TP1'})")

        out("\n== mtp-loss-mask: RL forward (labels=None), trainer scopes a response-only mask of kept samples")
        for label, fixes in (("fix off", []), ("fix on ", [LOSS_MASK])):
            trained, allowed = tp1.run_checked(scoped_mask_mtp_positions, fixes=fixes)[0]
            ok &= (trained == allowed) == bool(fixes)
            verdict = "only the response tokens" if trained == allowed else "prompts and the filtered sample too"
            out(f"   {label}: MTP head trained on {trained:.0f} positions, mask allows {allowed:.0f} ({verdict})")

        out("\n== mtp-packed-roll: HybridModel, packed THD (real lengths in cu_seqlens_q), CP2, RL")
        expected, expected_loss = tp1.run_checked(packed_rl_step, fixes=[])[0]
        out(f"   each sequence alone: MTP loss {expected_loss:.5f} on {len(expected)} targets")
        for label, fixes in (("fix off", []), ("fix on ", [PACKED_ROLL])):
            trained, loss = cp2.run_checked(packed_rl_step, fixes=fixes)[0]
            wrong = len(trained ^ expected)
            ok &= (wrong == 0) == bool(fixes)
            verdict = "all right" if wrong == 0 else f"{wrong} (position, target) pairs wrong or missed"
            out(f"   {label}: MTP loss {loss:.5f} on {len(trained)} targets ({verdict})")

        out("\n== mtp-multimodal: LLaVAModel (CLIP ViT, HybridModel with MTP), 2 images, labels, prompt masked, TP1")
        for label, fixes in (("fix off", []), ("fix on ", [LOSS_MASK, MULTIMODAL])):
            run = tp1.run_checked(llava_mtp_forward, fixes=fixes)[0]
            if run["error"] is not None:
                ok &= not fixes
                out(f"   {label}: CRASH: {_last_line(run['error'])}")
                continue
            right = run["trained"] == run["allowed"] and not run["image_targets"]
            ok &= right == bool(fixes)
            wrong = len(run["trained"] ^ run["allowed"])
            verdict = ("exactly those, no image slot" if right else
                       f"{wrong} pairs wrong or missed, {run['image_targets']} image-bound")
            out(f"   {label}: MTP head trained on {len(run['trained'])} positions, the combined mask allows "
                f"{len(run['allowed'])} ({verdict})")

        out(f"\n== mtp-moe-router: MTP block {PATTERN!r} at {DEPTHS} depths, one repeated MoE layer "
            "(Nemotron 3 Super), TP1")
        for label, fixes in (("fix off", []), ("fix on ", [MOE_ROUTER])):
            facts = tp1.run_checked(stock_mtp_router, fixes=fixes)[0]
            right = facts["ratio"] == 1.0 and facts["slots"] == [NUM_LAYERS + 1]
            ok &= right == bool(fixes)
            out(f"   {label}: router is_mtp_layer={facts['flag']}, its aux-loss gradient {facts['ratio']:.3f}x the "
                f"reference's, logged in slot {facts['slots']} (the MTP depth's: [{NUM_LAYERS + 1}])")
    out(f"\n(the ranks' own output: {log})")
    return 0 if ok else 1
