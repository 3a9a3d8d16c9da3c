"""mtp-loss-mask: the MTP head trains only on response tokens of kept samples, in the tokens' layout.

megatron-core 0.19.x: a forward without ``labels`` (RL: the loss lives outside Megatron) derives
the MTP labels by rolling ``input_ids`` (Megatron-LM PR #3457) and weights them by ``loss_mask``,
all ones when none is given, so prompt tokens, padding and zero-weight samples train the MTP head.
NeMo-RL's fix (PR #3494) hands a ``token_mask * sample_mask`` loss mask in exactly the layout of
the ``input_ids``.

The hook on ``GPTModel.forward`` and ``HybridModel.forward``:
- a mask scoped by the trainer (``mtp_overlay.mtp.loss_mask_scope``) reaches the model as
  ``loss_mask`` when the caller passes none (MTP models; with ``labels`` only a mask scoped as
  ``aligned="label"``); a mask said to be label-aligned is shifted into the input-aligned mask an
  RL forward takes (CP=1; under CP the full rows are converted first, `mtp.input_aligned_mask`);
- every ``loss_mask`` reaching the model is checked against the tokens' layout (same shape and
  device as ``input_ids``, finite weights >= 0; packed input: zeros in every padding slot), on the
  device by default (no host read: `mtp_overlay.mtp.checks`), on the host with ValueErrors under
  ``MTP_OVERLAY_CHECKS=full``;
- a packed MTP forward whose ``cu_seqlens_q`` differs from ``cu_seqlens_q_padded`` is refused,
  mask or none, unless mtp-packed-roll (or upstream) rolls on the padded layout: stock rolls the MTP
  labels by ``cu_seqlens_q`` alone. A host read, made only while mtp-packed-roll is not active;
- the first packed RL forward whose mask's alignment is not said is checked for the label-aligned
  off-by-one (`mtp.label_aligned_signature`; every such forward under ``MTP_OVERLAY_CHECKS=full``):
  one host read (and under CP one all-reduce), once per process and install;
- under CP, before any of that, every rank of the CP group must run the same collective fixes
  (`mtp_overlay.fixes.peers`, once per group).
Raising ValueError instead of failing deep inside Megatron or training on shifted positions.
"""

from ...calls import argument, original, positions, with_argument
from ...contract import Verdict, defined_in, drifted, needed
from ...mtp.config import FIRST_RELEASE
from .. import Fix, peers
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
        from ..combined_inputs import inject  # fix mtp-multimodal's combined inputs: this same wrapper

        global _alignment_checked
        peers.forget()  # installed (again): its groups agree afresh, its first RL forward is checked
        _alignment_checked = False
        cls, forward = _forward(module)
        assert forward is not None, "probed first"
        at = positions(forward, method=True)  # self is bound by wrapt

        def read(args: "tuple[Any, ...]", kwargs: "dict[str, Any]", name: str) -> "Any":
            return argument(args, kwargs, at.get(name), name, None)

        def forward_with_loss_mask(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                   kwargs: "dict[str, Any]") -> "Any":
            with mtp.packing.forward_scope():  # the packed boundaries' plan: once for the checks and every roll
                return routed(wrapped, instance, args, kwargs)

        def routed(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                   kwargs: "dict[str, Any]") -> "Any":
            args, kwargs = inject(instance, args, kwargs, at)  # a multimodal forward's combined ids and mask
            loss_mask, scoped, aligned = read(args, kwargs, "loss_mask"), mtp.scoped_loss_mask(), mtp.scoped_alignment()
            mtp_on = mtp.mtp_enabled(instance)
            rl = read(args, kwargs, "labels") is None
            if loss_mask is None and scoped is not None and mtp_on:
                if not rl and aligned != mtp.LABEL:
                    raise ValueError(
                        "loss_mask_scope holds an unshifted (input_ids-aligned) MTP mask, but this call passes "
                        "labels: with labels megatron-core expects a label-aligned loss_mask; pass loss_mask "
                        "explicitly, scope a label-aligned one with aligned='label', or call without labels"
                    )
                loss_mask = scoped
                args, kwargs = with_argument(args, kwargs, at.get("loss_mask"), "loss_mask", scoped)
            packed = read(args, kwargs, "packed_seq_params")
            group = _cp_group(instance)
            cp_size, cp_rank = (1, 0) if group is None else (group.size(), group.rank())
            if mtp_on and cp_size > 1:
                peers.agree(FIX, group)
            if loss_mask is not None and mtp_on and rl and aligned == mtp.LABEL:
                loss_mask = _input_aligned(loss_mask, packed, cp_size)
                args, kwargs = with_argument(args, kwargs, at.get("loss_mask"), "loss_mask", loss_mask)
            input_ids = read(args, kwargs, "input_ids")
            if loss_mask is not None and input_ids is not None:
                check = mtp.check_loss_mask_layout if mtp.checks.full() else mtp.assert_loss_mask_layout
                check(input_ids, loss_mask, packed, cp_size, cp_rank)
            if packed is not None and mtp_on:
                _check_roll_boundaries(packed)
                if rl and loss_mask is not None and aligned is None:
                    _check_alignment(loss_mask, packed, group, cp_rank)
            return wrapped(*args, **kwargs)

        yield cls, "forward", forward_with_loss_mask


_alignment_checked = False  # whether the first packed RL forward's mask was checked for its alignment


def _cp_group(model: "Any") -> "Any":
    """The model's CP group, or None without one (or with one of a single rank)."""
    group = getattr(getattr(model, "pg_collection", None), "cp", None)
    return None if group is None or group.size() == 1 else group


def _input_aligned(loss_mask: "Any", packed: "Any", cp_size: int) -> "Any":
    """A mask scoped as label-aligned, as the input-aligned mask an RL forward takes."""
    from ... import mtp

    if cp_size > 1:
        raise ValueError(
            "loss_mask_scope(aligned='label') in an RL forward (labels=None) under context parallelism: a "
            "CP-local label-aligned mask cannot be shifted here (its neighbours live on other ranks); convert "
            "the full rows before sharding, mtp_overlay.mtp.input_aligned_mask(mask, cu_seqlens_padded), and "
            "scope that with aligned='input'"
        )
    padded = None
    if packed is not None:
        padded = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
    return mtp.input_aligned_mask(loss_mask, padded)


def _check_alignment(loss_mask: "Any", packed: "Any", group: "Any", cp_rank: int) -> None:
    """Refuse the label-aligned off-by-one in an RL forward whose mask's alignment is not said: on
    the first packed one (every one under ``MTP_OVERLAY_CHECKS=full``)."""
    global _alignment_checked
    from ... import mtp

    if _alignment_checked and not mtp.checks.full():
        return
    _alignment_checked = True
    sequences = mtp.label_aligned_signature(loss_mask, packed, group, cp_rank)
    if sequences is not None:
        raise ValueError(
            f"loss_mask looks label-aligned: each of the {sequences} weighted packed sequence(s) is 0 on its last "
            "real token, the signature of the LM loss's mask (label i = token i + 1, NeMo-RL's token_mask[:, 1:]). "
            "An RL forward (labels=None) takes the input-aligned mask (megatron-core rolls it with the labels "
            "it derives from input_ids): this one would train every MTP target one token early. Pass the "
            "unshifted token mask; or scope this one with loss_mask_scope(mask, aligned='label') (CP=1) or "
            "convert the full rows with mtp_overlay.mtp.input_aligned_mask; or, if the mask is input-aligned "
            "and every response is followed by masked tokens, say so: loss_mask_scope(..., aligned='input')"
        )


def _check_roll_boundaries(packed: "Any") -> None:
    """Refuse real boundaries apart from the padded ones unless the MTP roll uses the padded ones
    (fix mtp-packed-roll installed, or upstream rolling on them): stock megatron-core 0.19 rolls the
    MTP labels and loss_mask by ``cu_seqlens_q`` alone (Megatron-LM #4494/#6205), so every sequence
    after the first would train shifted targets, with a mask or without one.

    With mtp-packed-roll active nothing is read. Without it the boundaries are compared on the host
    (one device sync per packed MTP forward): the price of a clear refusal that names the fix to
    enable, in a setup that left the default (every fix installed); a device-side assert would say
    nothing on CUDA.
    """
    import torch

    from ...contract import State

    state, reason = FIX.peer_state(PACKED_ROLL)
    real, padded = packed.cu_seqlens_q, packed.cu_seqlens_q_padded
    if state in (State.INSTALLED, State.REDUNDANT) or padded is None:
        return
    real_cu = torch.as_tensor(real).long()
    if torch.equal(real_cu, torch.as_tensor(padded, device=real_cu.device).long()):
        return
    raise ValueError(
        f"packed_seq_params.cu_seqlens_q {real.tolist()[:16]} differs from cu_seqlens_q_padded "
        f"{padded.tolist()[:16]}, and fix {PACKED_ROLL} is {state} ({reason}): stock megatron-core rolls the "
        "MTP labels and loss_mask by cu_seqlens_q alone, so every sequence after the first would train on "
        f"shifted positions; enable {PACKED_ROLL}, or pass the padded boundaries as cu_seqlens_q too"
    )


FIX = LossMaskFix()
