"""The parallel layout a user plans, checked the way megatron-core will check it, and its smaller layouts.

Pure Python: nothing upstream is imported. Errors name the command-line flag (``--tp``, ``--cp`` ...),
which is also the API's argument name.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Layout:
    """Tensor, context, expert (and expert-tensor) parallel sizes, pipeline stages, sequence parallelism.

    ``etp`` None is megatron-core's default (the TP size). ``world_size``: the ranks it runs on, the
    smallest number of ranks that holds it (megatron-core lays TP x CP x PP and ETP x EP x PP over the
    same ranks, ``parallel_state.py:874-883``) unless a larger one is given; the rest is data parallel.
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    pp: int = 1
    sp: bool = False
    world: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "ep", "pp"):
            _check_size(getattr(self, name), f"--{name}")
        if self.etp is not None:
            _check_size(self.etp, "--etp")
        if not isinstance(self.sp, bool):
            raise ValueError(f"--sp must be True or False, got {self.sp!r}")
        if self.sp and self.tp == 1:
            raise ValueError("--sp (sequence parallelism) needs --tp > 1: it splits the sequence over the TP ranks")
        if self.world is not None:
            _check_size(self.world, "--world-size")
            for what, size in (("TP x CP x PP", self.tp * self.cp * self.pp),
                               ("ETP x EP x PP", self.expert_tp * self.ep * self.pp)):
                if self.world % size:
                    raise ValueError(
                        f"--world-size {self.world} cannot hold {self.name}: megatron-core needs a world size that "
                        f"is a multiple of {what} = {size}"
                    )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        if self.world is not None:
            return self.world
        dense, expert = self.tp * self.cp * self.pp, self.expert_tp * self.ep * self.pp
        return dense * expert // math.gcd(dense, expert)

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def name(self) -> str:
        """``"TP2xCP2+SP"``, ``"CP2"``, ``"TP2xEP2+SP"``, ``"TP1"`` (ETP named whenever it is set:
        ``"TP1xETP2"``, ``"TP2xEP2xETP1+SP"``)."""
        parts = [f"{key.upper()}{getattr(self, key)}" for key in ("tp", "cp", "ep", "pp") if getattr(self, key) > 1]
        if self.etp is not None:
            parts = (parts or ["TP1"]) + [f"ETP{self.etp}"]
        return "x".join(parts or ["TP1"]) + ("+SP" if self.sp else "")

    def as_dict(self) -> dict[str, object]:
        """What the engine reads: tp, cp, pp, ep, etp, sp."""
        return dict(tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, etp=self.etp, sp=self.sp)

    def smaller(self) -> list[Layout]:
        """Every layout with each size a divisor of this one's (sequence parallelism kept where TP > 1),
        this one left out, smallest world size first: where a difference may show with fewer ranks."""
        found = set()
        itself = dataclasses.replace(self, world=None)
        for tp in _divisors(self.tp):
            for cp in _divisors(self.cp):
                for pp in _divisors(self.pp):
                    for ep in _divisors(self.ep):
                        etp = None if self.etp is None or ep == 1 else min(self.etp, tp)
                        candidate = Layout(tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, sp=self.sp and tp > 1)
                        if candidate != itself:
                            found.add(candidate)
        return sorted(found, key=lambda layout: (layout.world_size, layout.tp * layout.cp, layout.name))


def _divisors(value: int) -> list[int]:
    return [size for size in range(1, value + 1) if value % size == 0]


def _check_size(value: object, flag: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")
