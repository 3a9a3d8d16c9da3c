"""What the megatron-core files on disk say about the two halves of the fix, read (parsed), never run.

The probe's answer depends on three modules at once (the hybrid stack's MOE branch, the router's
logging slot, the MTP layer that would hand the router its depth), and a target's post-import hook
fires before the others may have been imported: so the files are read from the folder the probed
module was imported from, with `ast`, and nothing is imported. The patch engine reads the same
files (the declaration's Marker), so the probe and ``mtp-overlay patch`` agree on what "patched"
means.

* `stack_flag`: does the ``build_module(submodules.moe_layer, ...)`` call of ``HybridStack.__init__``
  (``models/hybrid/hybrid_block.py``, 0.18+) or ``MambaStack.__init__`` (``ssm/mamba_block.py``,
  0.17) pass ``is_mtp_layer``? (Megatron-LM PR #6748 adds it.)
* `router_slot`: does ``TopKRouter`` log an MTP layer at ``self.layer_number + self.config.num_layers``
  (stock, ``router.py:591-592`` and ``:692-693`` in 0.19.2: the layer's place in the MTP pattern,
  Megatron-LM #7172) or by the ``mtp_depth`` its MTP layer gives it (the fix's patch)?
* `mtp_branch`: does ``MultiTokenPredictionLayer.__init__`` build its inner layers as a hybrid stack
  with ``is_mtp_layer=True`` (the path the hook follows), and does it hand ``mtp_depth`` down?
"""

import ast
from pathlib import Path

DEPTH = "mtp_depth"  # the attribute an MTP block's router carries: its MTP layer's depth (layer_number)
MTP_FILE = "megatron/core/transformer/multi_token_prediction.py"
ROUTER_FILE = "megatron/core/transformer/moe/router.py"
STACKS = (("megatron/core/models/hybrid/hybrid_block.py", "HybridStack"),  # 0.18+
          ("megatron/core/ssm/mamba_block.py", "MambaStack"))  # 0.17 (a re-export of HybridStack since)
LOGGING = ("attach_and_log_load_balancing_loss", "apply_z_loss")  # TopKRouter's slot arithmetic

_trees: "dict[tuple[str, int, int], ast.Module | None]" = {}


def site_of(module: "object") -> Path:
    """The folder holding the top package of ``module`` (a plain module, not a package's __init__)."""
    path = Path(getattr(module, "__file__", None) or ".")
    return path.parents[len(getattr(module, "__name__", "").split(".")) - 1]


def tree(root: Path, relative: str) -> "ast.Module | None":
    """The parsed file ``relative`` under ``root`` (kept while its size and mtime hold), None if it
    does not exist or does not parse."""
    path = root / relative
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _trees:
        try:
            _trees[key] = ast.parse(path.read_bytes(), str(path))
        except (SyntaxError, ValueError):
            _trees[key] = None
    return _trees[key]


def method(module: "ast.Module | None", cls: str, name: str) -> "ast.FunctionDef | None":
    """The ``def name`` of top-level ``class cls`` in ``module``, or None."""
    for node in module.body if module is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    return None


def attributes(node: "ast.AST | None") -> "set[str]":
    """Every attribute name ``node`` reads or writes (``x.name``); none without a node."""
    return set() if node is None else {found.attr for found in ast.walk(node) if isinstance(found, ast.Attribute)}


def stack_init(root: Path) -> "tuple[str, str, ast.FunctionDef] | None":
    """(file, class, its ``__init__``) of the hybrid stack this release defines, or None."""
    for relative, cls in STACKS:
        init = method(tree(root, relative), cls, "__init__")
        if init is not None:
            return relative, cls, init
    return None


def stack_flag(init: ast.FunctionDef) -> "bool | None":
    """Whether every call building ``submodules.moe_layer`` in ``init`` passes ``is_mtp_layer``; None
    when there is no such call (the MOE branch changed shape)."""
    builds = [call for call in ast.walk(init) if isinstance(call, ast.Call) and call.args
              and isinstance(call.args[0], ast.Attribute) and call.args[0].attr == "moe_layer"]
    if not builds:
        return None
    return all(any(keyword.arg == "is_mtp_layer" for keyword in call.keywords) for call in builds)


def _is_position_slot(node: ast.AST) -> bool:
    """``self.layer_number + self.config.num_layers``: stock's slot of an MTP layer."""
    return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
            and isinstance(node.left, ast.Attribute) and node.left.attr == "layer_number"
            and isinstance(node.right, ast.Attribute) and node.right.attr == "num_layers"
            and isinstance(node.right.value, ast.Attribute) and node.right.value.attr == "config")


def router_slot(router: "ast.Module | None") -> "tuple[str | None, str]":
    """("position" | "depth", "") for TopKRouter's logging functions, or (None, why) when they are
    missing, disagree, or compute the slot some other way."""
    kinds: "dict[str, str]" = {}
    for name in LOGGING:
        function = method(router, "TopKRouter", name)
        if function is None:
            return None, f"TopKRouter has no {name}"
        if DEPTH in attributes(function):
            kinds[name] = "depth"
        elif any(_is_position_slot(node) for node in ast.walk(function)):
            kinds[name] = "position"
        else:
            return None, (f"TopKRouter.{name} no longer logs an MTP layer at self.layer_number + "
                          f"self.config.num_layers nor by {DEPTH}: check it against Megatron-LM #7172")
    if len(set(kinds.values())) > 1:
        return None, f"TopKRouter's logging functions disagree on the MTP slot: {kinds}"
    divides = attributes(method(router, "TopKRouter", LOGGING[0]))
    if not {"is_mtp_layer", "mtp_use_repeated_layer", "mtp_num_layers"} <= divides:
        return None, (f"TopKRouter.{LOGGING[0]} no longer divides a repeated MTP layer's loss by mtp_num_layers "
                      "on is_mtp_layer: the flag may mean something else now")
    return next(iter(kinds.values())), ""


def mtp_branch(mtp: "ast.Module | None") -> "tuple[bool, bool]":
    """(builds its inner layers as a hybrid stack with ``is_mtp_layer=True``, hands ``mtp_depth`` down)
    for ``MultiTokenPredictionLayer.__init__``."""
    init = method(mtp, "MultiTokenPredictionLayer", "__init__")
    if init is None:
        return False, False
    stacks = {cls for _, cls in STACKS}
    hybrid = any(
        isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name) and node.value.func.id in stacks
        and any(isinstance(t, ast.Attribute) and t.attr == "mtp_model_layer" for t in node.targets)
        and any(k.arg == "is_mtp_layer" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.value.keywords)
        for node in ast.walk(init)
    )
    return hybrid, DEPTH in attributes(init)
