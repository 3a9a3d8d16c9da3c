"""A collective fix on some CP ranks only is refused on every rank, before any collective, never a hang.

``MTP_OVERLAY_DISABLE`` differing per node, or an image without the startup hook, leaves one CP rank
without mtp-cp-loss-scale (or mtp-packed-roll): its collectives no longer match its peers' (gloo
aborts on the mismatch at depth 1; at depth 2 with a per-token loss both ranks hang until killed).
Each collective fix first agrees with its group (`mtp_overlay.fixes.peers`): every rank that runs
overlay code raises OverlayError naming the ranks on each side; a rank without any overlay makes
the others raise after the timeout, naming it. Megatron's own step at CP=2, the tiny GPT (BSHD)
and the tiny HybridModel (packed THD). Wall time on 2 shared cores (load ~7), alone: 32 s; the
timeout case (slow, its own fresh ranks) 41 s.
"""

import re

import pytest

from mtp_overlay.bed.runtime.launcher import run_ranks, run_ranks_checked

FIXES = ["mtp-loss-mask", "mtp-packed-roll", "mtp-cp-loss-scale"]
# case -> (fixes installed on every rank, {rank: fixes it lacks}, MTP depth, loss, per-token, packed)
CASES = {
    "rank 1 lacks mtp-cp-loss-scale (depth 1)": (FIXES, {1: ["mtp-cp-loss-scale"]}, 1, "2-output", False, False),
    "rank 1 lacks mtp-cp-loss-scale (depth 2, per-token)": (FIXES, {1: ["mtp-cp-loss-scale"]}, 2, "3-output", True, False),
    "rank 1 lacks mtp-cp-loss-scale, no mtp-loss-mask": (FIXES[1:], {1: ["mtp-cp-loss-scale"]}, 1, "2-output", False, False),
    "rank 0 lacks mtp-packed-roll (packed)": (FIXES, {0: ["mtp-packed-roll"]}, 1, "3-output", True, True),
    "every rank runs them all": (FIXES, {}, 2, "3-output", True, False),
}


def mismatched_cases():
    """Rank worker (CP=2): each case of CASES, each from fresh agreements (as a fresh process), one
    step then a second; per case the error (OverlayError text) or the agreements started."""
    import torch.distributed as dist

    import mtp_overlay
    from mtp_overlay.contract import OverlayError
    from mtp_overlay.fixes import peers
    from mtp_overlay.bed.engines import parity
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.fixes.mtp_cp_loss_scale import microbatch
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt

    out = {}
    for name, (fixes, lacking, depth, loss, per_token, packed) in CASES.items():
        mtp_overlay.uninstall()
        if packed:
            model, batch = parity.build("hybrid"), parity.packed_row(4, "unpadded").microbatch(labels=True)
        else:
            model, batch = build_tiny_gpt(mtp_num_layers=depth, calculate_per_token_loss=per_token), microbatch("uneven")
        step = MegatronStep(model, optimizer=None)
        mtp_overlay.install(only=[fix for fix in fixes if fix not in lacking.get(dist.get_rank(), [])])
        peers.forget()
        rounds = sum(peers._rounds.values())
        try:
            step.step([batch], loss=loss, update=False)
            first = sum(peers._rounds.values()) - rounds
            step.step([batch], loss=loss, update=False)
            out[name] = ("ran", first, sum(peers._rounds.values()) - rounds)
        except OverlayError as error:
            out[name] = ("refused", str(error))
    mtp_overlay.uninstall()
    return out


def test_every_rank_refuses_a_collective_fix_some_ranks_lack():
    ranks = run_ranks_checked(mismatched_cases, 2, cp=2, fixes=FIXES, timeout=300)
    for rank, out in enumerate(ranks):
        assert set(out) == set(CASES)
        for name in ("rank 1 lacks mtp-cp-loss-scale (depth 1)", "rank 1 lacks mtp-cp-loss-scale (depth 2, per-token)",
                     "rank 1 lacks mtp-cp-loss-scale, no mtp-loss-mask"):
            kind, message = out[name]
            assert kind == "refused", (rank, name, out[name])
            assert "the ranks [0, 1] of one group run different collective fixes" in message
            assert "mtp-cp-loss-scale on ranks [0], not on [1]" in message and "MTP_OVERLAY_DISABLE" in message
        kind, message = out["rank 0 lacks mtp-packed-roll (packed)"]
        assert kind == "refused" and "mtp-packed-roll on ranks [1], not on [0]" in message, (rank, message)
        # agreed once, at the first step; the second asks nobody
        assert out["every rank runs them all"] == ("ran", 1, 1), (rank, out["every rank runs them all"])


def overlay_on_rank_0_only():
    """Rank worker (CP=2): rank 0 runs every fix, rank 1 none (an image without the startup hook);
    peers.TIMEOUT_S cut to 3 s. Rank 0 raises; rank 1 runs stock into a collective rank 0 never joins."""
    import torch.distributed as dist

    import mtp_overlay
    from mtp_overlay.fixes import peers
    from mtp_overlay.bed.steps.megatron_step import MegatronStep
    from mtp_overlay.bed.fixes.mtp_cp_loss_scale import microbatch
    from mtp_overlay.bed.models.tiny_gpt import build_tiny_gpt

    mtp_overlay.uninstall()
    step = MegatronStep(build_tiny_gpt(), optimizer=None)
    if dist.get_rank() == 0:
        mtp_overlay.install(only=FIXES)
    peers.TIMEOUT_S = 3.0
    step.step([microbatch("uneven")], loss="2-output", update=False)


@pytest.mark.slow
def test_a_rank_without_the_overlay_is_named_after_the_timeout_not_a_hang():
    results = run_ranks(overlay_on_rank_0_only, 2, cp=2, fixes=[], timeout=120, fresh=True)
    error = results[0].error
    assert error is not None and "OverlayError" in error, error
    assert re.search(r"ranks \[1\] of group \[0, 1\] did not say which collective fixes they run within 3 s", error)
    assert not results[1].ok  # stopped in stock's exchange with rank 0 (killed once rank 0 had failed)
