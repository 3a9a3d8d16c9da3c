"""vllm-chat-template: what it targets, where it comes from, which releases its patches fit (data only)."""

from mtp_overlay.contract import Declaration, Marker, Provenance

ONLINE_RENDERER = "vllm.renderers.online_renderer"

DECLARATION = Declaration(
    "vllm-chat-template",
    summary="In-process vLLM servers load a chat template path and share one template and kwargs, as `vllm serve`.",
    symptom="a server built in-process (not `vllm serve`) renders a `chat_template` path as the template (image "
    "placeholders lost) and each consumer keeps its own template kwargs (`/tokenize` ≠ chat route)",
    distribution="vllm",
    targets={  # each role's consumer class: its __init__
        "online_renderer": ONLINE_RENDERER,
        "online_derenderer": "vllm.renderers.online_derenderer",
        "tokenization": "vllm.entrypoints.serve.tokenize.serving",
        "chat": "vllm.entrypoints.openai.chat_completion.serving",
        "responses": "vllm.entrypoints.openai.responses.serving",
        "anthropic": "vllm.entrypoints.anthropic.serving",
    },
    families={"0.25": ">=0.25.1,<0.26", "0.33": ">=0.33.0,<0.34"},
    provenance=Provenance(
        origin="NeMo-RL PR #3494 (vllm_worker_async.py builds vLLM's OpenAI server in-process)",
        upstream_fix="none (NeMo-RL PR #3494 works around it)",
        bugs=("https://github.com/NVIDIA-NeMo/RL/pull/3494",),
    ),
    # on disk, the patched (or upstream-fixed) constructor loads the template itself
    marker=Marker(ONLINE_RENDERER, "OnlineRenderer.__init__", "load_chat_template"),
)
