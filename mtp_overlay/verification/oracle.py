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

A sequence with image placeholders (a VL / Omni model, SFT) is trained in the model's combined
sequence, where each placeholder is an image's ``n`` embeddings (`combined_slots`): positions are
combined slots. An input token's label is its next token, at the token's (last) slot; no label is a
target where the next token is an image, and an image slot is no label slot at all (LLaVAModel's
convention, ``llava_model.py:696-725``, derived here from the tokens alone). MTP depth ``d`` at slot
``q`` trains the label at slot ``q + d``: text token ``j`` (next token not an image, ``t[j + 1]`` a
response token) gives the pair ``(slot(j) - d, t[j + 1])`` where that slot exists.
"""

from __future__ import annotations

from .data import Sequence

FORWARDS = ("rl", "sft")
Triple = tuple[int, int, int]


def allowed(sequences: tuple[Sequence, ...] | list[Sequence], depth: int, forward: str,
            tokens_per_image: int | None = None) -> set[Triple]:
    """Every (sequence, position, target) MTP depth ``depth`` may train (module docstring); with
    ``tokens_per_image`` (a VL / Omni model, SFT only) in combined slots."""
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive integer (1 is the first MTP depth), got {depth!r}")
    if tokens_per_image is not None or any(sequence.images for sequence in sequences):
        return _combined(sequences, depth, forward, tokens_per_image)
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


def combined_slots(sequence: Sequence, tokens_per_image: int) -> list[int]:
    """The first combined slot of each input token of ``sequence`` (an image takes ``tokens_per_image``)."""
    starts, slot = [], 0
    for index in range(sequence.length):
        starts.append(slot)
        slot += tokens_per_image if index in sequence.images else 1
    return starts


def image_slot_targets(sequences: tuple[Sequence, ...] | list[Sequence], pairs: set[Triple] | list[Triple],
                       depth: int, tokens_per_image: int) -> list[Triple]:
    """The pairs whose label slot ``q + depth`` or predicted slot ``q + depth + 1`` is an image slot: an
    MTP head trained to predict, or on the label of, an image embedding (must be none)."""
    images: list[set[int]] = []
    for sequence in sequences:
        starts = combined_slots(sequence, tokens_per_image)
        images.append({starts[at] + k for at in sequence.images for k in range(tokens_per_image)})
    return sorted((index, position, target) for index, position, target in pairs
                  if {position + depth, position + depth + 1} & images[index])


def _combined(sequences: tuple[Sequence, ...] | list[Sequence], depth: int, forward: str,
              tokens_per_image: int | None) -> set[Triple]:
    if forward != "sft":
        raise ValueError("a sequence with images is judged with labels only (forward 'sft')")
    if not isinstance(tokens_per_image, int) or tokens_per_image < 1:
        raise ValueError(f"tokens_per_image must be a positive integer for sequences with images, got "
                         f"{tokens_per_image!r}")
    pairs = set()
    for index, sequence in enumerate(sequences):
        starts = combined_slots(sequence, tokens_per_image)
        for token in range(sequence.length):
            if token in sequence.images or token + 1 in sequence.images or token + 1 < sequence.prompt:
                continue
            if starts[token] >= depth:
                pairs.add((index, starts[token] - depth, sequence.tokens[token + 1]))
    return pairs
