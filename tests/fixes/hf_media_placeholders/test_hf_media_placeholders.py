"""hf-media-placeholders on the installed transformers: the tiny processor's template (the seed's rule)
renders one placeholder per structured image with the fix, whatever the text writes; stock renders the
literal copies."""

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mtp_overlay
from mtp_overlay import OverlayError
from mtp_overlay.bed.steps import media_placeholders as mp
from mtp_overlay.bed.fixes import reproduce

FIX = "hf-media-placeholders"


def test_the_stock_path_shows_the_bug():
    shows, evidence = reproduce(FIX)
    assert shows, evidence
    assert "2 <image>" in evidence


def test_one_image_two_literals_renders_two_stock_one_fixed(processor):
    with mp.fix_off(FIX):
        stock = mp.hf_placeholders(processor, mp.conversation(1, mp.SEED_TEXTS))
    fixed = mp.hf_placeholders(processor, mp.conversation(1, mp.SEED_TEXTS))
    assert (stock, fixed) == (2, 1)
    prompt = processor.apply_chat_template(mp.conversation(1, mp.SEED_TEXTS))
    assert prompt.count("<image>") == 1 and "what is in this" in prompt and "picture ?" in prompt  # the words stay


def test_a_placeholder_joined_by_a_removal_is_removed_too(processor):
    """"<<image>image>" holds one literal, and removing it leaves another: the structured items still decide."""
    with mp.fix_off(FIX):
        stock = mp.hf_placeholders(processor, mp.conversation(2, ["<<image>image> compare"]))
    assert (stock, mp.hf_placeholders(processor, mp.conversation(2, ["<<image>image> compare"]))) == (1, 2)


def test_text_only_messages_are_untouched(processor):
    """A message without structured media may talk about "<image>": the same render, fix on or off."""
    messages = [{"role": "user", "content": "what does <image> mean ?"},
                {"role": "user", "content": [{"type": "text", "text": "and <image> here ?"}]}]
    with mp.fix_off(FIX):
        stock = processor.apply_chat_template(copy.deepcopy(messages))
    assert processor.apply_chat_template(copy.deepcopy(messages)) == stock
    assert stock.count("<image>") == 2


def test_batch_and_caller_data(processor):
    """Each conversation of a batch is fixed; the caller's messages stay as they were."""
    batch = [mp.conversation(1, mp.SEED_TEXTS), [{"role": "user", "content": "plain <image>"}]]
    before = json.dumps(batch)
    first, second = processor.apply_chat_template(batch)
    assert (first.count("<image>"), second.count("<image>")) == (1, 1)
    texts = [part["text"] for part in batch[0][0]["content"] if part["type"] == "text"]
    assert texts == mp.SEED_TEXTS and json.loads(before)[1] == batch[1]


def test_strict_refuses_naming_message_placeholder_and_counts(processor):
    messages = [{"role": "system", "content": "be brief"}] + mp.conversation(1, mp.SEED_TEXTS)
    mtp_overlay.install(only=[FIX], strict=True)
    try:
        with pytest.raises(OverlayError, match=r"message 1 writes the media placeholder '<image>' 2 time\(s\) .*"
                                               r"beside 1 image structured item"):
            processor.apply_chat_template(messages)
        batch = [[{"role": "user", "content": "x"}], mp.conversation(2, ["<image>"])]
        with pytest.raises(OverlayError, match=r"conversation 1, message 0 .* 1 time\(s\) in its text beside 2 image"):
            processor.apply_chat_template(batch)
        assert processor.apply_chat_template([{"role": "user", "content": "<image>"}]).count("<image>") == 1
    finally:
        mtp_overlay.install(only=[FIX], strict=False)


def test_status_counts_changed_messages(processor):
    [row] = mtp_overlay.status([FIX])
    before = row.details.get("messages_changed", 0)
    processor.apply_chat_template(mp.conversation(1, mp.SEED_TEXTS) + mp.conversation(2, ["<image> x"])
                                  + mp.conversation(1, ["no literal"]))
    [row] = mtp_overlay.status([FIX])
    assert row.state == "installed" and row.details["messages_changed"] == before + 2
    assert "message(s) with structured media had literal media placeholders removed" in row.details["note"]


WORDS = st.sampled_from(["<image>", "what", "is", "<image><image>", "a<image>b", "picture", "?", "<imag", "e>",
                         "<<image>image>"])
TEXTS = st.lists(st.lists(WORDS, max_size=5).map(" ".join), max_size=3)
MESSAGES = st.lists(st.tuples(st.integers(0, 3), TEXTS), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(MESSAGES)
def test_with_the_fix_placeholders_equal_structured_items(processor, shape):
    """Any mix of structured images and literal placeholders: with the fix each message with images
    renders exactly one placeholder per image; a message without keeps its literals. Stock renders
    what the seed's rule says (the stand-in template held to its rule)."""
    def messages():
        return [message for images, texts in shape for message in mp.conversation(images, texts)]

    expected = sum(images if images else sum(t.count("<image>") for t in texts) for images, texts in shape)
    assert mp.hf_placeholders(processor, messages()) == expected
    with mp.fix_off(FIX):
        assert mp.hf_placeholders(processor, messages()) == mp.seed_rule_placeholders(messages())


def test_placeholders_are_the_processors_or_its_tokenizers():
    from types import SimpleNamespace

    from mtp_overlay.fixes.media_placeholders import processor_placeholders

    tokenizer = SimpleNamespace(image_token="<img>", video_token="<vid>")
    assert processor_placeholders(SimpleNamespace(image_token="<image>", audio_token=None, tokenizer=tokenizer)) == {
        "image": "<image>", "video": "<vid>"}
