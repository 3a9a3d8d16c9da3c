"""vllm-media-placeholders on the installed vLLM (the pin): the chat route (OpenAIServingChat on vLLM's
renderer, LLaVA's processor, the tiny processor folder with the seed's rule as its template) renders one
placeholder per structured image with the fix; stock renders the literal copies, binds one image and
leaves a stray image token, or crashes when the literals are fewer than the images. A tokenized prompt
(``prompt_token_ids`` with ``multi_modal_data``, vLLM's renderer as ``LLM.generate`` calls it) with more
placeholder tokens than images is refused with vLLM's own VLLMValidationError; stock binds the first."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mtp_overlay
from mtp_overlay import OverlayError
from mtp_overlay.bed.fixes import reproduce
from mtp_overlay.bed.steps import media_placeholders as mp
from mtp_overlay.bed.steps import vllm_serving as vs

FIX = "vllm-media-placeholders"


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return mp.VllmChat(mp.write_processor(tmp_path_factory.mktemp("media") / "processor"))


def test_the_stock_path_shows_the_bug():
    shows, evidence = reproduce(FIX)
    assert shows, evidence


def test_one_image_two_literals_stock_and_fixed(chat):
    image_tokens = chat.render(mp.conversation(1, ["what is in this picture ?"]))["image_tokens"]  # one image's
    with mp.fix_off(FIX):
        stock = chat.render(mp.conversation(1, mp.SEED_TEXTS))
    fixed = chat.render(mp.conversation(1, mp.SEED_TEXTS))
    assert stock == {"placeholders": 2, "items": 1, "image_tokens": image_tokens + 1}  # a stray <image> token
    assert fixed == {"placeholders": 1, "items": 1, "image_tokens": image_tokens}


def test_fewer_literals_than_images(chat):
    with mp.fix_off(FIX):
        stock = chat.render(mp.conversation(2, ["compare <image>"]))
    assert "Failed to apply prompt replacement for mm_items['image'][1]" in stock["error"]
    assert chat.render(mp.conversation(2, ["compare <image>"]))["items"] == 2


def test_text_only_untouched_and_counted(chat):
    text_only = [{"role": "user", "content": "what does <image> mean ?"}]
    with mp.fix_off(FIX):
        stock = chat.render(text_only)
    assert chat.render(text_only) == stock and stock["placeholders"] == 1
    [before] = mtp_overlay.status([FIX])
    chat.render(mp.conversation(1, mp.SEED_TEXTS) + mp.conversation(1, ["no literal"]))
    [after] = mtp_overlay.status([FIX])
    assert after.details["messages_changed"] == before.details.get("messages_changed", 0) + 1


TYPED = mp.TYPED_PROMPT  # 2 placeholders, the first typed, for 1 image
SURPLUS = (f"VLLMValidationError: mtp-overlay fix '{FIX}': the prompt holds 2 image placeholder(s) for 1 image "
           f"item(s)")


def test_tokenized_prompt_with_more_placeholders_than_images(chat):
    """Stock binds the image to the first placeholder (the typed one) and leaves the second in the prompt
    as text; with the fix vLLM's own validation error names the counts."""
    [(_, image_tokens)] = chat.render_tokens(["user", ":", "<image>", "what", "?"], 1)["images"]
    with mp.fix_off(FIX):
        stock = chat.render_tokens(TYPED, 1)
    at = TYPED.index("<image>")
    bound = [chat.placeholder_id] * image_tokens
    assert stock == {"ids": [vs.WORDS.index(w) for w in TYPED[:at]] + bound
                     + [vs.WORDS.index(w) for w in TYPED[at + 1:]], "images": [(at, image_tokens)]}
    [before] = mtp_overlay.status([FIX])
    assert chat.render_tokens(TYPED, 1)["error"].startswith(SURPLUS)
    [after] = mtp_overlay.status([FIX])
    assert after.details["prompts_refused"]["image"] == before.details.get("prompts_refused", {}).get("image", 0) + 1


@pytest.mark.parametrize("placeholders, images", [(1, 1), (2, 2), (1, 2)])
def test_tokenized_prompt_otherwise_as_stock(chat, placeholders, images):
    """Equal counts render as stock does; fewer placeholders than images keep stock's error."""
    words = ["user", ":"] + ["<image>", "what"] * placeholders + ["?"]
    with mp.fix_off(FIX):
        stock = chat.render_tokens(words, images)
    assert chat.render_tokens(words, images) == stock
    assert len(stock.get("images", ())) == images or "Failed to apply prompt replacement" in stock["error"]


def test_strict_refuses(chat):
    mtp_overlay.install(only=[FIX], strict=True)
    try:
        seen = chat.render([{"role": "system", "content": "be brief"}] + mp.conversation(1, mp.SEED_TEXTS))
        assert chat.render_tokens(TYPED, 1)["error"].startswith(SURPLUS)  # refused, strict or not
    finally:
        mtp_overlay.install(only=[FIX], strict=False)
    assert seen["error"].startswith(f"{OverlayError.__name__}: mtp-overlay fix '{FIX}': message 1 writes the media "
                                    f"placeholder '<image>' 2 time(s) in its text beside 1 image structured item(s)")


WORDS = st.sampled_from(["<image>", "what", "<image><image>", "a<image>b", "picture", "<imag"])
SHAPES = st.lists(st.tuples(st.integers(1, 2), st.lists(st.lists(WORDS, max_size=4).map(" ".join), max_size=2)),
                  min_size=1, max_size=2)


@settings(max_examples=25, deadline=None)
@given(SHAPES)
def test_with_the_fix_every_image_binds_once(chat, shape):
    """Any mix of structured images and literals: with the fix, one placeholder per image, each bound."""
    messages = [message for images, texts in shape for message in mp.conversation(images, texts)]
    images = sum(images for images, _ in shape)
    seen = chat.render(messages)
    assert (seen["placeholders"], seen["items"]) == (images, images), seen
