"""mtp-moe-router: the MTP block's MoE layers are MTP layers, and their router logs by MTP depth.

megatron-core 0.17-0.19.x build the hybrid MTP block's inner layers with ``HybridStack(...,
is_mtp_layer=True)`` (``transformer/multi_token_prediction.py:1018-1033`` in 0.19.2; ``MambaStack``
on 0.17), but the stack's MOE branch builds its layer without the flag
(``models/hybrid/hybrid_block.py:183-191``; the attention branches pass it), so the MTP block's
``MoETransformerLayer``, ``MoELayer`` and ``TopKRouter`` say ``is_mtp_layer=False``. The router then
(``transformer/moe/router.py`` 0.19.2) skips the ``1 / mtp_num_layers`` of a repeated MTP layer
(``:575-581``: the layer runs once per depth, so its load-balancing loss trains ``mtp_num_layers``
times) and logs in ``layer_number``'s slot (``:591-594``), a backbone layer's. Upstream's flag
(Megatron-LM PR #6748, main) alone is not enough: with it the slot becomes ``layer_number +
num_layers`` where ``layer_number`` is the MoE layer's place in the MTP *pattern*, not the MTP
depth; the tracker holds ``num_layers + mtp_num_layers`` slots, so ``"*E*E/*E"`` indexes slot 6 of 5
(``moe_logging.py:125``, Megatron-LM #7172).

Two hooks, one at build time and one in logging, nothing per token:

* after ``MultiTokenPredictionLayer.__init__``: every ``MoELayer`` inside ``self.mtp_model_layer``,
  the layer that holds it and its router get ``is_mtp_layer=True`` on the instances (what PR #6748's
  build gives them; upstream reads the flags later, in the router's aux-loss and z-loss calls), and the
  router ``mtp_depth = self.layer_number`` (this MTP layer's depth, 1-based, with the pipeline
  layout's MTP offset). ``layer_number`` itself stays (router replay and everything keyed by it keep
  the identity upstream gave them).
* ``TopKRouter.attach_and_log_load_balancing_loss`` and ``apply_z_loss`` of a router with
  ``mtp_depth`` run with ``layer_number = mtp_depth`` for the call (put back after), so upstream's
  own arithmetic logs it in slot ``num_layers + depth``. Every other router passes through.

Upstream's repeated-MTP z-loss division comes after ``MoEAuxLossAutoScaler.apply``
(``router.py:672-686``: logging only, recorded in PR #6748); the hook leaves it as upstream has it.
"""

from ...contract import Verdict, drifted, needed, redundant
from .. import Fix
from . import reading
from .declaration import DECLARATION

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType
    from typing import Any

DEPTH = reading.DEPTH
# role -> (class the target module must define or re-export, attributes of it the hook wraps or reads)
LIVE = {
    "mtp": ("MultiTokenPredictionLayer", ("__init__",)),
    "router": ("TopKRouter", reading.LOGGING),
    "hybrid_stack": ("HybridStack", ("__init__",)),
    "mamba_stack": ("MambaStack", ("__init__",)),
}


def verdict(root: "Any") -> Verdict:
    """The fix's verdict for the megatron-core files under ``root`` (the same for every target)."""
    stack = reading.stack_init(root)
    if stack is None:
        return drifted("no HybridStack (models/hybrid/hybrid_block.py) nor MambaStack (ssm/mamba_block.py) "
                       "defines __init__")
    file, cls, init = stack
    hybrid, sets_depth = reading.mtp_branch(reading.tree(root, reading.MTP_FILE))
    if not hybrid:
        return drifted(f"MultiTokenPredictionLayer.__init__ builds no {cls}(..., is_mtp_layer=True): no hybrid MTP "
                       "block (megatron-core builds one since 0.17), no branch for the hook to follow")
    flag = reading.stack_flag(init)
    if flag is None:
        return drifted(f"{cls}.__init__ ({file}) builds no submodules.moe_layer: the MOE branch changed shape")
    slot, why = reading.router_slot(reading.tree(root, reading.ROUTER_FILE))
    if slot is None:
        return drifted(why)
    if not flag:
        return needed(f"the MOE branch of {cls}.__init__ builds the MTP block's MoE layers without is_mtp_layer "
                      "(Megatron-LM PR #6748): a repeated MTP layer's aux loss trains once per depth, logged in a "
                      "backbone slot")
    if slot == "position":
        return needed(f"{cls} passes is_mtp_layer (PR #6748) but TopKRouter logs an MTP layer at its place in the MTP "
                      "pattern + num_layers (Megatron-LM #7172): '*E*E/*E' overflows the MoE tracker")
    if not sets_depth:
        return drifted(f"TopKRouter logs an MTP layer by {DEPTH}, but MultiTokenPredictionLayer.__init__ never "
                       "sets it")
    return redundant(f"{cls} passes is_mtp_layer and {DECLARATION.marker} (upstream, or patched on disk)")


def _live_drift(role: str, module: "ModuleType") -> "str | None":
    """Why ``module`` no longer holds what the hook wraps or reads (None: it does)."""
    if role == "mamba_stack" and getattr(vars(module).get("HybridStack"), "__module__", None) != module.__name__:
        return None  # 0.18+: a re-export of models.hybrid.hybrid_block, whose own target reads it
    name, attributes = LIVE[role]
    cls = vars(module).get(name)
    if not isinstance(cls, type) or cls.__module__ != module.__name__:
        return f"{module.__name__} defines no {name}"
    missing = [attribute for attribute in attributes if attribute not in vars(cls)]
    return f"{name} has no {', '.join(missing)}" if missing else None


def logs_by_depth(router_class: type) -> bool:
    """Whether a router of ``router_class`` logs by its ``mtp_depth``: this fix's wrapper sits on both
    logging functions (through any other wrapt wrappers), or upstream's code reads it."""
    import inspect

    for name in reading.LOGGING:
        found, ours = inspect.getattr_static(router_class, name, None), False
        while found is not None and not ours:
            ours = getattr(found, "_self_wrapper", None) is log_at_depth
            found = getattr(found, "__wrapped__", None)
        code = getattr(inspect.unwrap(getattr(router_class, name, None) or (lambda: None)), "__code__", None)
        if not ours and (code is None or DEPTH not in code.co_names):
            return False
    return True


def flag_moe_layers(layer: "Any") -> "list[Any]":
    """Set ``is_mtp_layer`` on every MoE layer inside MTP layer ``layer``'s inner layers, on the module
    holding it and on its router, and ``mtp_depth`` on the router; returns the routers. A router
    whose class would not log by depth (`logs_by_depth`: one that overrides the logging functions) is
    left as upstream built it, and said so: with the flag alone its slot could overflow the tracker
    (Megatron-LM #7172)."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    inner = getattr(layer, "mtp_model_layer", None)
    if inner is None:
        return []
    routers = []
    for owner in inner.modules():
        for child in owner.children():
            router = getattr(child, "router", None)
            if not isinstance(child, BaseMoELayer) or router is None:
                continue
            if not logs_by_depth(type(router)):
                FIX.lifecycle.report(f"{type(router).__qualname__} of the MTP block's MoE layer does not log by "
                                     f"{DEPTH} (its own logging functions): left as upstream built it")
                continue
            for module in (owner, child, router):
                module.is_mtp_layer = True
            setattr(router, DEPTH, layer.layer_number)
            routers.append(router)
    return routers


def log_at_depth(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                 kwargs: "dict[str, Any]") -> "Any":
    """A router's logging call: with ``mtp_depth`` set (an MTP block's router), run with
    ``layer_number = mtp_depth`` so upstream logs it in slot ``num_layers + depth``."""
    depth = vars(instance).get(DEPTH)
    if depth is None or not instance.is_mtp_layer:
        return wrapped(*args, **kwargs)
    number = instance.layer_number
    instance.layer_number = depth
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.layer_number = number


class MoERouterFix(Fix):
    declaration = DECLARATION

    def probe(self, module: "ModuleType") -> Verdict:
        why = _live_drift(self.role_of(module), module)
        return drifted(why) if why else verdict(reading.site_of(module))

    def wrappers(self, module: "ModuleType") -> "Iterator[tuple[object, str, Callable[..., Any]]]":
        role = self.role_of(module)
        if role == "mtp":

            def mtp_layer_built(wrapped: "Callable[..., Any]", instance: "Any", args: "tuple[Any, ...]",
                                kwargs: "dict[str, Any]") -> "Any":
                result = wrapped(*args, **kwargs)
                flag_moe_layers(instance)
                return result

            yield module.MultiTokenPredictionLayer, "__init__", mtp_layer_built
        elif role == "router" and reading.router_slot(reading.tree(reading.site_of(module), reading.ROUTER_FILE))[0] \
                == "position":
            for name in reading.LOGGING:
                yield module.TopKRouter, name, log_at_depth


FIX = MoERouterFix()
