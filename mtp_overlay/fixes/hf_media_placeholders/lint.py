"""`lint_media`: which rows of a chat dataset render more (or fewer) media placeholders than they carry
structured media items, with the processor's own chat template, stock and with hf-media-placeholders.

CPU only, no weights: each row's ``messages`` go through the processor's ``apply_chat_template`` (text,
not tokenized: no image is loaded), the text through its tokenizer, and the placeholder tokens (the
processor's ``image_token`` / ``video_token`` / ``audio_token``) are counted against the row's structured
items of each modality. The face of ``mtp-overlay lint-media``.
"""

import json
from collections import Counter
from pathlib import Path

from ...calls import original
from ..media_placeholders import MEDIA_PART_TYPES, processor_placeholders
from . import sanitized

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

PROGRESS_EVERY = 1000  # rows between two progress calls


class Row:
    """One row whose placeholder tokens differ from its structured media (on the stock render)."""

    __slots__ = ("line", "source", "structured", "stock", "fixed")

    def __init__(self, line: int, source: "str | None", structured: "dict[str, int]", stock: "dict[str, int]",
                 fixed: "dict[str, int]") -> None:
        self.line, self.source, self.structured, self.stock, self.fixed = line, source, structured, stock, fixed

    @property
    def fixed_matches(self) -> bool:
        return self.fixed == self.structured

    def as_dict(self) -> "dict[str, Any]":
        return {**{name: getattr(self, name) for name in self.__slots__}, "fixed_matches": self.fixed_matches}

    def text(self) -> str:
        where = f"line {self.line}" + (f" [{self.source}]" if self.source is not None else "")
        counts = "; ".join(f"{modality}: {self.structured.get(modality, 0)} structured, "
                           f"{self.stock.get(modality, 0)} placeholder token(s) stock, "
                           f"{self.fixed.get(modality, 0)} with the fix" for modality in sorted(
                               set(self.structured) | set(self.stock) | set(self.fixed)))
        return f"{where}: {counts}" + ("" if self.fixed_matches else " (the fix leaves it: no structured media)")


class LintReport:
    """What `lint_media` found: ``rows`` read, the mismatching ``mismatches``, ``sources`` (source ->
    [rows, mismatches], when the rows carry a ``source`` field)."""

    def __init__(self, data: str, processor: str) -> None:
        self.data, self.processor = data, processor
        self.rows = 0
        self.mismatches: "list[Row]" = []
        self.sources: "dict[str, list[int]]" = {}

    @property
    def exit_code(self) -> int:
        return 1 if self.mismatches else 0

    def as_dict(self) -> "dict[str, Any]":
        return {"data": self.data, "processor": self.processor, "rows": self.rows,
                "mismatches": [row.as_dict() for row in self.mismatches],
                "sources": {source: {"rows": rows, "mismatches": bad} for source, (rows, bad) in self.sources.items()},
                "exit_code": self.exit_code}

    def text(self) -> str:
        lines = [f"{len(self.mismatches)} of {self.rows} row(s) of {self.data}: placeholder tokens differ from the "
                 f"structured media count (the processor's template, stock)"]
        lines += [f"  {row.text()}" for row in self.mismatches]
        if self.sources:
            lines.append("by source:")
            lines += [f"  {source}: {bad} of {rows} row(s)" for source, (rows, bad) in sorted(self.sources.items())]
        return "\n".join(lines)


def rows_of(path: Path) -> "Iterator[tuple[int, dict[str, Any]]]":
    """``(1-based line number, row)`` of each non-blank line; ValueError naming the line when it is not
    a JSON object whose ``messages`` is a non-empty list of messages (objects with a ``role``)."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{number}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
            messages = row.get("messages") if isinstance(row, dict) else None
            if not (isinstance(messages, list) and messages
                    and all(isinstance(m, dict) and "role" in m for m in messages)):
                raise ValueError(f"{path}:{number}: expected a JSON object whose \"messages\" is a non-empty list of "
                                 f"messages ({{\"role\": ..., \"content\": ...}}), got {line.strip()[:80]!r}")
            yield number, row


def structured_counts(messages: "list[dict[str, Any]]") -> "dict[str, int]":
    counts: "Counter[str]" = Counter()
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                counts[MEDIA_PART_TYPES[part["type"]]] += 1
    return dict(counts)


def lint_media(data: "str | Path", processor: "str | Path",
               progress: "Callable[[int], None] | None" = None) -> LintReport:
    """Lint the JSONL file ``data`` with the processor folder ``processor`` (tokenizer, chat template,
    processor config; loaded with ``AutoProcessor``, offline). ``progress(rows)`` is called every
    `PROGRESS_EVERY` rows. ValueError naming the argument (or the line) for bad input."""
    from transformers import AutoProcessor
    from transformers.processing_utils import ProcessorMixin

    data, folder = Path(data), Path(processor)
    if not data.is_file():
        raise ValueError(f"DATA must be a JSONL file, got {str(data)!r}")
    if not folder.is_dir():
        raise ValueError(f"--processor must be a processor folder (tokenizer, chat template, processor config), "
                         f"got {str(folder)!r}")
    loaded = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    if not isinstance(loaded, ProcessorMixin) or getattr(loaded, "chat_template", None) is None:
        raise ValueError(f"--processor {str(folder)!r} holds no multimodal processor with a chat template "
                         f"(AutoProcessor loaded a {type(loaded).__name__})")
    tokens = processor_placeholders(loaded)
    ids = {modality: loaded.tokenizer.convert_tokens_to_ids(token) for modality, token in tokens.items()}
    render = original(ProcessorMixin.apply_chat_template)  # the stock render, hooked or not

    def placeholder_tokens(number: int, messages: "list[dict[str, Any]]") -> "dict[str, int]":
        try:
            text = render(loaded, json.loads(json.dumps(messages)))  # a copy: the processor edits parts in place
        except Exception as exc:  # the template's own error (a content it cannot iterate, raise_exception)
            raise ValueError(f"{data}:{number}: the processor's chat template cannot render this row "
                             f"({type(exc).__name__}: {exc})") from None
        found = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {modality: count for modality, token_id in ids.items() if (count := found.count(token_id))}

    report = LintReport(str(data), str(folder))
    for number, row in rows_of(data):
        messages, source = row["messages"], row.get("source")
        structured = {m: n for m, n in structured_counts(messages).items() if m in tokens}
        stock = placeholder_tokens(number, messages)
        bad = stock != structured
        if bad:
            fixed = placeholder_tokens(number, sanitized(messages, list(tokens.values()), strict=False)[0])
            report.mismatches.append(Row(number, None if source is None else str(source), structured, stock, fixed))
        if source is not None:
            tally = report.sources.setdefault(str(source), [0, 0])
            tally[0] += 1
            tally[1] += bad
        report.rows += 1
        if progress is not None and report.rows % PROGRESS_EVERY == 0:
            progress(report.rows)
    return report
