"""What crosses between verify and its engine, described once: the requests the product sends
(`mtp_overlay.verification`) and the answers the test bed's engine gives (``mtp_overlay.bed.engines.verify``),
one JSON object per line each way (`verification.engine`). Both sides import these names.

A JSON answer is read defensively all the same (a crashed or mismatched engine answers something
else): the product checks each value's type where it reads it.
"""

from __future__ import annotations

from typing import Literal, TypedDict

# verify's --loss -> (the loss shape Megatron's step returns, calculate_per_token_loss): "per-token" is
# the 3-output loss with per-token normalisation (what NeMo-RL's MTP runs use)
LOSSES: dict[str, tuple[str, bool]] = {
    "per-token": ("3-output", True), "2-output": ("2-output", False), "3-output": ("3-output", False),
}


class _Multimodal(TypedDict, total=False):
    multimodal: dict[str, object]  # a VL / Omni model: provider fields set after Bridge's import


class HfConfigModel(_Multimodal):
    """A model given by its config.json's values (``model_type`` included), shrunk."""

    kind: Literal["hf-config"]
    config: dict[str, object]


class ProviderModel(_Multimodal):
    """A model given by the module path of a Megatron-Bridge provider, and the fields the shrink changed."""

    kind: Literal["provider"]
    path: str
    overrides: dict[str, object]


class DescribedModel(TypedDict):
    """The provider of a ``describe`` request (its fields are not known yet)."""

    kind: Literal["provider"]
    path: str


class _PlanImages(TypedDict, total=False):
    images: list[list[int]]  # per sequence, the tiles of each image (a multimodal plan only)


class Plan(_PlanImages):
    """What the engine builds and runs: the shrunk model, the provider settings of the reference, the
    seed, the loss (a key of `LOSSES`), the forward ("rl" / "sft"), how the MTP mask reaches megatron-core
    ("explicit" as loss_mask, or "scoped"), the sequences, their prompt lengths, the packing and its pad."""

    model: HfConfigModel | ProviderModel
    recipe: dict[str, object]
    seed: int
    loss: str
    forward: str
    mtp_mask: Literal["explicit", "scoped"]
    scatter_embedding_sequence_parallel: bool
    sequences: list[list[int]]
    prompts: list[int]
    packing: str
    pad_multiple: int | None


# one job: [a layout (`Layout.as_dict`, or "reference": each sequence alone, TP1, stock), its cases],
# each case [its name, the fix ids installed for it]
Job = list[object]


class DescribeRequest(TypedDict):
    op: Literal["describe"]
    model: DescribedModel


class RunRequest(TypedDict):
    op: Literal["run"]
    plan: Plan
    jobs: list[Job]


class CaseAnswer(TypedDict, total=False):
    """One case's row: where and what it ran, its error (None), the (sequence, position, target) triples
    each MTP depth trained, the step's losses and token counts, and its gradients' relative errors and
    max |Δgrad| against the reference (per part: "mtp", "mtp.layers.<i>", "rest")."""

    layout: str | dict[str, object]
    case: str
    fixes: list[str]
    error: str | None
    trained: list[list[list[int]]] | None
    lm_loss: float
    mtp_losses: list[float]
    mtp_tokens: list[int]
    grad_relerr: dict[str, float]
    max_delta: dict[str, float]


class Answer(TypedDict, total=False):
    """The engine's answer to a request: ``describe``'s provider fields, class and family; ``run``'s
    cases (and, with the reference, what was built); an ``error`` (with a ``traceback`` and the ranks'
    ``log`` when the engine itself failed, without them for a plan the test bed cannot build); the
    request's ``seconds``, and ``startup`` on the first answer."""

    fields: dict[str, object]
    provider: str
    family: str
    cases: list[CaseAnswer]
    built: dict[str, object]
    error: str
    traceback: str
    log: str
    seconds: float
    startup: float
