"""mtp-logprob-skip: a forward that cannot train the MTP head does not run the MTP block.

megatron-core 0.19.x: outside inference mode, `GPTModel._postprocess` (gpt_model.py:666) and
`HybridModel.forward` (hybrid_model.py:538) run the whole MTP block on every forward, then
`process_mtp_loss` computes each depth's logits (an output-layer GEMM over the vocabulary) and, in
train mode, records MTP loss and acceptance in `MTPLossLoggingHelper`'s tracker, grad or no grad.
An RL trainer's logprob forwards (reference and old policy, under ``torch.no_grad()``) pay for all
of it, and their numbers land in the tracker the training step logs. Upstream: Megatron-LM PR #6119
(main) added ``HybridModel.forward(compute_mtp_loss=...)``, which the caller must pass; GPTModel
has no switch (AReaL PR #1653 asks for one).

The hooks: the model forward decides once, at entry, whether this forward skips its MTP block:
grad disabled (or ``mtp_overlay.mtp.mtp_block_scope(run=False)``), unless
``mtp_block_scope(run=True)`` says otherwise, and only where the forward itself consumes the
block's outputs (the model holds the MTP block and the output layer: ``mtp_process`` and
``post_process``; no ``inference_context``; megatron-core's inference mode off: there stock skips
the block itself and speculative decoding runs the MTP layers through `compute_mtp_single_step`,
which no hook touches). In a skipped forward `MultiTokenPredictionBlock.forward` returns the
decoder's hidden states unchanged and the model module's `process_mtp_loss` returns them as they
are: the first chunk stock would split off, so the logits are the same bits.
"""

import contextvars

from ...calls import argument, original, positions
from ...contract import Verdict, defined_in, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

BLOCK = "MultiTokenPredictionBlock"
PROCESS = "process_mtp_loss"
SWITCH = "compute_mtp_loss"  # HybridModel.forward's keyword on Megatron-LM main (PR #6119)
# target role -> (its model class, the method that runs the MTP block and process_mtp_loss)
MODELS = {"gpt_model": ("GPTModel", "_postprocess"), "hybrid_model": ("HybridModel", "forward")}
RUNS_BLOCK = ("mtp", PROCESS)  # names that method reads where it runs the block and its loss
# the MTP block the current model forward skips (None: it runs its block, or no model forward runs)
_skipped: "contextvars.ContextVar[Any]" = contextvars.ContextVar("mtp_overlay_skipped_mtp_block", default=None)


def _method(cls: "Any", name: str) -> "Callable[..., Any] | None":
    """``cls.<name>`` as upstream defined it (wrappers looked through), or None."""
    method = None if cls is None else vars(cls).get(name)
    return None if method is None else original(method)


def skipping(forward_model: "Any", inference_context: "Any", inference_mode: "Any") -> bool:
    """Whether this forward of ``forward_model`` skips its MTP block (decided at its entry).
    ``inference_mode``: megatron-core's `InferenceMode` as the model module binds it (0.18+), or None."""
    import torch

    from ... import mtp

    run = mtp.scoped_mtp_block()
    if run is None:
        run = torch.is_grad_enabled()
    return (not run and getattr(forward_model, "mtp_process", False) and forward_model.post_process
            and inference_context is None and not (inference_mode is not None and inference_mode.is_active()))


class MtpLogprobSkipFix(Fix):
    declaration = DECLARATION  # targets "mtp" (the block's forward), "gpt_model", "hybrid_model"

    def probe(self, module: "ModuleType") -> Verdict:
        import inspect

        role = self.role_of(module)
        if role == "mtp":
            forward = _method(getattr(module, BLOCK, None), "forward")
            if forward is None or "hidden_states" not in inspect.signature(forward).parameters:
                return drifted(f"{module.__name__} has no {BLOCK}.forward(hidden_states=...)")
            return needed(f"{BLOCK}.forward runs every MTP depth")
        class_name, runner = MODELS[role]
        cls = defined_in(module, [class_name])
        forward, runs = _method(cls, "forward"), _method(cls, runner)
        if forward is None or runs is None:
            return drifted(f"{module.__name__} has no {class_name}.forward and {class_name}.{runner}")
        parameters = inspect.signature(forward).parameters
        if SWITCH in parameters:
            return redundant(f"{class_name}.forward takes {SWITCH}= (Megatron-LM PR #6119): pass "
                             f"{SWITCH}=False in forwards that cannot train the MTP head")
        missing = [name for name in RUNS_BLOCK if name not in runs.__code__.co_names]
        missing += [] if "inference_context" in parameters else ["forward(inference_context=...)"]
        process = getattr(module, PROCESS, None)
        first = next(iter(inspect.signature(original(process)).parameters), None) if callable(process) else None
        missing += [] if first == "hidden_states" else [f"{module.__name__}.{PROCESS}(hidden_states, ...)"]
        if missing:
            return drifted(f"{class_name}.{runner} does not run the MTP block the way megatron-core 0.19 does "
                           f"(no {', '.join(missing)})")
        return needed(f"{class_name}.{runner} runs the MTP block on every forward outside inference mode, "
                      "grad or no grad")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        if self.role_of(module) == "mtp":
            block = getattr(module, BLOCK)
            at = positions(block.forward, method=True)

            def block_forward(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                              kwargs: "dict[str, Any]") -> "Any":
                if _skipped.get() is instance:
                    return argument(args, kwargs, at.get("hidden_states"), "hidden_states")
                return wrapped(*args, **kwargs)

            yield block, "forward", block_forward
            return
        cls = defined_in(module, [MODELS[self.role_of(module)][0]])
        at = positions(cls.forward, method=True)
        inference_mode = getattr(module, "InferenceMode", None)

        def model_forward(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                          kwargs: "dict[str, Any]") -> "Any":
            context = argument(args, kwargs, at.get("inference_context"), "inference_context", None)
            context = context if context is not None else kwargs.get("inference_params")
            token = _skipped.set(instance.mtp if skipping(instance, context, inference_mode) else None)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _skipped.reset(token)

        def process_mtp_loss(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                             kwargs: "dict[str, Any]") -> "Any":
            if _skipped.get() is not None:  # the block returned the decoder's hidden states alone
                return argument(args, kwargs, 0, "hidden_states")
            return wrapped(*args, **kwargs)

        yield cls, "forward", model_forward
        yield module, PROCESS, process_mtp_loss


FIX = MtpLogprobSkipFix()
