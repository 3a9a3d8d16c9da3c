"""The packed MTP roll on padded boundaries: computed on the device from the boundaries given, one exchange under CP.

Layout (megatron-core THD with context parallelism, Transformer Engine's
``thd_get_partitioned_indices``): the packed row is laid out on ``cu_seqlens_q_padded``; each padded
sequence is cut into ``2 * cp`` chunks and CP rank r holds chunks r and ``2 * cp - 1 - r`` back to
back, sequence after sequence. Rolling left by one moves every element one slot back in its own
sequence. Inside a chunk that is the plain ``torch.roll`` of the local row; the last slot of a chunk
takes the first element of the next chunk, which lives on another rank (chunk r + 1 on rank r + 1,
chunk ``2 * cp - r`` on rank r - 1), except on rank ``cp - 1`` whose two chunks are neighbours. All
chunk-first elements travel in one all-gather over the CP group: no global ranks, no world group
(Megatron-LM #6746), and one collective per roll instead of one exchange per sequence.

Then every slot at or past its sequence's last real token (the real length from ``cu_seqlens_q``)
is zeroed, padding included (Megatron-LM #7278): ``[1,1,1,1,1,1,1,0]`` rolls to
``[1,1,1,1,1,1,0,0]``, so a pad token is never a label and a mask that is nonzero on padding never
trains it.

Where each slot goes is worked out on the tensor's device from the boundaries the call gives
(`mtp_overlay.mtp.packing.row_plan` and `covered`: a few ops over the sequences and one cumulative
sum over the row, static shapes, no host read), once per model forward (the forward scope
mtp-loss-mask's hook opens, `mtp_overlay.mtp.packing.forward_scope`): every roll of every MTP depth
shares it, then a roll is ``torch.roll`` and one ``masked_fill_`` (under CP, the splice too). Nothing
is kept past the forward: a plan cached by the boundary tensor's identity and version went stale
when a collective, numpy or ``.data`` rewrote a reused buffer between steps, and inference tensors
have no version at all. The boundaries'
validity is asserted on the device (`mtp_overlay.mtp.checks`); ``MTP_OVERLAY_CHECKS=full`` checks
them on the host first, with a ValueError naming the argument.
"""

from typing import NamedTuple

import torch

from ...mtp import checks
from ...mtp.packing import boundary_tensor, covered, per_forward, row_plan

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

REAL, PADDED = "packed_seq_params.cu_seqlens_q", "packed_seq_params.cu_seqlens_q_padded"


def roll_packed(tensor: "torch.Tensor", cu_seqlens_q: "torch.Tensor", cu_seqlens_q_padded: "torch.Tensor | None" = None,
                cp_group: "Any" = None, cp_size: int = 1, cp_rank: int = 0) -> "torch.Tensor":
    """``tensor`` [..., L], a CP-local packed row, rolled left by one within its padded sequences.

    ``cu_seqlens_q``: the real boundaries; ``cu_seqlens_q_padded``: those the row is laid out on
    (None: the real ones); both [n+1] integer tensors (any device: they are moved to the tensor's)
    or sequences of ints, in full-row positions. Under CP (``cp_size`` > 1) one all-gather of the
    chunk-first elements over ``cp_group``. Within a `mtp_overlay.mtp.packing.forward_scope` the
    plan (`_RollPlan`) is worked out once for every roll of the forward.
    """
    length, device = tensor.shape[-1], tensor.device
    if checks.full():
        real = boundary_tensor(cu_seqlens_q, REAL, device)
        padded = real if cu_seqlens_q_padded is None else boundary_tensor(cu_seqlens_q_padded, PADDED, device)
        if padded.numel() == real.numel():  # else row_plan names the mismatch
            check_boundaries(real, padded, length, cp_size)
    plan = per_forward(("roll", length, cp_size, cp_rank, str(device)), (cu_seqlens_q, cu_seqlens_q_padded),
                       lambda: _plan(cu_seqlens_q, cu_seqlens_q_padded, length, cp_size, cp_rank, device))
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    if length == 0:  # nothing to roll; under CP every rank's row is empty (same boundaries)
        return rolled
    if cp_size > 1:
        rolled = _splice_neighbours(tensor, rolled, plan, cp_group, cp_size, cp_rank)
    return rolled.masked_fill_(plan.cut, 0)


class _RollPlan(NamedTuple):
    """Where the slots of one packed row go: ``cut`` (bool [L]) the slots zeroed after the roll;
    under CP ``firsts`` (each chunk's first slot), ``front_lasts`` / ``back_lasts`` (the last slot of
    each front / back chunk, or the scratch slot L of an empty one)."""

    cut: torch.Tensor
    firsts: torch.Tensor | None
    front_lasts: torch.Tensor | None
    back_lasts: torch.Tensor | None


def _plan(cu_seqlens_q: "torch.Tensor", cu_seqlens_q_padded: "torch.Tensor | None", length: int, cp_size: int,
          cp_rank: int, device: "torch.device") -> _RollPlan:
    plan = row_plan(cu_seqlens_q, cu_seqlens_q_padded, length, cp_size, cp_rank, device, (REAL, PADDED))
    # slot j of a run sits at place offset + j of its sequence: it keeps a value while that place has
    # a real next token (positions 0 .. L-2 of a sequence)
    live = torch.minimum((plan.real_lengths - 1 - plan.offsets).clamp(min=0), plan.lengths)
    cut = ~covered(plan.starts, live, length)
    if cp_size == 1:
        return _RollPlan(cut, None, None, None)
    lasts = torch.where(plan.lengths > 0, plan.starts + plan.lengths - 1, length)
    return _RollPlan(cut, plan.starts.clamp(max=length - 1), lasts[0::2], lasts[1::2])


def _splice_neighbours(tensor: "torch.Tensor", rolled: "torch.Tensor", plan: "_RollPlan", cp_group: "Any",
                       cp_size: int, cp_rank: int) -> "torch.Tensor":
    """``rolled`` with the last slot of each chunk set to the first element of the next chunk.

    Chunk firsts and lasts are indexed by sequence (static shapes); an empty sequence's index points
    at a scratch slot past the row (and its first at a slot no one reads), so nothing is filtered on
    the host.
    """
    length = tensor.shape[-1]
    firsts, front_lasts, back_lasts = plan.firsts, plan.front_lasts, plan.back_lasts
    assert firsts is not None and front_lasts is not None and back_lasts is not None  # a CP plan has them
    sent = tensor.index_select(-1, firsts).contiguous()  # front, back firsts interleaved
    gathered = sent.new_empty(cp_size * sent.numel())
    _all_gather(gathered, sent.view(-1), cp_group)
    gathered = gathered.view((cp_size,) + tuple(sent.shape))
    spliced = torch.cat([rolled, rolled.new_zeros(rolled.shape[:-1] + (1,))], -1)
    if cp_rank < cp_size - 1:  # front chunk r continues in chunk r + 1: rank r + 1's front chunk
        spliced.index_copy_(-1, front_lasts, gathered[cp_rank + 1][..., 0::2])
    if cp_rank > 0:  # back chunk 2cp-1-r continues in chunk 2cp-r: rank r - 1's back chunk
        spliced.index_copy_(-1, back_lasts, gathered[cp_rank - 1][..., 1::2])
    return spliced[..., :length].contiguous()


def roll_unpacked_cp(tensor: "torch.Tensor", cp_group: "Any", cp_size: int, cp_rank: int) -> "torch.Tensor":
    """Unpacked rows under CP, each row one sequence whose two local chunks are the halves of the
    local row: stock's values, one all-gather over ``cp_group``; every index a Python int."""
    length = tensor.shape[-1]
    chunk = length // 2
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    sent = torch.stack([tensor[..., 0], tensor[..., chunk]], -1).contiguous()
    gathered = sent.new_empty(cp_size * sent.numel())
    _all_gather(gathered, sent.view(-1), cp_group)
    gathered = gathered.view((cp_size,) + tuple(sent.shape))
    if cp_rank < cp_size - 1:
        rolled[..., chunk - 1] = gathered[cp_rank + 1][..., 0]
    rolled[..., length - 1] = gathered[cp_rank - 1][..., 1] if cp_rank > 0 else 0  # rank 0 ends the sequence
    return rolled


def check_boundaries(real: "torch.Tensor", padded: "torch.Tensor", length: int, cp_size: int) -> None:
    """``MTP_OVERLAY_CHECKS=full``: the boundaries checked on the host, ValueError naming the argument."""
    real_name, padded_name = REAL, PADDED if padded is not real else REAL
    for cu, name in ((real, real_name), (padded, padded_name)):
        cu = cu.cpu()
        if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
            raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()[:16]}")
    real, padded = real.cpu(), padded.cpu()
    overlong = (real.diff() > padded.diff()).nonzero().flatten()
    if overlong.numel():
        first = int(overlong[0])
        raise ValueError(
            f"{PADDED} is inconsistent with cu_seqlens_q: sequence {first} has {int(real[first + 1] - real[first])} "
            f"real tokens but a padded slot of {int(padded[first + 1] - padded[first])} ({overlong.numel()} such "
            "sequence(s)); every padded length must be at least the real one"
        )
    slots = padded.diff()
    if cp_size > 1:
        uneven = (slots % (2 * cp_size)).nonzero().flatten()
        if uneven.numel():
            first = int(uneven[0])
            raise ValueError(
                f"{padded_name}: padded sequence {first} has length {int(slots[first])}, not divisible by "
                f"2*cp_size={2 * cp_size} ({uneven.numel()} such sequence(s)); under context parallelism every "
                "sequence is padded to a multiple of 2*cp_size (times TP under sequence parallelism)"
            )
    if int(padded[-1]) != length * cp_size:
        raise ValueError(
            f"tensor to roll has {length} slots on this CP rank, {length} x cp_size {cp_size} = "
            f"{length * cp_size} in all, but {PADDED} (cu_seqlens_q when it is None) ends at {int(padded[-1])}: the "
            "packed row must be laid out on the padded boundaries"
        )


def _all_gather(output: "torch.Tensor", tensor: "torch.Tensor", group: "Any") -> None:
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(output, tensor, group=group)
