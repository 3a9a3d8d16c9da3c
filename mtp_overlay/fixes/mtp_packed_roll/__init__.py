"""mtp-packed-roll: roll MTP labels, loss mask and inputs on the padded layout of packed (THD) batches.

megatron-core 0.16-0.19.x: ``_roll_tensor_packed_seq`` takes the sequence boundaries from
``packed_seq_params.cu_seqlens_q`` while packed tensors are laid out on ``cu_seqlens_q_padded``.
Whenever the two differ, the MTP labels derived from ``input_ids`` (labels=None, Megatron-LM PR
#3457) and every roll of ``loss_mask`` cut the wrong spans: under CP the local offsets
``start // cp_size`` point into the wrong chunks (IndexError, mismatched exchanges, or silently
shifted targets); without CP the roll wraps inside padding. Its per-sequence exchanges and
``roll_tensor``'s run on the world group (Megatron-LM #6746). Upstream: padded boundaries on ``dev``
(Megatron-LM #4494); on main #4495/#6205 and the logical-end mask #7278 are open.

The hook replaces both rolls with `roll.roll_packed`: one vectorised roll on the padded boundaries,
each sequence's last real token and its padding zeroed (#7278), one all-gather over the CP group per
roll. It returns what stock returns: the rolled tensor and its local sum (``process_mtp_loss`` divides
each depth's MTP loss by that count). Where the slots go is computed at every call on the device from
the boundaries given (no host read, no cache: ``torch.inference_mode`` and boundary buffers rewritten
in place by a collective or through numpy are rolled right); the boundaries are checked on the device
(`mtp_overlay.mtp.checks`, ``MTP_OVERLAY_CHECKS=full`` on the host). Before its first all-gather on a
CP group it checks that every rank of the group runs it (`mtp_overlay.fixes.peers`).
"""

from ...calls import argument, original, positions
from ...contract import Verdict, drifted, needed, redundant
from .. import Fix, peers
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

PADDED = "cu_seqlens_q_padded"
# parameters by shape -> the releases that have it
ROLL_SIGNATURES = {
    ("tensor", "shifts", "dims", "cp_group", "packed_seq_params"): "0.16-0.19",
    ("tensor", "shifts", "dims", "cp_group", "packed_seq_params", "return_sum"): "main (2026-08)",
}
PACKED_SIGNATURES = {
    ("tensor", "shifts", "dims", "packed_seq_params", "cp_group"): "0.16-0.19",
    ("tensor", "shifts", "dims", "packed_seq_params", "cp_group", "return_sum"): "main (2026-08)",
}


def stock_rolls(module: "ModuleType") -> "tuple[Callable[..., Any] | None, Callable[..., Any] | None]":
    """(roll_tensor, _roll_tensor_packed_seq) as upstream defined them (None where missing)."""
    roll, packed = (vars(module).get(name) for name in ("roll_tensor", "_roll_tensor_packed_seq"))
    return (None if roll is None else original(roll)), (None if packed is None else original(packed))


class PackedRollFix(Fix):
    declaration = DECLARATION  # one target, "mtp": roll_tensor and _roll_tensor_packed_seq

    def probe(self, module: "ModuleType") -> Verdict:
        roll, packed = stock_rolls(module)
        if roll is not None and self.marker.in_function(roll):
            return redundant(
                f"roll_tensor already reads packed_seq_params.{PADDED} (Megatron-LM #4494/#6205, or patched on disk)"
            )
        if roll is None or packed is None:
            return drifted(f"{module.__name__} has no {'roll_tensor' if roll is None else '_roll_tensor_packed_seq'}")
        for function, known in ((roll, ROLL_SIGNATURES), (packed, PACKED_SIGNATURES)):
            parameters = _parameters(function)
            if parameters not in known:
                shapes = "; ".join(f"{family}: {p}" for p, family in known.items())
                return drifted(f"{function.__name__}{parameters} matches none of {shapes}")
        family = PACKED_SIGNATURES[_parameters(packed)]
        return needed(f"megatron-core {family} shape: the packed roll reads cu_seqlens_q")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        peers.forget()  # installed (again): its groups agree afresh
        stock = stock_rolls(module)
        assert stock[0] is not None and stock[1] is not None, "probed first"
        roll, packed = _Arguments(stock[0]), _Arguments(stock[1])

        def rolled_and_sum(rolled: "Any", read: "_Arguments", args: "tuple[Any, ...]", kwargs: "dict[str, Any]") -> "Any":
            return rolled, (rolled.sum() if read(args, kwargs, "return_sum", True) else None)

        def roll_packed_seq(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                            kwargs: "dict[str, Any]") -> "Any":
            tensor = packed(args, kwargs, "tensor")
            if tensor is None or not _left_shift_on_last_dim(tensor, packed, args, kwargs):
                return wrapped(*args, **kwargs)  # stock refuses these with its own assertion
            rolled = roll_packed_seq_params(tensor, packed(args, kwargs, "packed_seq_params"), packed(args, kwargs, "cp_group"))
            return rolled_and_sum(rolled, packed, args, kwargs)

        def roll_tensor(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                        kwargs: "dict[str, Any]") -> "Any":
            tensor, group = roll(args, kwargs, "tensor"), roll(args, kwargs, "cp_group")
            unpacked_cp = tensor is not None and roll(args, kwargs, "packed_seq_params") is None and _size(group) > 1
            if not unpacked_cp or not _left_shift_on_last_dim(tensor, roll, args, kwargs):
                return wrapped(*args, **kwargs)  # packed calls reach roll_packed_seq through stock
            return rolled_and_sum(roll_unpacked_cp(tensor, group), roll, args, kwargs)

        yield module, "_roll_tensor_packed_seq", roll_packed_seq
        yield module, "roll_tensor", roll_tensor


def roll_packed_seq_params(tensor: "Any", packed_seq_params: "Any", cp_group: "Any" = None) -> "Any":
    """``tensor`` (a CP-local packed row, [..., T]) rolled left by one as megatron-core's packed MTP
    roll should: on ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``), zero from each sequence's last
    real token on, one all-gather over ``cp_group``. ValueError naming the bad boundary argument."""
    from .roll import roll_packed

    real = getattr(packed_seq_params, "cu_seqlens_q", None)
    if real is None:
        raise ValueError(
            "packed_seq_params.cu_seqlens_q is None: the packed MTP roll needs the real sequence boundaries"
        )
    cp_size, cp_rank = _size_rank(cp_group)
    if cp_size > 1:
        peers.agree(FIX, cp_group)
    return roll_packed(tensor, real, getattr(packed_seq_params, PADDED, None), cp_group, cp_size, cp_rank)


def roll_unpacked_cp(tensor: "Any", cp_group: "Any") -> "Any":
    """Unpacked rows under CP (each row one sequence in the 2*cp-chunk layout): stock's values, but
    one all-gather over ``cp_group`` instead of world-group send/recv (Megatron-LM #6746)."""
    from .roll import roll_unpacked_cp as roll

    length = tensor.shape[-1]
    if length % 2:
        raise ValueError(
            f"tensor: a CP-local sequence holds two chunks, so its length must be even, got {length} "
            f"(shape {list(tensor.shape)})"
        )
    peers.agree(FIX, cp_group)
    return roll(tensor, cp_group, *_size_rank(cp_group))


def _parameters(function: "Callable[..., Any]") -> "tuple[str, ...]":
    import inspect

    return tuple(inspect.signature(function).parameters)


class _Arguments:
    """Reads an argument of a call to ``function`` by name: where it sits (`positions`), else its
    default in the stock signature (``default`` for a parameter the release does not have)."""

    def __init__(self, function: "Callable[..., Any]") -> None:
        import inspect

        self.positions = positions(function)
        self.defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()
                         if p.default is not p.empty}

    def __call__(self, args: "tuple[Any, ...]", kwargs: "dict[str, Any]", name: str, default: "Any" = None) -> "Any":
        return argument(args, kwargs, self.positions.get(name), name, self.defaults.get(name, default))


def _left_shift_on_last_dim(tensor: "Any", read: _Arguments, args: "tuple[Any, ...]", kwargs: "dict[str, Any]") -> bool:
    return read(args, kwargs, "shifts") == -1 and read(args, kwargs, "dims") in (-1, tensor.dim() - 1)


def _size(group: "Any") -> int:
    return 1 if group is None else group.size()


def _size_rank(group: "Any") -> "tuple[int, int]":
    size = _size(group)
    return (size, group.rank()) if size > 1 else (1, 0)


FIX = PackedRollFix()
