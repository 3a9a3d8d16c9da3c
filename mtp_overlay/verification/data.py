"""The sequences verify trains on: the shape of the user's data at CPU size, with tokens drawn to be told apart.

A data sample is a JSONL file, one sequence per line: ``{"tokens": <int>, "prompt": <int>}``, the
sequence's token count and how many of its leading tokens are prompt (the loss mask's zeros; default
0). Without one, `DEFAULT`: four sequences of 9, 12, 6 and 4 tokens (the parity table's packed row:
no padding multiple above 2 divides them all) with prompts of 4, 0, 6 and 1: a prompt longer than the
MTP depths reach (so a head trained on prompt tokens shows), none, all of it (a filtered sample:
nothing may train), one.

`shrink_sample` keeps at most `MAX_SEQUENCES` of them (spread over the sorted lengths, plus one with
no response and one with no prompt if the sample has such sequences), scales their lengths so the
longest has `MAX_LENGTH` tokens, and keeps each prompt's share of its sequence (a prompt of none, of
everything, or of some but not all stays so). `draw` gives each sequence distinct token ids (1 up
to the vocabulary; 0 is the packing's padding id), so a target shifted by any offset is another id
and the position oracle (`oracle`) sees it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

DEFAULT = ((9, 4), (12, 0), (6, 6), (4, 1))  # (tokens, prompt) per sequence
MAX_SEQUENCES = 6
MAX_LENGTH = 24


@dataclasses.dataclass(frozen=True)
class Sequence:
    """One sequence: its text (``len(tokens) - 1`` inputs and the label after the last) and its prompt
    (the tokens before index ``prompt`` are not trained; from it on they are the response)."""

    tokens: tuple[int, ...]
    prompt: int

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
                    sequences=[dict(tokens=s.length, prompt=s.prompt, ids=list(s.tokens)) for s in self.sequences])


def read_sample(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """(tokens, prompt) of every line of a JSONL data sample; ValueError naming ``--data`` and the line."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as error:
        raise ValueError(f"--data {name}: {error.strerror or error}") from None
    pairs = []
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
        tokens, prompt = record["tokens"], record.get("prompt", 0)
        for key, value in (("tokens", tokens), ("prompt", prompt)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "tokens" else 0):
                kind = "positive" if key == "tokens" else "non-negative"
                raise ValueError(f"--data {name}:{number}: {key} must be a {kind} integer, got {value!r}")
        if prompt > tokens:
            raise ValueError(f"--data {name}:{number}: prompt {prompt} is longer than the sequence's {tokens} tokens")
        pairs.append((tokens, prompt))
    if not pairs:
        raise ValueError(f"--data {name}: no sequences in it")
    return pairs


def shrink_sample(pairs: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], str]:
    """At most `MAX_SEQUENCES` (tokens, prompt) pairs, the longest `MAX_LENGTH` tokens (module
    docstring), and what was done, in words."""
    count, longest = len(pairs), max(tokens for tokens, _ in pairs)
    picked = list(range(count))
    if count > MAX_SEQUENCES:
        order = sorted(range(count), key=lambda index: (pairs[index][0], index))
        special = [next((i for i in range(count) if pairs[i][1] == pairs[i][0]), None),
                   next((i for i in range(count) if pairs[i][1] == 0), None)]
        chosen = {index for index in special if index is not None}
        spread = MAX_SEQUENCES - len(chosen)
        for step in range(spread):
            chosen.add(order[round(step * (count - 1) / max(spread - 1, 1))])
        picked = sorted(chosen)[:MAX_SEQUENCES]
    scale = min(1.0, MAX_LENGTH / max(pairs[index][0] for index in picked))
    shrunk = []
    for index in picked:
        tokens, prompt = pairs[index]
        new = max(1, round(tokens * scale))
        if prompt == 0 or prompt == tokens:
            new_prompt = 0 if prompt == 0 else new
        else:
            new_prompt = min(max(1, round(prompt * scale)), max(new - 1, 1))
        shrunk.append((new, new_prompt))
    notes = []
    if len(picked) < count:
        notes.append(f"{len(picked)} of {count} sequences (spread over the lengths)")
    if scale < 1:
        notes.append(f"lengths scaled by {scale:.3g} (longest {longest} -> {MAX_LENGTH} tokens), prompt shares kept")
    return shrunk, "; ".join(notes) or "as given"


def draw(pairs: list[tuple[int, int]], vocab: int, *, seed: int = 0) -> tuple[Sequence, ...]:
    """Sequences of ``pairs`` (tokens, prompt) with distinct token ids from 1 to ``vocab - 1`` each."""
    generator = random.Random(seed)
    longest = max(tokens for tokens, _ in pairs)
    if longest + 1 > vocab - 1:
        raise ValueError(f"a vocabulary of {vocab} ids cannot give a sequence of {longest} tokens distinct ids")
    return tuple(Sequence(tuple(generator.sample(range(1, vocab), tokens + 1)), prompt) for tokens, prompt in pairs)


def sample(path: str | os.PathLike[str] | None, vocab: int, *, seed: int = 0) -> Sample:
    """The `Sample` of a JSONL data sample at ``path`` (None: `DEFAULT`), shrunk and drawn."""
    if path is None:
        return Sample(draw(list(DEFAULT), vocab, seed=seed), "default (data.DEFAULT)", "as given")
    pairs, note = shrink_sample(read_sample(path))
    return Sample(draw(pairs, vocab, seed=seed), os.fspath(path), note)
