"""The packed MTP roll on padded boundaries: one vectorised roll, one boundary exchange under CP.

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
"""

import threading

import torch


class RollPlan:
    """Where the slots of one CP-local packed row go: built once per layout, reused by every roll.

    ``dead``: bool [length], the slots zeroed after the roll. Under CP, ``firsts`` are the local
    positions of every chunk's first slot (front and back chunk of each sequence, interleaved), and
    ``front_lasts`` / ``back_lasts`` the last slots of the front and back chunks.
    """

    __slots__ = ("length", "cp_size", "cp_rank", "dead", "firsts", "front_lasts", "back_lasts")

    def __init__(self, length, cp_size, cp_rank, dead, firsts=None, front_lasts=None, back_lasts=None):
        self.length, self.cp_size, self.cp_rank = length, cp_size, cp_rank
        self.dead, self.firsts, self.front_lasts, self.back_lasts = dead, firsts, front_lasts, back_lasts


def boundaries(cu_seqlens_q, cu_seqlens_q_padded=None):
    """(real, padded) int64 CPU boundaries, checked; ``padded`` is ``real`` when none is given."""
    real = _cumulative(cu_seqlens_q, "packed_seq_params.cu_seqlens_q")
    if cu_seqlens_q_padded is None:
        return real, real
    padded = _cumulative(cu_seqlens_q_padded, "packed_seq_params.cu_seqlens_q_padded")
    if padded.numel() != real.numel():
        shorter = "shorter than" if padded.numel() < real.numel() else "longer than"
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q_padded has {padded.numel()} entries, {shorter} cu_seqlens_q "
            f"({real.numel()}): both must be [n+1], one start per packed sequence plus the end"
        )
    overlong = (real.diff() > padded.diff()).nonzero().flatten()
    if overlong.numel():
        first = int(overlong[0])
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q_padded is inconsistent with cu_seqlens_q: sequence {first} "
            f"has {int(real[first + 1] - real[first])} real tokens but a padded slot of "
            f"{int(padded[first + 1] - padded[first])} ({overlong.numel()} such sequence(s)); every padded "
            "length must be at least the real one"
        )
    return real, padded


_PLANS = {}  # key -> (objects the key names by id, kept alive so no id is reused; RollPlan)
_PLANS_KEPT = 4
_PLANS_LOCK = threading.Lock()


def plan_for(cu_seqlens_q, cu_seqlens_q_padded, length, cp_size, cp_rank, device):
    """The RollPlan for these boundaries, from a small cache: a forward rolls 2 + 2 * depth tensors
    (and the MTP layers' input_ids and position_ids) on one layout, so the boundaries are read (one
    device sync) and checked once. A boundary tensor changed in place gets a new plan (its version)."""
    def identity(cu):
        if isinstance(cu, torch.Tensor):
            return id(cu), cu._version
        return cu if isinstance(cu, tuple) else None  # a tuple of ints is its own key

    key = (identity(cu_seqlens_q), identity(cu_seqlens_q_padded), length, cp_size, cp_rank, str(device))
    cacheable = key[0] is not None and (cu_seqlens_q_padded is None or key[1] is not None)
    entry = _PLANS.get(key) if cacheable else None
    if entry is not None:
        return entry[1]
    plan = build_plan(*boundaries(cu_seqlens_q, cu_seqlens_q_padded), length, cp_size, cp_rank, device)
    if cacheable:
        with _PLANS_LOCK:
            while len(_PLANS) >= _PLANS_KEPT:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = ((cu_seqlens_q, cu_seqlens_q_padded), plan)
    return plan


def build_plan(real, padded, length, cp_size, cp_rank, device):
    """The RollPlan of a CP-local row of ``length`` slots for boundaries from `boundaries`."""
    padded_name = "packed_seq_params.cu_seqlens_q_padded"
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
            f"{length * cp_size} in all, but {padded_name} (cu_seqlens_q when it is None) ends at "
            f"{int(padded[-1])}: the packed row must be laid out on the padded boundaries"
        )
    with_next = (real.diff() - 1).clamp(min=0)  # positions 0 .. L-2 of a sequence have a real next token
    kept = slots > 0
    starts, slots, with_next = padded[:-1][kept], slots[kept], with_next[kept]
    if cp_size == 1:
        runs, run_lengths, offsets = starts, slots, torch.zeros_like(starts)
    else:
        chunk = slots // (2 * cp_size)
        front = starts // cp_size
        runs = torch.stack([front, front + chunk], 1).flatten()
        run_lengths = chunk.repeat_interleave(2)
        offsets = torch.stack([cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk], 1).flatten()
    # slot j of a run sits at position offset + j of its sequence: it keeps a value while that
    # position has a real next token
    live = (with_next.repeat_interleave(2 if cp_size > 1 else 1) - offsets).clamp(min=0)
    live = torch.minimum(live, run_lengths)
    dead = _dead_slots(runs, live, length, device)
    if cp_size == 1:
        return RollPlan(length, 1, 0, dead)
    firsts = runs.to(device)
    lasts = (runs + run_lengths - 1).to(device)
    return RollPlan(length, cp_size, cp_rank, dead, firsts, lasts[0::2], lasts[1::2])


def roll_packed(tensor, plan, cp_group=None):
    """``tensor`` [..., length] rolled left by one within its padded sequences, per ``plan``."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    if plan.cp_size > 1 and plan.firsts.numel():
        firsts = tensor.index_select(-1, plan.firsts).contiguous()
        gathered = firsts.new_empty(plan.cp_size * firsts.numel())
        _all_gather(gathered, firsts.view(-1), cp_group)
        gathered = gathered.view((plan.cp_size,) + tuple(firsts.shape))
        rank = plan.cp_rank
        if rank < plan.cp_size - 1:  # front chunk r continues in chunk r + 1: rank r + 1's front chunk
            rolled.index_copy_(-1, plan.front_lasts, gathered[rank + 1][..., 0::2])
        if rank > 0:  # back chunk 2cp-1-r continues in chunk 2cp-r: rank r - 1's back chunk
            rolled.index_copy_(-1, plan.back_lasts, gathered[rank - 1][..., 1::2])
    return rolled.masked_fill_(plan.dead, 0)


def _all_gather(output, tensor, group):
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(output, tensor, group=group)


def _dead_slots(runs, live, length, device):
    """Bool [length]: False on the first ``live[i]`` slots of run i, True elsewhere (runs tile the row)."""
    steps = torch.zeros(length + 1, dtype=torch.int32, device=device)
    ones = torch.ones(runs.numel(), dtype=torch.int32, device=device)
    runs = runs.to(device)
    steps.index_add_(0, runs, ones)
    steps.index_add_(0, runs + live.to(device), -ones)
    return steps.cumsum(0, dtype=torch.int32)[:length] == 0


def _cumulative(cu, name):
    if isinstance(cu, torch.Tensor):
        if cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got dtype {cu.dtype}")
        cu = cu.detach().to("cpu", torch.int64)
    else:
        cu = torch.as_tensor(cu, dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D [n+1] (0, then each packed sequence's end), got shape {list(cu.shape)}")
    if int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu.tolist()[:16]}")
    return cu
