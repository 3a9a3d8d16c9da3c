"""The sequences verify trains on: the shape of the user's data at CPU size, with tokens drawn to be told apart.

A data sample is a JSONL file, one sequence per line: ``{"tokens": <int>, "prompt": <int>}``, the
sequence's token count and how many of its leading tokens are prompt (the loss mask's zeros; default
0); for a VL / Omni config also ``"images": [<int>, ...]``, the positions (among the tokens) of its
image placeholders. Without one, `DEFAULT`: four sequences of 9, 12, 6 and 4 tokens (the parity
table's packed row: no padding multiple above 2 divides them all) with prompts of 4, 0, 6 and 1: a
prompt longer than the MTP depths reach (so a head trained on prompt tokens shows), none, all of it (a
filtered sample: nothing may train), one; for a VL / Omni config with the images of `DEFAULT_IMAGES`:
one in a prompt, two in a row in a response (the labels before and between them are no targets), one
in a filtered sequence, one as the last input.

`shrink_sample` keeps at most `MAX_SEQUENCES` of them (spread over the sorted lengths, plus one with
no response and one with no prompt if the sample has such sequences), scales their lengths so the
longest has `MAX_LENGTH` tokens, and keeps each prompt's share of its sequence (a prompt of none, of
everything, or of some but not all stays so: a sequence with a prompt and a response keeps at
least one token of each, whatever the ratio of the lengths). `draw` gives each sequence distinct
token ids (1 up to the vocabulary; 0 is the packing's padding id; none of the ``reserved`` ones, the
model's image and sound tokens), so a target shifted by any offset is another id and the position
oracle (`oracle`) sees it; an image placeholder's token is `IMAGE` (the engine puts the built model's
image token there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import NamedTuple

from .inputs import not_utf8

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

DEFAULT = ((9, 4), (12, 0), (6, 6), (4, 1))  # (tokens, prompt) per sequence
DEFAULT_IMAGES = ((2,), (5, 6), (0,), (3,))  # image placeholder positions per sequence of DEFAULT (VL / Omni)
IMAGE = -1  # the token of an image placeholder in a Sequence
MAX_SEQUENCES = 6
MAX_LENGTH = 24


@dataclasses.dataclass(frozen=True)
class Sequence:
    """One sequence: its text (``len(tokens) - 1`` inputs and the label after the last), its prompt
    (the tokens before index ``prompt`` are not trained; from it on they are the response) and the
    positions of its image placeholders (their token is `IMAGE`; each is an image's embeddings in the
    model's combined sequence)."""

    tokens: tuple[int, ...]
    prompt: int
    images: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        return len(self.tokens) - 1


@dataclasses.dataclass(frozen=True)
class Sample:
    """The sequences verify runs, where they come from, and what was done to them."""

    sequences: tuple[Sequence, ...]
    source: str
    note: str

    def as_dict(self) -> dict[str, object]:
        return dict(source=self.source, note=self.note,
                    sequences=[dict(tokens=s.length, prompt=s.prompt, ids=list(s.tokens), images=list(s.images))
                               for s in self.sequences])


class Shape(NamedTuple):
    """One line of a data sample: token count, prompt length, image placeholder positions."""

    tokens: int
    prompt: int
    images: tuple[int, ...] = ()


def read_sample(path: str | os.PathLike[str]) -> list[Shape]:
    """The `Shape` of every line of a JSONL data sample; ValueError naming ``--data`` and the line."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as error:
        raise ValueError(f"--data {name}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"--data {name}: {not_utf8(error)} (a data sample is UTF-8 JSONL)") from None
    shapes = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--data {name}:{number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "tokens" not in record:
            raise ValueError(f'--data {name}:{number}: each line must be an object {{"tokens": N, "prompt": P}}, '
                             f"got {line.strip()[:80]!r}")
        tokens, prompt, images = record["tokens"], record.get("prompt", 0), record.get("images", [])
        for key, value in (("tokens", tokens), ("prompt", prompt)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "tokens" else 0):
                kind = "positive" if key == "tokens" else "non-negative"
                raise ValueError(f"--data {name}:{number}: {key} must be a {kind} integer, got {value!r}")
        if prompt > tokens:
            raise ValueError(f"--data {name}:{number}: prompt {prompt} is longer than the sequence's {tokens} tokens")
        if not isinstance(images, list) or any(not isinstance(at, int) or isinstance(at, bool) or not 0 <= at < tokens
                                               for at in images) or len(set(images)) != len(images):
            raise ValueError(f"--data {name}:{number}: images must be a list of distinct positions in [0, {tokens}) "
                             f"(the image placeholders among the tokens), got {images!r}")
        shapes.append(Shape(tokens, prompt, tuple(sorted(images))))
    if not shapes:
        raise ValueError(f"--data {name}: no sequences in it")
    return shapes


def shrink_sample(shapes: list[Shape]) -> tuple[list[Shape], str]:
    """At most `MAX_SEQUENCES` shapes, the longest `MAX_LENGTH` tokens (module docstring), image positions
    scaled with their sequence (distinct, inside it), and what was done, in words."""
    count, longest = len(shapes), max(shape.tokens for shape in shapes)
    picked = list(range(count))
    if count > MAX_SEQUENCES:
        order = sorted(range(count), key=lambda index: (shapes[index].tokens, index))
        special = [next((i for i in range(count) if shapes[i].prompt == shapes[i].tokens), None),
                   next((i for i in range(count) if shapes[i].prompt == 0), None)]
        chosen = {index for index in special if index is not None}
        spread = MAX_SEQUENCES - len(chosen)
        for step in range(spread):
            chosen.add(order[round(step * (count - 1) / max(spread - 1, 1))])
        picked = sorted(chosen)[:MAX_SEQUENCES]
    scale = min(1.0, MAX_LENGTH / max(shapes[index].tokens for index in picked))
    shrunk = []
    for index in picked:
        tokens, prompt, images = shapes[index]
        both = 0 < prompt < tokens  # a prompt and a response: at least one token of each stays
        new = max(2 if both else 1, round(tokens * scale))
        if not both:
            new_prompt = 0 if prompt == 0 else new
        else:
            new_prompt = min(max(1, round(prompt * scale)), new - 1)
        shrunk.append(Shape(new, new_prompt, tuple(sorted({min(round(at * scale), new - 1) for at in images}))))
    notes = []
    if len(picked) < count:
        notes.append(f"{len(picked)} of {count} sequences (spread over the lengths)")
    if scale < 1:
        notes.append(f"lengths scaled by {scale:.3g} (longest {longest} -> {MAX_LENGTH} tokens), prompt shares kept")
        if any(shapes[index].images for index in picked):
            notes.append("image positions scaled with their sequences")
    return shrunk, "; ".join(notes) or "as given"


def draw(shapes: Iterable[tuple[int, ...] | Shape], vocab: int, *, seed: int = 0,
         reserved: Iterable[int] = ()) -> tuple[Sequence, ...]:
    """Sequences of ``shapes`` ((tokens, prompt) pairs or `Shape`) with distinct token ids from 1 to
    ``vocab - 1`` each, none of ``reserved``; `IMAGE` at each image placeholder."""
    generator = random.Random(seed)
    lines = [Shape(*shape) for shape in shapes]
    ids = [token for token in range(1, vocab) if token not in set(reserved)]
    longest = max(line.tokens for line in lines)
    if longest + 1 > len(ids):
        raise ValueError(f"a vocabulary of {vocab} ids ({len(ids)} of them free) cannot give a sequence of "
                         f"{longest} tokens distinct ids")
    drawn = []
    for line in lines:
        tokens = generator.sample(ids, line.tokens + 1)
        for at in line.images:
            tokens[at] = IMAGE
        drawn.append(Sequence(tuple(tokens), line.prompt, tuple(line.images)))
    return tuple(drawn)


def sample(path: str | os.PathLike[str] | None, vocab: int, *, seed: int = 0, images: bool = False,
           reserved: Iterable[int] = ()) -> Sample:
    """The `Sample` of a JSONL data sample at ``path`` (None: `DEFAULT`, with `DEFAULT_IMAGES` when
    ``images``), shrunk and drawn (`draw`: ``reserved`` ids kept out of the text). ValueError naming
    ``--data`` for image placeholders in the sample of a config without a vision tower."""
    if path is None:
        shapes = [Shape(tokens, prompt, at if images else ()) for (tokens, prompt), at in zip(DEFAULT, DEFAULT_IMAGES)]
        return Sample(draw(shapes, vocab, seed=seed, reserved=reserved), "default (data.DEFAULT)", "as given")
    read = read_sample(path)
    if not images and any(shape.images for shape in read):
        raise ValueError(f"--data {os.fspath(path)}: the sample has image placeholders, but the config has no vision "
                         "tower")
    shapes, note = shrink_sample(read)
    return Sample(draw(shapes, vocab, seed=seed, reserved=reserved), os.fspath(path), note)
