"""Print the mtp-cp-loss-scale table: MTP and LM gradients at CP=2 and TP2xCP2+SP against CP=1.

Megatron's own step (get_forward_backward_func -> DDP -> finalize_model_grads) on the tiny GPT with
one MTP layer, batch 2 x 32, every loss mode and mask of
mtp_overlay.bed.fixes.mtp_cp_loss_scale, stock megatron-core (fix off) and fixed (fix on)
side by side. relerr = |g - g_CP1| / |g_CP1|. Usage: PYTHONPATH=$PWD python scripts/cp_loss_scale_table.py
"""

import time

from mtp_overlay.bed.runtime.launcher import run_ranks_checked
from mtp_overlay.bed.fixes.mtp_cp_loss_scale import MASKS, MODES, measure


def both(sequence_parallel=False):
    """Worker: the table, and the logged metrics with an 8-token vocabulary (a non-zero acceptance)."""
    return measure(sequence_parallel=sequence_parallel), measure(sequence_parallel=sequence_parallel, vocab_size=8)


def main():
    started = time.perf_counter()
    cp1, cp1_metrics = run_ranks_checked(both, 1, fixes=[])[0]
    cp2, cp2_metrics = run_ranks_checked(both, 2, cp=2, fixes=[])[0]
    tp2cp2 = run_ranks_checked(measure, 4, tp=2, cp=2, fixes=[], kwargs=dict(sequence_parallel=True))[0]
    header = (
        f"{'mode':<62} {'mask':<8} | {'MTP relerr CP2':>14} {'TP2xCP2+SP':>10} | {'fixed CP2':>9} {'TP2xCP2+SP':>10} "
        f"| {'LM relerr CP2':>13} | {'mtp_1_loss CP1':>14} {'stock CP2':>9} {'fixed CP2':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in MODES:
        for mask in MASKS:
            key = (name, mask)
            reference = cp1[key]["stock"]
            assert cp1[key]["fixed"].relative_error(reference, "mtp") == 0.0  # the fix stands aside at CP=1
            relerr = {
                (where, variant): result[key][variant].relative_error(reference, "mtp")
                for where, result in (("cp2", cp2), ("tp2cp2", tp2cp2))
                for variant in ("stock", "fixed")
            }
            lm = cp2[key]["stock"].relative_error(reference, "lm")
            lm_fixed = cp2[key]["fixed"].relative_error(reference, "lm")
            assert lm == lm_fixed, (lm, lm_fixed)
            print(
                f"{name:<62} {mask:<8} | {relerr['cp2', 'stock']:>14.3g} {relerr['tp2cp2', 'stock']:>10.3g} "
                f"| {relerr['cp2', 'fixed']:>9.1e} {relerr['tp2cp2', 'fixed']:>10.1e} | {lm:>13.2g} "
                f"| {reference.mtp_loss:>14.5f} {cp2[key]['stock'].mtp_loss:>9.5f} {cp2[key]['fixed'].mtp_loss:>9.5f}"
            )
    print("\nlogged metrics (mtp/mtp_1_loss, mtp/mtp_1_acceptance_rate) with an 8-token vocabulary, CP1 / stock CP2 / fixed CP2:")
    for key, row in cp2_metrics.items():
        reference = cp1_metrics[key]["stock"]
        losses = " / ".join(f"{r.mtp_loss:.5f}" for r in (reference, row["stock"], row["fixed"]))
        acceptance = " / ".join(f"{r.mtp_acceptance[0]:.3f}" for r in (reference, row["stock"], row["fixed"]))
        print(f"{key[0]:<62} {key[1]:<8} | loss {losses} | acceptance % {acceptance}")
    print(f"\n({time.perf_counter() - started:.0f} s; LM relerr is the same with the fix on and off)")


if __name__ == "__main__":
    main()
