"""Every rank of a group runs the same collective fixes: checked once, at first use, outside the group.

mtp-packed-roll all-gathers over the CP group where stock exchanges point to point, mtp-cp-loss-scale
adds an all-reduce there, mtp-loss-mask's first RL forward one more: a rank without one of them
(``MTP_OVERLAY_DISABLE`` differing per node, an image without the startup hook) issues other
collectives than its peers, and gloo aborts on the mismatch or every rank hangs until killed.

So before its first collective on a group each of those fixes calls `agree`: the rank writes which of
the collective fixes it runs (``table.COLLECTIVE``: those declared ``collective=True``) into
torch.distributed's key-value store (the rendezvous store, not the group: a rank that lacks a fix
cannot be asked to join one more collective) and waits for every rank of the group to do the same.
Every rank that runs overlay code then compares and, where they differ, raises `OverlayError` naming
the ranks on each side: all of them at the same point, before any mismatched collective. A rank that
never answers (no overlay there at all) makes the others raise after
`TIMEOUT_S`, naming it: bounded, never a hang. Once agreed, a group is not asked again: each
collective fix's install starts afresh (`forget`), and what `agree` costs per call afterwards is a
dict lookup (the fixes' states are not even read: call `forget` after changing which fixes run on a
rank otherwise than by installing one).
"""

import json
import threading

from .. import table
from ..contract import OverlayError, State

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from . import Fix

ACTIVE = (State.INSTALLED, State.REDUNDANT)  # the fix's collectives run (a patched release runs them too)
TIMEOUT_S = 60.0  # how long a rank waits for its peers' answers
PREFIX = "mtp-overlay/peers"

_lock = threading.Lock()
_agreed: "set[tuple[tuple[int, ...], tuple[bool, ...]]]" = set()  # (group ranks, this rank's fixes) agreed on
_rounds: "dict[tuple[int, ...], int]" = {}  # group ranks -> agreements started (the store keys' generation)
_settled: "dict[int, Any]" = {}  # id(group) -> the group, agreed on since the last `forget` (the fast path)


def active(fix: "Fix") -> "tuple[bool, ...]":
    """Which of ``table.COLLECTIVE`` run in this process (in that order), as ``fix`` reads their states."""
    states = []
    for name in table.COLLECTIVE:
        state = fix.lifecycle.state()[0] if name == fix.name else fix.peer_state(name)[0]
        states.append(state in ACTIVE)
    return tuple(states)


def agree(fix: "Fix", group: "Any") -> None:
    """Return once every rank of ``group`` (a torch.distributed group of more than one rank) runs the
    same collective fixes as this one; OverlayError otherwise (see the module docstring)."""
    if _settled.get(id(group)) is group:
        return
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    mine = active(fix)
    with _lock:
        if (ranks, mine) in _agreed:
            _settled[id(group)] = group
            return
        generation = _rounds.get(ranks, 0)
        _rounds[ranks] = generation + 1
    answers = _exchange(ranks, generation, mine, fix.name)
    differing = {rank: answer for rank, answer in answers.items() if answer != list(mine)}
    if differing:
        rows = "; ".join(
            f"{name} on ranks {[r for r, a in sorted(answers.items()) if a[i]]}, not on "
            f"{[r for r, a in sorted(answers.items()) if not a[i]]}"
            for i, name in enumerate(table.COLLECTIVE) if len({a[i] for a in answers.values()}) > 1
        )
        raise OverlayError(
            f"mtp-overlay fix {fix.name!r}: the ranks {list(ranks)} of one group run different collective fixes "
            f"({rows}): their collectives would not match (a gloo abort, or a hang). Run the same fixes on every "
            "rank: the same MTP_OVERLAY_DISABLE everywhere, the startup hook in every image"
        )
    with _lock:
        _agreed.add((ranks, mine))
        _settled[id(group)] = group


def forget() -> None:
    """Start afresh: the next `agree` on any group asks its ranks again (a fix was (re)installed)."""
    with _lock:
        _agreed.clear()
        _settled.clear()


def _exchange(ranks: "tuple[int, ...]", generation: int, mine: "tuple[bool, ...]", fix_name: str) -> "dict[int, list[bool]]":
    """Every rank's answer through the default store; OverlayError naming the ranks that gave none."""
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    prefix = f"{PREFIX}/{'-'.join(map(str, ranks))}/{generation}/"
    store.set(prefix + str(dist.get_rank()), json.dumps(list(mine)))
    keys = [prefix + str(rank) for rank in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=TIMEOUT_S))
    except Exception as exc:  # the store's timeout error type differs across torch releases
        silent = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
        raise OverlayError(
            f"mtp-overlay fix {fix_name!r}: ranks {silent} of group {list(ranks)} did not say which collective "
            f"fixes they run within {TIMEOUT_S:g} s ({type(exc).__name__}): the overlay is not loaded there, or "
            "those ranks went another way. Load it on every rank (the startup hook in every image, the same "
            "MTP_OVERLAY_DISABLE everywhere): with a fix on some ranks only, the group's collectives do not match"
        ) from exc
    return {rank: json.loads(store.get(key)) for rank, key in zip(ranks, keys)}
