"""`mtp-overlay lint-media` on the tiny processor: the mismatching rows of a mixed file (exit 1), a clean
file (exit 0), bad input named by its line (exit 2), by source, progress and JSON."""

import json

import pytest

from mtp_overlay.cli import main
from mtp_overlay.fixes.hf_media_placeholders import lint

IMAGE = {"type": "image", "url": "never-loaded.png"}  # lint renders text only: no image is read


def row(content, source=None):
    found = {"messages": [{"role": "user", "content": content}]}
    return found if source is None else {**found, "source": source}


MIXED = [
    row([IMAGE, {"type": "text", "text": "what is it ?"}], "coco"),  # clean
    row([IMAGE, {"type": "text", "text": "<image> a <image> b"}], "mmpr"),  # 2 for 1, the fix: 1
    row([IMAGE, IMAGE, {"type": "text", "text": "<image> compare"}], "mmpr"),  # 1 for 2, the fix: 2
    row("a text-only row", "coco"),  # clean
    row([IMAGE, {"type": "text", "text": "<image>"}], "coco"),  # the literal stands for the one image: clean
    row("what does <image> mean ?", "nlvr2"),  # a placeholder token with no image: flagged, the fix leaves it
]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_mixed_file_flags_exactly_the_mismatching_rows(tmp_path, processor_folder, capsys):
    data = write(tmp_path / "mixed.jsonl", MIXED)
    assert main(["lint-media", data, "--processor", str(processor_folder), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 6
    assert [(r["line"], r["structured"], r["stock"], r["fixed"], r["fixed_matches"]) for r in report["mismatches"]] == [
        (2, {"image": 1}, {"image": 2}, {"image": 1}, True),
        (3, {"image": 2}, {"image": 1}, {"image": 2}, True),
        (6, {}, {"image": 1}, {"image": 1}, False),
    ]
    assert report["sources"] == {"coco": {"rows": 3, "mismatches": 0}, "mmpr": {"rows": 2, "mismatches": 2},
                                 "nlvr2": {"rows": 1, "mismatches": 1}}
    assert main(["lint-media", data, "--processor", str(processor_folder)]) == 1
    text = capsys.readouterr().out
    assert text.startswith("3 of 6 row(s)") and "line 2 [mmpr]: image: 1 structured, 2 placeholder token(s) stock, " \
        "1 with the fix" in text and "mmpr: 2 of 2 row(s)" in text


def test_clean_file_exits_0(tmp_path, processor_folder, capsys):
    clean = [MIXED[0], MIXED[3], MIXED[4]]
    assert main(["lint-media", write(tmp_path / "clean.jsonl", clean), "--processor", str(processor_folder)]) == 0
    assert capsys.readouterr().out.startswith("0 of 3 row(s)")


@pytest.mark.parametrize("bad, says", [
    ("{not json", "not JSON"),
    ('{"messages": []}', 'expected a JSON object whose "messages" is a non-empty list'),
    ('["a list"]', 'expected a JSON object'),
    ('{"messages": ["hi"]}', "expected a JSON object"),
])
def test_malformed_line_is_named_exit_2(tmp_path, processor_folder, capsys, bad, says):
    data = write(tmp_path / "bad.jsonl", [MIXED[0], "", bad, MIXED[1]])
    assert main(["lint-media", data, "--processor", str(processor_folder)]) == 2
    error = capsys.readouterr().err
    assert f"{data}:3: {says}" in error


def test_a_line_not_utf8_or_not_renderable_is_named_exit_2(tmp_path, processor_folder, capsys):
    data = tmp_path / "latin1.jsonl"
    latin1 = json.dumps(row("caf\u00e9"), ensure_ascii=False).encode("latin-1")
    data.write_bytes(json.dumps(MIXED[0]).encode() + b"\n" + latin1 + b"\n")
    assert main(["lint-media", str(data), "--processor", str(processor_folder)]) == 2
    assert f"{data}:2: not UTF-8" in capsys.readouterr().err
    unrenderable = write(tmp_path / "five.jsonl", [MIXED[0], {"messages": [{"role": "user", "content": 5}]}])
    assert main(["lint-media", unrenderable, "--processor", str(processor_folder)]) == 2
    assert f"{unrenderable}:2: the processor's chat template cannot render this row (TypeError" in capsys.readouterr().err


def test_bad_arguments_exit_2(tmp_path, processor_folder, capsys):
    data = write(tmp_path / "d.jsonl", [MIXED[0]])
    assert main(["lint-media", str(tmp_path / "missing.jsonl"), "--processor", str(processor_folder)]) == 2
    assert "DATA must be a JSONL file" in capsys.readouterr().err
    assert main(["lint-media", data, "--processor", str(tmp_path / "nowhere")]) == 2
    assert "--processor must be a processor folder" in capsys.readouterr().err


def test_progress_on_stderr(tmp_path, processor_folder, capsys, monkeypatch):
    monkeypatch.setattr(lint, "PROGRESS_EVERY", 2)
    assert main(["lint-media", write(tmp_path / "long.jsonl", MIXED[:5]), "--processor", str(processor_folder)]) == 1
    assert capsys.readouterr().err.splitlines() == ["mtp-overlay lint-media: 2 rows", "mtp-overlay lint-media: 4 rows"]
