"""hf-media-placeholders on stock transformers: a message with one structured image and two literal
``<image>`` renders two placeholders through the processor's chat template (the seed's rule)."""

import tempfile
from pathlib import Path

from ..steps import media_placeholders as mp


def reproduce():
    """Render through the stock ``ProcessorMixin.apply_chat_template`` (never the hooked one) of the tiny
    processor; the bug shows when the placeholders outnumber the structured images."""
    from transformers.processing_utils import ProcessorMixin

    from mtp_overlay.calls import original

    with tempfile.TemporaryDirectory(prefix="mtp-overlay-media-") as work:
        processor = mp.load_processor(mp.write_processor(Path(work) / "processor"))
    messages = mp.conversation(1, mp.SEED_TEXTS)
    prompt = original(ProcessorMixin.apply_chat_template)(processor, messages)
    found = prompt.count(mp.PLACEHOLDER)
    return found > 1, (f"stock ProcessorMixin.apply_chat_template, 1 structured image and the text "
                       f"{' '.join(mp.SEED_TEXTS)!r}: {found} {mp.PLACEHOLDER} in {prompt!r}")
