"""mtp-loss-mask: the MTP head trains only on response tokens of kept samples, in the tokens' layout.

megatron-core 0.19.x: a forward without ``labels`` (RL: the loss lives outside Megatron) derives
the MTP labels by rolling ``input_ids`` (Megatron-LM PR #3457) and weights them by ``loss_mask``,
all ones when none is given, so prompt tokens, padding and zero-weight samples train the MTP head.
NeMo-RL's fix (PR #3494) hands a ``token_mask * sample_mask`` loss mask in exactly the layout of
the ``input_ids``.

The hook on ``GPTModel.forward`` and ``HybridModel.forward``:
- a mask scoped by the trainer (``mtp_overlay.mtp.loss_mask_scope``) reaches the model as
  ``loss_mask`` when the caller passes none (MTP models, ``labels=None`` only);
- every ``loss_mask`` reaching the model is checked against the tokens' layout (same shape as
  ``input_ids``; packed input: zeros in every padding slot; and, unless mtp-packed-roll makes
  megatron-core roll packed MTP tensors on the padded layout, ``cu_seqlens_q`` must equal
  ``cu_seqlens_q_padded``),
  raising ValueError instead of failing deep inside Megatron or training on shifted positions.
"""

from ...calls import argument, original, positions, with_argument
from ...contract import Verdict, defined_in, drifted, needed
from ...mtp.config import FIRST_RELEASE
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

MODEL_CLASSES = {"gpt_model": "GPTModel", "hybrid_model": "HybridModel"}  # target role -> its model class
PACKED_ROLL = "mtp-packed-roll"  # the fix that makes megatron-core roll packed MTP tensors on the padded layout
REQUIRED_PARAMETERS = ("input_ids", "labels", "loss_mask", "packed_seq_params")


def _forward(module: "ModuleType") -> "tuple[Any, Callable[..., Any] | None]":
    """(the model class of target ``module``, its forward as upstream defined it); None where missing."""
    cls = defined_in(module, [MODEL_CLASSES[FIX.role_of(module)]])
    method = None if cls is None else vars(cls).get("forward")
    return cls, (None if method is None else original(method))


def derives_mtp_labels(module: "ModuleType") -> bool:
    """Whether the module's MTP loss can derive labels from ``input_ids`` when labels is None.

    Read from the installed code: ``process_mtp_loss`` (which the model modules import) takes
    ``input_ids`` only where PR #3457 is present.
    """
    import inspect

    process = getattr(module, "process_mtp_loss", None)
    return process is not None and "input_ids" in inspect.signature(process).parameters


class LossMaskFix(Fix):
    declaration = DECLARATION  # targets "gpt_model", "hybrid_model": their model class's forward

    def probe(self, module: "ModuleType") -> Verdict:
        import inspect

        cls, forward = _forward(module)
        if cls is None:
            return drifted(f"{module.__name__} has no {MODEL_CLASSES[self.role_of(module)]}")
        if forward is None:
            return drifted(f"{cls.__name__} defines no forward")
        parameters = inspect.signature(forward).parameters
        missing = [name for name in REQUIRED_PARAMETERS if name not in parameters]
        if missing:
            return drifted(f"{cls.__name__}.forward has no parameter(s) {missing}")
        if parameters["loss_mask"].kind is not inspect.Parameter.KEYWORD_ONLY:
            return drifted(f"{cls.__name__}.forward takes loss_mask positionally (keyword-only expected)")
        if not derives_mtp_labels(module):
            since = FIRST_RELEASE["mtp_labels_from_input_ids"]
            # Not redundant (nothing upstream masks the RL MTP loss) and nothing for the hook to
            # route: without labels this release trains no MTP loss at all. Drifted is the state
            # that stays loud (warning, OverlayError when strict) so MTP-from-RL users learn it.
            return drifted(
                "this megatron-core cannot derive MTP labels from input_ids (process_mtp_loss takes no "
                f"input_ids: Megatron-LM PR #3457, {since}): with labels=None no MTP loss is trained at all, "
                f"so there is no RL MTP loss to mask; pass labels or upgrade to megatron-core >= {since}"
            )
        return needed("MTP labels are derived from input_ids when labels is None (PR #3457)")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        from ... import mtp
        from ..mtp_multimodal.scope import inject  # fix mtp-multimodal's combined inputs: this same wrapper

        cls, forward = _forward(module)
        assert forward is not None, "probed first"
        at = positions(forward, method=True)  # self is bound by wrapt

        def read(args: "tuple[Any, ...]", kwargs: "dict[str, Any]", name: str) -> "Any":
            return argument(args, kwargs, at.get(name), name, None)

        def forward_with_loss_mask(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                   kwargs: "dict[str, Any]") -> "Any":
            args, kwargs = inject(instance, args, kwargs, at)  # a multimodal forward's combined ids and mask
            loss_mask, scoped = read(args, kwargs, "loss_mask"), mtp.scoped_loss_mask()
            mtp_on = mtp.mtp_enabled(instance)
            if loss_mask is None and scoped is not None and mtp_on:
                if read(args, kwargs, "labels") is not None:
                    raise ValueError(
                        "loss_mask_scope holds an unshifted (input_ids-aligned) MTP mask, but this call passes "
                        "labels: with labels megatron-core expects a label-aligned loss_mask; pass loss_mask "
                        "explicitly or call without labels"
                    )
                loss_mask = scoped
                args, kwargs = with_argument(args, kwargs, at.get("loss_mask"), "loss_mask", scoped)
            input_ids = read(args, kwargs, "input_ids")
            if loss_mask is not None and input_ids is not None:
                packed = read(args, kwargs, "packed_seq_params")
                cp_size, cp_rank = _cp_size_rank(instance)
                mtp.check_loss_mask_layout(input_ids, loss_mask, packed, cp_size, cp_rank)
                if packed is not None and mtp_on:
                    _check_roll_boundaries(packed)
            return wrapped(*args, **kwargs)

        yield cls, "forward", forward_with_loss_mask


def _cp_size_rank(model: "Any") -> "tuple[int, int]":
    group = getattr(getattr(model, "pg_collection", None), "cp", None)
    if group is None:
        return 1, 0
    return group.size(), group.rank()


def _check_roll_boundaries(packed: "Any") -> None:
    """Refuse real boundaries apart from the padded ones unless the MTP roll uses the padded ones
    (fix mtp-packed-roll installed, or upstream rolling on them): stock megatron-core 0.19 rolls the
    MTP labels and loss_mask by ``cu_seqlens_q`` alone (Megatron-LM #4494/#6205)."""
    import torch

    from ...contract import State

    real, padded = packed.cu_seqlens_q, packed.cu_seqlens_q_padded
    if padded is None or torch.equal(torch.as_tensor(real).long(), torch.as_tensor(padded).long()):
        return
    state, reason = FIX.peer_state(PACKED_ROLL)
    if state in (State.INSTALLED, State.REDUNDANT):
        return
    raise ValueError(
        f"packed_seq_params.cu_seqlens_q {real.tolist()[:16]} differs from cu_seqlens_q_padded "
        f"{padded.tolist()[:16]}, and fix {PACKED_ROLL} is {state} ({reason}): stock megatron-core rolls the "
        "MTP labels and loss_mask by cu_seqlens_q alone, so every sequence after the first would train on "
        f"shifted positions; enable {PACKED_ROLL}, or pass the padded boundaries as cu_seqlens_q too"
    )


FIX = LossMaskFix()
