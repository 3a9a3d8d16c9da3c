"""mtp-packed-roll with the fix off: megatron-core's packed MTP roll on a padded pack.

Two packs, run on two gloo ranks with CP=2 and the installed megatron-core:
* lengths 3 and 5 padded to 4 and 8, rolled on one rank without CP, as ``process_mtp_loss`` does for
  depth 1 with labels=None: which (position, input token -> target) pairs the MTP loss trains;
* lengths 5 and 7 padded to 8 under CP=2: the labels each rank gets, against the per-sequence reference.
"""

PAD = 99
SMALL = dict(real=(3, 5), padded=(4, 8), tokens=(11, 12, 13, PAD, 21, 22, 23, 24, 25, PAD, PAD, PAD))
CP_PACK = dict(real=(5, 7), padded=(8, 8), tokens=(1, 2, 3, 4, 5, PAD, PAD, PAD, 11, 12, 13, 14, 15, 16, 17, PAD))


def packed_rolls():
    """Rank worker (CP=2): (pairs the installed roll trains, pairs it should) for SMALL without CP, and the
    number of this rank's label slots that differ from the reference for CP_PACK under CP=2."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    from ..oracles.packed_reference import cp_local, mtp_targets, packed_params, reference_roll, trained_pairs

    ids = torch.tensor([SMALL["tokens"]])
    mask = (ids != PAD).float()
    params = packed_params(SMALL["real"], SMALL["padded"])
    stock = trained_pairs(ids, *mtp_targets(mtp.roll_tensor, ids, mask, 1, packed_seq_params=params)[:2])

    def reference(tensor, **_):
        return reference_roll(tensor, SMALL["real"], SMALL["padded"]), None

    expected = trained_pairs(ids, *mtp_targets(reference, ids, mask, 1)[:2])

    group = parallel_state.get_context_parallel_group()
    rank, size = group.rank(), group.size()
    row = torch.tensor([CP_PACK["tokens"]])
    local = cp_local(row, CP_PACK["padded"], size, rank)
    params = packed_params(CP_PACK["real"], CP_PACK["padded"])
    labels, _ = mtp.roll_tensor(local, -1, -1, cp_group=group, packed_seq_params=params)
    want = cp_local(reference_roll(row, CP_PACK["real"], CP_PACK["padded"]), CP_PACK["padded"], size, rank)
    return sorted(stock), sorted(expected), int((labels != want).sum())


def reproduce():
    from ..runtime.launcher import run_ranks_checked

    results = run_ranks_checked(packed_rolls, 2, cp=2, fixes=[])
    stock, expected, _ = results[0]
    wrong_cp = sum(result[2] for result in results)

    def show(pairs):
        return ", ".join(f"({p}, {'pad' if t == PAD else t} -> {'pad' if y == PAD else y})" for p, t, y in pairs)

    extra = [pair for pair in stock if pair not in expected]
    missed = [pair for pair in expected if pair not in stock]
    evidence = (
        f"lengths 3,5 padded to 4,8 (cu_seqlens_q [0,3,8], padded [0,4,12]), MTP depth 1, labels=None: "
        f"stock trains {show(extra) or 'nothing extra'} and misses {show(missed) or 'nothing'}; "
        f"lengths 5,7 padded to 8 under CP=2: {wrong_cp} of 16 stock label slots differ from the per-sequence reference"
    )
    return bool(extra or missed or wrong_cp), evidence
