"""bridge-sft-mtp-mask: Bridge's training step hands the model the loss mask its batch carries.

Megatron-Bridge 0.6 ``training/gpt_step.py:432-437``: ``_forward_step_common`` unpacks ``(tokens,
labels, loss_mask, ...)`` from ``get_batch`` and calls ``model(**forward_args)`` with
``input_ids``, ``position_ids``, ``attention_mask`` and ``labels`` only; ``loss_mask`` goes to the
LM loss function alone. megatron-core's ``process_mtp_loss`` then weights the MTP loss by
``ones_like(labels)`` (``transformer/multi_token_prediction.py:825-826``): the MTP head trains on
prompts and padding. Bridge's ``forward_step`` and ``forward_step_modelopt`` call the function by
name, DeepSeek-V4's step (``models/deepseek/deepseek_v4_step.py:45``) binds it by name: both
targets' bindings are wrapped.

The wrapper, only for a model with MTP whose (unwrapped) forward takes ``labels`` and ``loss_mask``:
it passes ``_get_batch_fn`` (the caller's, else the module's ``get_batch``, looked up at call time
as upstream does) through a function that keeps the ``loss_mask`` element of the batch tuple (its
index read from the function's own unpacking), and for the duration of the call puts a forward
pre-hook on the unwrapped model that adds ``loss_mask=`` to the model's call when the call carries
``labels`` and no mask (Bridge PR #6105's change, made from outside). The mask is the batch's own,
label-aligned and CP-sliced with the labels by ``get_batch``: exactly what megatron-core rolls with
the labels. No tensor is read: no device sync.

mtp-loss-mask routes an *input-aligned* RL mask scoped by the trainer (``mtp.loss_mask_scope``) and
refuses a call with ``labels``; this fix is the label-aligned path of a step that has labels. The
two never merge: the model call still goes through mtp-loss-mask's forward wrapper, which checks the
mask's layout and never substitutes its scope for a mask that is passed; and a call made while a
scope is live and mtp-loss-mask is installed raises here, as mtp-loss-mask would without this fix,
instead of letting either mask win silently.
"""

import contextvars

from ...calls import argument, original, positions, with_argument
from ...contract import Verdict, defined_in, drifted, needed, redundant
from .. import Fix
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ast
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

FUNCTION = "_forward_step_common"
GET_BATCH_FN = "_get_batch_fn"  # keyword-only: the batch function the caller picked (None: get_batch)
GET_BATCH = "get_batch"
FORWARD_ARGS = "forward_args"
LOSS_MASK = "loss_mask"
LOSS_MASK_FIX = "mtp-loss-mask"
_active = contextvars.ContextVar("bridge_sft_mtp_mask_active", default=False)  # one of ours is running
_forward_positions: "dict[type, dict[str, int] | None]" = {}  # model class -> its forward's positions


def _step_function(module: "ModuleType") -> "Callable[..., Any] | None":
    """``_forward_step_common`` as upstream defined it: where gpt_step defines it, or the name
    another step module binds it to."""
    if FIX.role_of(module) == "gpt_step":
        found = defined_in(module, [FUNCTION])
    else:
        found = vars(module).get(FUNCTION)
    return None if not callable(found) else original(found)


def read_step(function: "Callable[..., Any]") -> "Verdict | int":
    """What ``function``'s source says: the index of ``loss_mask`` in the tuple it unpacks from the
    batch function (the fix is needed), or a redundant / drifted Verdict."""
    import ast
    import inspect
    import textwrap

    name = getattr(function, "__qualname__", FUNCTION)
    parameter = inspect.signature(function).parameters.get(GET_BATCH_FN)
    if "model" not in inspect.signature(function).parameters:
        return drifted(f"{name} takes no model")
    if parameter is None or parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
        return drifted(f"{name} takes no keyword-only {GET_BATCH_FN}")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        return drifted(f"the source of {name} cannot be read ({type(exc).__name__}: {exc})")
    keys, index, calls_model = None, None, False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _names(node.targets) == [FORWARD_ARGS] and isinstance(node.value, ast.Dict):
            keys = [key.value for key in node.value.keys if isinstance(key, ast.Constant)]
        elif isinstance(node, ast.Assign) and any(_is_forward_args_key(target, LOSS_MASK) for target in node.targets):
            return redundant(f"{name} sets {FORWARD_ARGS}[{LOSS_MASK!r}]")
        elif isinstance(node, ast.Assign) and _is_batch_call(node.value) and isinstance(node.targets[0], ast.Tuple):
            unpacked = [getattr(element, "id", None) for element in node.targets[0].elts]
            index = unpacked.index(LOSS_MASK) if LOSS_MASK in unpacked and "labels" in unpacked else None
        elif isinstance(node, ast.Call) and _is_model_call(node):
            calls_model = True
    if keys is None:
        return drifted(f"{name} builds no {FORWARD_ARGS} dict literal")
    if LOSS_MASK in keys:
        return redundant(f"{name} passes {LOSS_MASK!r} in {FORWARD_ARGS}")
    if "labels" not in keys:
        return drifted(f"{name}'s {FORWARD_ARGS} has no 'labels' (keys {keys})")
    if index is None:
        return drifted(f"{name} unpacks no labels and {LOSS_MASK} from ({GET_BATCH_FN} or {GET_BATCH})(...)")
    if not calls_model:
        return drifted(f"{name} no longer calls model(**{FORWARD_ARGS})")
    return index


def _names(targets: "list[ast.expr]") -> "list[str | None]":
    return [getattr(target, "id", None) for target in targets]


def _is_forward_args_key(target: "ast.expr", key: str) -> bool:
    import ast

    return (isinstance(target, ast.Subscript) and getattr(target.value, "id", None) == FORWARD_ARGS
            and isinstance(target.slice, ast.Constant) and target.slice.value == key)


def _is_batch_call(value: "ast.expr") -> bool:
    """``(_get_batch_fn or get_batch)(...)``."""
    import ast

    function = value.func if isinstance(value, ast.Call) else None
    return (isinstance(function, ast.BoolOp) and isinstance(function.op, ast.Or)
            and [getattr(v, "id", None) for v in function.values] == [GET_BATCH_FN, GET_BATCH])


def _is_model_call(node: "ast.Call") -> bool:
    """``model(**forward_args)``."""
    return (getattr(node.func, "id", None) == "model"
            and any(k.arg is None and getattr(k.value, "id", None) == FORWARD_ARGS for k in node.keywords))


def _model_positions(model: "Any") -> "dict[str, int] | None":
    """Where ``labels`` and ``loss_mask`` sit in a call of ``model``'s forward; None when it takes
    either not at all (nothing to route)."""
    import inspect

    cls = type(model)
    if cls not in _forward_positions:
        forward: "Any" = getattr(cls, "forward", None)
        parameters = inspect.signature(original(forward)).parameters if forward is not None else {}
        takes = "labels" in parameters and LOSS_MASK in parameters
        _forward_positions[cls] = positions(forward, method=True) if takes else None
    return _forward_positions[cls]


class SftMtpMaskFix(Fix):
    declaration = DECLARATION  # "gpt_step" defines _forward_step_common, "deepseek_v4_step" binds it

    def probe(self, module: "ModuleType") -> Verdict:
        function = _step_function(module)
        if function is None:
            return drifted(f"{module.__name__} has no {FUNCTION}")
        found = read_step(function)
        if isinstance(found, Verdict):
            return found
        return needed(f"{FUNCTION} calls model(**{FORWARD_ARGS}) without the batch's {LOSS_MASK}: "
                      "megatron-core's MTP loss weights every position alike")

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        from ... import mtp

        function = _step_function(module)
        assert function is not None, "probed first"
        index = read_step(function)
        assert isinstance(index, int), "probed first"
        at, home = positions(function), function.__globals__

        def forward_step_common(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                kwargs: "dict[str, Any]") -> "Any":
            if _active.get():  # a binding of ours wrapping another binding of ours
                return wrapped(*args, **kwargs)
            model = mtp.unwrap_model(argument(args, kwargs, at.get("model"), "model", None))
            model_at = _model_positions(model)
            if model_at is None or not (getattr(getattr(model, "config", None), "mtp_num_layers", None) or 0) > 0:
                return wrapped(*args, **kwargs)
            chosen = argument(args, kwargs, at.get(GET_BATCH_FN), GET_BATCH_FN, None)
            batch: "dict[str, Any]" = {}

            def get_batch_keeping_the_mask(*batch_args: "Any", **batch_kwargs: "Any") -> "Any":
                found = (chosen or home[GET_BATCH])(*batch_args, **batch_kwargs)
                batch[LOSS_MASK] = found[index]
                return found

            def with_loss_mask(_: "Any", call_args: "tuple[Any, ...]", call_kwargs: "dict[str, Any]") -> "Any":
                mask = batch.get(LOSS_MASK)
                if (mask is None or argument(call_args, call_kwargs, model_at.get("labels"), "labels", None) is None
                        or argument(call_args, call_kwargs, model_at.get(LOSS_MASK), LOSS_MASK, None) is not None):
                    return None
                _refuse_a_live_rl_scope()
                return with_argument(call_args, call_kwargs, model_at.get(LOSS_MASK), LOSS_MASK, mask)

            args, kwargs = with_argument(args, kwargs, at.get(GET_BATCH_FN), GET_BATCH_FN, get_batch_keeping_the_mask)
            handle = model.register_forward_pre_hook(with_loss_mask, with_kwargs=True)
            token = _active.set(True)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _active.reset(token)
                handle.remove()

        yield module, FUNCTION, forward_step_common


def _refuse_a_live_rl_scope() -> None:
    """ValueError when the trainer scoped an input-aligned RL mask (`mtp.loss_mask_scope`) that
    mtp-loss-mask would route: a step with labels trains on its batch's label-aligned mask, and
    which of the two the trainer meant is not for this fix to guess."""
    from ... import mtp
    from ...contract import State

    if mtp.scoped_loss_mask() is None or FIX.peer_state(LOSS_MASK_FIX)[0] != State.INSTALLED:
        return
    raise ValueError(
        f"Bridge's {FUNCTION} passes labels and its batch's label-aligned loss_mask to the model, but "
        f"mtp_overlay.mtp.loss_mask_scope holds an input-aligned RL mask for fix {LOSS_MASK_FIX}: leave the "
        "scope for RL forwards (labels=None), or put the mask you mean in the batch's loss_mask"
    )


FIX = SftMtpMaskFix()
