"""vllm-media-placeholders: what it targets and where it comes from (data only)."""

from mtp_overlay.contract import Declaration, Provenance

DECLARATION = Declaration(
    "vllm-media-placeholders",
    summary="Literal media placeholders in a multimodal message's text are removed before vLLM's chat parser "
    "and template render it; a prompt with more placeholder tokens than media items is refused.",
    symptom="a chat message with structured images whose text also writes `<image>`: vLLM refuses it (string "
    "templates) or renders the literal copies as placeholders (content-list templates such as Nemotron Omni's), "
    "and a typed `<image>` takes an image's binding (a tokenized prompt with 2 placeholders and 1 image binds the "
    "first silently)",
    distribution="vllm",
    targets={
        "chat_message": "vllm.renderers.chat_utils.chat_message",  # parse_chat_message_content
        "processor": "vllm.multimodal.processing.processor",  # BaseMultiModalProcessor._maybe_apply_prompt_updates
    },
    provenance=Provenance(
        origin="NeMo-RL PR #3494 (Nemotron Super Omni rollouts through vLLM's chat path)",
        upstream_fix="none (vLLM PR #57781, open, proposes refusing more placeholder tokens than media items)",
        bugs=("https://github.com/vllm-project/vllm/issues/57740", "https://github.com/vllm-project/vllm/pull/57781"),
    ),
)
