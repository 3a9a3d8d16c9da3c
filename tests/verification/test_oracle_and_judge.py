"""The position oracle against two independent derivations, the data sample, and the judge on engine
answers built here (no ranks; ~3 s): a defect the numbers share with the reference is still caught by
the positions, a fix is needed exactly when the overlay without it differs, and a difference the
overlay leaves is shown on the smallest layout of the search that has it."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_overlay.verification import data, oracle, report
from mtp_overlay.verification.layout import Layout

PROPERTY = settings(max_examples=150, deadline=None)


def rolled_pairs(sequence, depth, forward):
    """What megatron-core's BSHD MTP loss trains, simulated with list rolls (``roll_tensor`` at CP1: shift
    left, zero the rolled-in slot; ``process_mtp_loss``: RL labels and mask rolled once from the inputs,
    then both once per depth), with the mask of verify's convention (a target trains when it is a
    response token)."""
    tokens, prompt, length = list(sequence.tokens), sequence.prompt, sequence.length

    def roll(values):
        return values[1:] + [0]

    if forward == "rl":
        labels = roll(tokens[:length])
        mask = roll([int(k >= prompt) for k in range(length)])
    else:
        labels = tokens[1:]
        mask = [int(k + 1 >= prompt) for k in range(length)]
    for _ in range(depth):
        labels, mask = roll(labels), roll(mask)
    return {(position, labels[position]) for position in range(length) if mask[position]}


@st.composite
def samples(draw):
    pairs = draw(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20)), min_size=1, max_size=6))
    pairs = [(tokens, min(prompt, tokens)) for tokens, prompt in pairs]
    return data.draw(pairs, 128, seed=draw(st.integers(0, 1000)))


@PROPERTY
@given(samples(), st.integers(1, 3), st.sampled_from(oracle.FORWARDS))
def test_the_oracle_is_what_the_rolls_train_from_the_definition(sequences, depth, forward):
    expected = {(index, *pair) for index, sequence in enumerate(sequences)
                for pair in rolled_pairs(sequence, depth, forward)}
    assert oracle.allowed(sequences, depth, forward) == expected


@PROPERTY
@given(samples(), st.integers(1, 3))
def test_the_oracle_agrees_with_the_test_beds_expected_mtp(sequences, depth):
    """``bed.models.packed.expected_mtp`` (the packed tests' oracle, written independently) on the same
    texts and prompts, packed one after the other, RL convention, in sequence space."""
    from types import SimpleNamespace

    from mtp_overlay.bed.models.packed import expected_mtp

    lengths = [sequence.length for sequence in sequences]
    starts = [sum(lengths[:index]) for index in range(len(lengths) + 1)]
    row = SimpleNamespace(input_ids=torch.zeros(1, starts[-1]), cu_seqlens_padded=torch.tensor(starts),
                          texts=tuple(torch.tensor(s.tokens) for s in sequences),
                          prompts=tuple(s.prompt for s in sequences))
    weights, targets = expected_mtp(row, labels=False, depth=depth)
    found = {(index, slot - starts[index], int(targets[slot]))
             for index in range(len(sequences)) for slot in range(starts[index], starts[index] + lengths[index])
             if weights[slot]}
    assert oracle.allowed(sequences, depth, "rl") == found


def test_the_sample_keeps_its_shape_and_names_bad_lines(tmp_path):
    lines = [dict(tokens=4000, prompt=1000), dict(tokens=120, prompt=120), dict(tokens=800, prompt=0)]
    lines += [dict(tokens=100 * k, prompt=10 * k) for k in range(1, 9)]
    path = tmp_path / "sample.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    shapes, note = data.shrink_sample(data.read_sample(path))
    pairs = [(shape.tokens, shape.prompt) for shape in shapes]
    assert len(pairs) == data.MAX_SEQUENCES and max(tokens for tokens, _ in pairs) == data.MAX_LENGTH
    assert (data.MAX_LENGTH, round(1000 * data.MAX_LENGTH / 4000)) in pairs  # the longest, its prompt share kept
    assert any(prompt == tokens for tokens, prompt in pairs) and any(prompt == 0 for _, prompt in pairs)
    assert "6 of 11 sequences" in note
    sequences = data.draw(shapes, 128, seed=3)
    assert all(len(set(s.tokens)) == len(s.tokens) and 0 not in s.tokens for s in sequences)
    for text, message in (('{"tokens": 0}', "tokens must be a positive integer"), ("[3]", "each line must be"),
                          ('{"tokens": 3, "prompt": 4}', "prompt 4 is longer"), ("{", "not JSON")):
        path.write_text('{"tokens": 5}\n' + text + "\n")
        with pytest.raises(ValueError, match=f"--data {path}:2: {message}"):
            data.read_sample(path)


SEQUENCES = data.draw([(9, 2), (12, 0), (6, 3), (4, 1)], 128, seed=0)
FIXES = ["fix-a", "fix-b"]


def answer(case, layout, fixes, shift=0, error=None, mtp_relerr=0.0, depths=2):
    """An engine answer row whose MTP depths trained the oracle's pairs with each target ``shift``
    positions late (0: right), and the given gradient error."""
    if error:
        return dict(case=case, layout=layout, fixes=fixes, error=error)
    trained = []
    for depth in range(1, depths + 1):
        pairs = []
        for index, position, _ in sorted(oracle.allowed(SEQUENCES, depth, "rl")):
            tokens = SEQUENCES[index].tokens
            target = position + depth + 1 + shift
            pairs.append([index, position, tokens[target] if target < len(tokens) - 1 else 0])
        trained.append(pairs)
    return dict(case=case, layout=layout, fixes=fixes, error=None, trained=trained, lm_loss=4.8,
                mtp_losses=[4.9 * (1 + mtp_relerr)] * depths, grad_relerr={"mtp": mtp_relerr, "lm": 0.0},
                max_delta={"mtp": mtp_relerr, "lm": 0.0})


def judged(rows, reference=None):
    return [report.judge_case(row, data.Sample(SEQUENCES, "test", ""), reference, "rl", 2) for row in rows]


def make_report(reference_shift=0, overlay_shift=0, ablations=(), search=()):
    reference_row = answer("reference", "reference", [], shift=reference_shift)
    reference = judged([reference_row])[0]
    cases = judged([answer("stock", "CP2", [], shift=1), answer("overlay", "CP2", FIXES, shift=overlay_shift)]
                   + list(ablations), reference_row)
    searched = judged(list(search), reference_row)
    return report.Report(
        model="m", layout="TP2xCP2+SP", packing="thd-padded", shrunk={}, built={}, sample={}, reference=reference,
        stock=cases[0], overlay=cases[1], ablations=tuple(cases[2:]), search=tuple(searched),
        needs=report.needs(cases[1], cases[2:]), not_run=(), notes=(), phases=(), tolerance=report.TOLERANCE)


def test_the_overlay_equal_to_both_references_exits_0_and_names_what_each_fix_changed():
    found = make_report(ablations=[answer("overlay without fix-a", "CP2", ["fix-b"], mtp_relerr=0.2),
                                   answer("overlay without fix-b", "CP2", ["fix-a"])])
    assert found.ok and found.exit_code == 0 and not found.new_defects()
    assert found.stock.differs and found.stock.depths[0].wrong and found.stock.depths[0].missed
    assert [need.fix for need in found.needs] == ["fix-a"]
    assert "MTP gradient relerr 0.2" in found.needs[0].why
    assert "fix-a: without it" in found.text() and "OK:" in found.text()


def test_a_defect_the_reference_shares_is_caught_by_the_positions():
    """Packed and unpacked paths both train every target one position late: the numbers of the overlay
    equal the reference's (relerr 0), the oracle does not."""
    found = make_report(reference_shift=1, overlay_shift=1)
    assert found.overlay.grad_relerr["mtp"] == 0 and found.overlay.depths[0].loss_relerr == 0
    assert found.reference.differs and found.overlay.differs and found.exit_code == 1
    where = [place for place, _ in found.new_defects()]
    assert where[0].startswith("TP1, each sequence alone, unpacked")
    assert found.as_dict()["new_defects"][0]["problems"][0].startswith("depth 1: 22 wrong and 22 missed")


def test_an_uncured_difference_shows_on_the_smallest_layout_that_has_it():
    search = [answer("overlay", "TP1", FIXES), answer("overlay", "CP2", FIXES, shift=1),
              answer("overlay", "TP2+SP", FIXES)]
    rows = judged(search, answer("reference", "reference", []))
    for row, layout in zip(search, (Layout(), Layout(cp=2), Layout(tp=2, sp=True))):
        row["layout_name"] = layout.name
    found = make_report(overlay_shift=1, search=search,
                        ablations=[answer("overlay without fix-a", "CP2", ["fix-b"], shift=1)])
    assert [case.differs for case in rows] == [False, True, False]
    assert found.exit_code == 1 and found.new_defects()[0][0] == "CP2, thd-padded"
    assert found.needs == ()  # without fix-a the same difference: fix-a changes nothing here
    text = found.text()
    assert "POSSIBLE NEW DEFECT" in text and "smallest layout that shows it: CP2" in text
    assert "depth 1 wrong pairs: (0, 0, " in text


def test_a_refused_ablation_is_completed_by_the_case_without_the_fix_that_refused():
    refusal = "ValueError: packed_seq_params.cu_seqlens_q differs from cu_seqlens_q_padded"
    found = make_report(ablations=[answer("overlay without fix-a", "CP2", ["fix-b"], error=refusal),
                                   answer("overlay without fix-b", "CP2", ["fix-a"]),
                                   answer("overlay without fix-a and fix-b", "CP2", [], shift=1)])
    (need,) = found.needs
    assert need.fix == "fix-a" and need.deeper is not None
    assert need.why.startswith("refused: ValueError") and "without fix-b too: depth 1: 22 wrong" in need.why


def test_a_needed_fix_that_another_requires_names_it():
    """A fix another one requires (``Declaration.requires``) leaves that one out too: its row says so,
    in the text and the JSON. The link is read from the declarations (mtp-multimodal requires mtp-loss-mask)."""
    from mtp_overlay import verification

    links = verification.required_by(["mtp-loss-mask", "mtp-multimodal"])
    assert links == {"mtp-loss-mask": ("mtp-multimodal",), "mtp-multimodal": ()}
    cases = judged([answer("overlay", "CP2", FIXES), answer("overlay without fix-a", "CP2", ["fix-b"], shift=1),
                    answer("overlay without fix-b", "CP2", ["fix-a"], shift=1)], answer("reference", "reference", []))
    found = report.needs(cases[0], cases[1:], required_by={"fix-a": ("fix-b",), "fix-b": ()})
    assert [(need.fix, need.required_by) for need in found] == [("fix-a", ("fix-b",)), ("fix-b", ())]
    made = dataclasses.replace(make_report(), needs=found)
    assert "(fix-b requires it: without it that fix is not installed either)" in made.text()
    assert [need["required_by"] for need in made.as_dict()["needs"]] == [["fix-b"], []]


def test_each_pair_of_fixes_that_read_each_other_is_ablated_once():
    """mtp-loss-mask, mtp-packed-roll and mtp-cp-loss-scale each read the others' state: three pairs,
    each run once, whichever fix's declaration names the other."""
    from mtp_overlay import declarations
    from mtp_overlay.verification import ablations

    fixes = ["mtp-loss-mask", "mtp-packed-roll", "mtp-cp-loss-scale", "mtp-sp-scatter"]
    cases = ablations(fixes)
    singles = [label for label, _ in cases if " and " not in label]
    pairs = [frozenset(label.removeprefix("overlay without ").split(" and ")) for label, _ in cases if " and " in label]
    assert singles == [f"overlay without {fix}" for fix in fixes]
    assert len(pairs) == len(set(pairs)) == 3
    assert set(pairs) == {frozenset((a, b)) for a in fixes for b in declarations.load(a).reads if b in fixes}
    for label, kept in cases:
        assert not any(fix in label.split(" and ") or f"without {fix}" in label for fix in kept)


@PROPERTY
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 5000)), min_size=1, max_size=data.MAX_SEQUENCES))
def test_a_shrunk_sample_keeps_a_prompt_and_a_response_where_a_sequence_had_both(pairs):
    """Whatever the ratio of the lengths (4000 tokens beside 10), a sequence with a prompt and a response
    keeps at least one token of each; one all prompt or all response stays so."""
    shapes = [data.Shape(tokens, min(prompt, tokens)) for tokens, prompt in pairs]
    shrunk, _ = data.shrink_sample(shapes)
    assert len(shrunk) == len(shapes)
    for before, after in zip(shapes, shrunk):
        assert 1 <= after.tokens <= data.MAX_LENGTH
        assert (0 < after.prompt < after.tokens) == (0 < before.prompt < before.tokens)
        assert (after.prompt == 0) == (before.prompt == 0)
        assert (after.prompt == after.tokens) == (before.prompt == before.tokens)
    assert data.shrink_sample([data.Shape(4000, 1000), data.Shape(10, 3)])[0][1] == data.Shape(2, 1)


def test_a_layout_above_max_ranks_is_named_as_not_verified_and_what_ran_is_named_everywhere():
    """``--tp 2 --cp 2 --sp --max-ranks 1`` runs TP1: the table, the header, the verdict and the JSON name
    TP1 as what ran and say the asked TP2xCP2+SP was not verified; exit 0 is for what ran."""
    from saved_by_transformers import CONFIGS, OracleEngine

    from mtp_overlay import verification

    config = CONFIGS / "nemotron_h_like"
    engine = OracleEngine()
    found = verification.verify(config, tp=2, cp=2, sp=True, max_ranks=1, engine=engine)
    assert engine.layouts[1:] == [dict(tp=1, cp=1, pp=1, ep=1, etp=None, sp=False)]
    assert found.exit_code == 0 and found.layout == "TP1" and found.asked == "TP2xCP2+SP"
    text = found.text()
    assert text.startswith("== mtp-overlay verify: NemotronHForCausalLM, TP1 (asked: TP2xCP2+SP, not run")
    assert "| NemotronHForCausalLM | thd-padded | TP1 |" in text and "fixes this config needs at TP1:" in text
    assert text.rstrip().endswith("at TP1; the asked layout TP2xCP2+SP was NOT verified (above --max-ranks) (exit 0)")
    as_json = found.as_dict()
    assert (as_json["layout"], as_json["asked_layout"], as_json["asked_layout_verified"]) == ("TP1", "TP2xCP2+SP",
                                                                                            False)
    engine = OracleEngine()
    same = verification.verify(config, etp=2, ep=1, engine=engine)  # the expert TP size is named, never "TP1"
    assert same.asked is None and same.as_dict()["asked_layout_verified"] is True and "NOT verified" not in same.text()
    assert same.layout == "TP1xETP2" and engine.layouts[1]["etp"] == 2 and "| thd-padded | TP1xETP2 |" in same.text()
