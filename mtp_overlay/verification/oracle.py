"""The position oracle: which (position, target) pairs each MTP depth may train, from tokens and mask alone.

Never computed by running megatron-core: a defect that the packed and the unpacked path share (so
the numeric reference has it too) still shows here.

A sequence of ``L`` inputs has tokens ``t[0] .. t[L]`` (``t[L]`` is the label after the last input)
and a prompt ``p``: token ``t[k]`` is a response token when ``k >= p``. The main head at position
``i`` predicts ``t[i + 1]``; MTP depth ``d`` (1, 2, ...) predicts ``t[i + d + 1]`` (DeepSeek-V3's
sequential MTP, megatron-core's ``process_mtp_loss``: labels rolled once per depth). It may train that
pair when the target is a response token and the trainer has it:

* RL (``forward="rl"``: no labels, megatron-core derives them from the input ids): the target must be
  an input, ``i + d + 1 <= L - 1``;
* SFT (``forward="sft"``: the labels ``t[1:]`` are passed): up to the last label, ``i + d + 1 <= L``.

Pairs are ``(sequence, position, target)``: the sequence's index in the sample, the position within
the sequence (a padding slot has a position at or past the sequence's length), the target token id.
"""

from __future__ import annotations

from .data import Sequence

FORWARDS = ("rl", "sft")
Triple = tuple[int, int, int]


def allowed(sequences: tuple[Sequence, ...] | list[Sequence], depth: int, forward: str) -> set[Triple]:
    """Every (sequence, position, target) MTP depth ``depth`` may train (module docstring)."""
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive integer (1 is the first MTP depth), got {depth!r}")
    last = {"rl": 1, "sft": 0}[forward]  # how far before t[L] the last usable target sits
    pairs = set()
    for index, sequence in enumerate(sequences):
        for position in range(sequence.length):
            target = position + depth + 1
            if target <= sequence.length - last and target >= sequence.prompt:
                pairs.add((index, position, sequence.tokens[target]))
    return pairs


def compare(trained: set[Triple], expected: set[Triple]) -> tuple[list[Triple], list[Triple]]:
    """(wrong: trained but not allowed, missed: allowed but not trained), each sorted."""
    return sorted(trained - expected), sorted(expected - trained)
