"""Scoped CPU stand-ins for Megatron-Bridge (test scaffolding; each for a block, the import ones through
`shim.scoped_import`).

Megatron-Bridge 0.6 on a machine without Transformer Engine (scoped, used by ``bed.models.bridge``):

* ``transformer_engine_import_stand_in()``: ``megatron/bridge/peft/lora_layers.py`` imports
  ``transformer_engine.pytorch`` unguarded, so ``import megatron.bridge`` fails without TE. While the
  block runs, that one import statement of that one module gets a stand-in object; every other
  importer, megatron-core's own ``HAVE_TE`` probes included, still finds no TE, and nothing enters
  ``sys.modules``.
* ``bridge_local_mtp_spec()``: ``GPTModelProvider.provide()`` builds its MTP block through
  ``gpt_provider.mtp_block_spec``, which calls ``get_gpt_mtp_block_spec(..., use_transformer_engine=True)``
  whatever the layer spec: inside the block that call builds the local (non-TE) MTP spec.
* ``bridge_training_import_stand_ins()``: ``import megatron.bridge.training.gpt_step`` needs ModelOpt,
  ``datasets``, Energon and TensorBoard at six unguarded import statements; scoped the same way.
* ``cpu_batch(batch)``: ``gpt_step.get_batch_from_iterator`` moves each batch tensor with
  ``.cuda(non_blocking=True)``: the test bed's batch tensors answer it with themselves.
"""

import contextlib
import functools
import importlib.util
import types

from .shim import Shim, scoped_import, swapped


LORA_LAYERS = "megatron.bridge.peft.lora_layers"


@contextlib.contextmanager
def transformer_engine_import_stand_in(importer=LORA_LAYERS):
    """While the block runs, ``import transformer_engine[.pytorch]`` in module ``importer`` gets a stand-in.

    The pinned Megatron-Bridge (0.6) ``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch``
    unguarded (its line 20), so ``import megatron.bridge`` fails without Transformer Engine. The
    stand-in is scoped by importer, not only by time (`shim.scoped_import`): it goes to that one
    module's import statements and to nobody else, and it never enters ``sys.modules``; so
    megatron-core's own ``HAVE_TE`` probes, some of which first run inside the same ``import
    megatron.bridge``, still find no TE. Where TE is installed this does nothing.
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        yield
        return
    package = _transformer_engine_stand_in()

    def stand_in(module_name, name, fromlist):
        module = _stand_in_module(package, name) if module_name == importer else None
        if module is None:
            return None
        # `import a.b as c` takes the top package and then its attribute; `from a.b import x` the module
        return module if fromlist else package

    with scoped_import(stand_in):
        yield


def _stand_in_module(package, name):
    """The stand-in module called ``name`` (``transformer_engine`` or a submodule of it), or None."""
    parts = name.split(".")
    if parts[0] != package.__name__:
        return None
    module = package
    for part in parts[1:]:
        module = vars(module).get(part)
        if not isinstance(module, types.ModuleType):
            return None
    return module


def _transformer_engine_stand_in():
    """``transformer_engine`` with just what lora_layers.py touches while it loads.

    ``pytorch.Linear`` / ``pytorch.LayerNormLinear`` are classes nothing is an instance of (no TE
    module exists), ``pytorch.ops.Sequential`` serves the return annotations evaluated at class
    definition; any other attribute raises AttributeError naming the stand-in.
    """

    def module(name, **attributes):
        stand_in = types.ModuleType(name, f"CPU stand-in for {name} (test scaffolding, TE is not installed)")

        def missing(attribute):
            raise AttributeError(f"{name}.{attribute}: Transformer Engine is not installed (CPU stand-in)")

        vars(stand_in).update(attributes, __getattr__=missing)
        return stand_in

    def placeholder(name):
        return type(name, (), {"__doc__": f"Stand-in for transformer_engine.pytorch {name}: never instantiated"})

    ops = module("transformer_engine.pytorch.ops", Sequential=placeholder("ops.Sequential"))
    pytorch = module(
        "transformer_engine.pytorch", Linear=placeholder("Linear"), LayerNormLinear=placeholder("LayerNormLinear"), ops=ops
    )
    return module("transformer_engine", pytorch=pytorch)


@contextlib.contextmanager
def bridge_local_mtp_spec():
    """Inside the block, ``get_gpt_mtp_block_spec`` builds the local (non-TE) MTP block spec.

    The pinned Megatron-Bridge (0.6) ``GPTModelProvider.provide()`` gets its MTP spec from
    ``gpt_provider.mtp_block_spec``, which calls ``get_gpt_mtp_block_spec(config, spec,
    use_transformer_engine=True, ...)`` whatever layer spec the provider was given; it imports that
    function when called, so swapping the megatron-core attribute is enough.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    build = gpt_layer_specs.get_gpt_mtp_block_spec

    @functools.wraps(build)
    def build_local(config, spec, use_transformer_engine=True, **kwargs):
        return build(config, spec, use_transformer_engine=False, **kwargs)

    with swapped([Shim(gpt_layer_specs, "get_gpt_mtp_block_spec", build_local)]):
        yield


BRIDGE_TRAINING_IMPORTERS = {
    "megatron.bridge.training.gpt_step": ("modelopt",),
    "megatron.bridge.training.post_training.distillation": ("modelopt",),
    "megatron.bridge.data.datasets.gpt_sft": ("datasets",),
    "megatron.bridge.data.sources.hf": ("datasets",),
    "megatron.bridge.data.energon.base_energon_datamodule": ("megatron.energon",),
    "megatron.bridge.training.state": ("torch.utils.tensorboard",),
}
# importers whose own guard (try/except) already finds the package missing: no stand-in, their
# flag stays False (training/comm_overlap.py:29-33 HAVE_TE, training/nvrx_straggler.py:38-49 HAVE_NVRX)
BRIDGE_GUARDED_IMPORTS = {
    "megatron.bridge.training.comm_overlap": "HAVE_TE",
    "megatron.bridge.training.nvrx_straggler": "HAVE_NVRX",
}


@contextlib.contextmanager
def bridge_training_import_stand_ins(importers=None):
    """While the block runs, the unguarded optional imports of Bridge's training step get stand-ins.

    ``import megatron.bridge.training.gpt_step`` (Megatron-Bridge 0.6) fails on a machine with
    neither ModelOpt, Hugging Face ``datasets``, Energon nor TensorBoard. The import statements
    that need them, each given a stand-in by `_bridge_training_stand_ins`:

    * ``training/gpt_step.py:19`` ``import modelopt.torch.distill as mtd`` (read at :562, only by
      ``forward_step_modelopt``: ``isinstance(model, mtd.DistillationModel)``);
    * ``training/post_training/distillation.py:17-18`` ``modelopt.torch.distill`` and
      ``modelopt.torch.distill.plugins.megatron``, whose ``DistillationConfig`` is subclassed at :24;
    * ``data/datasets/gpt_sft.py:23`` ``import datasets`` and :26 ``from datasets import
      load_dataset``; :59 assigns ``datasets.builder.has_sufficient_disk_space``;
    * ``data/sources/hf.py:23`` ``from datasets import concatenate_datasets, load_dataset``;
    * ``data/energon/base_energon_datamodule.py:19`` ``from megatron.energon import WorkerConfig,
      get_savable_loader, get_train_dataset``;
    * ``training/state.py:29`` ``from torch.utils.tensorboard.writer import SummaryWriter``
      (``torch/utils/tensorboard/__init__.py:1`` imports ``tensorboard``).

    Two more optional imports are guarded upstream and get none, so their flags tell the truth:
    ``training/comm_overlap.py:29-33`` (``transformer_engine``, HAVE_TE) and
    ``training/nvrx_straggler.py:38-49`` (``nvidia_resiliency_ext``, HAVE_NVRX).

    Scoped like `transformer_engine_import_stand_in`: ``builtins.__import__`` hands a stand-in only to
    the import statements of the modules named in ``importers`` (default BRIDGE_TRAINING_IMPORTERS:
    ``{importer: (dotted root, ...)}``), nothing enters ``sys.modules``, and after the block those
    packages are as missing as before. A root whose real package is importable here is left alone.
    Nothing in a stand-in does anything: its classes have no instances, its functions raise.
    """
    importers = BRIDGE_TRAINING_IMPORTERS if importers is None else importers
    stand_ins = _bridge_training_stand_ins()
    unknown = sorted({root for roots in importers.values() for root in roots} - set(stand_ins))
    if unknown:
        raise ValueError(f"importers: no stand-in for {unknown}; there are stand-ins for {sorted(stand_ins)}")
    trees = {root: tree for root, (needs, tree) in stand_ins.items() if not _importable(needs)}
    scoped = {name: {root: trees[root] for root in roots if root in trees} for name, roots in importers.items()}

    def stand_in(importer, name, fromlist):
        for root, tree in scoped.get(importer, {}).items():
            if name == root or name.startswith(root + "."):
                module = _stand_in_submodule(tree, name[len(root) :])
                if fromlist:  # `from a.b import x`: the module itself
                    return module
                if "." not in root:  # `import a.b.c [as d]`: the top package, then its attributes
                    return tree
        return None

    with scoped_import(stand_in):
        yield


def _stand_in_submodule(tree, rest):
    """The module ``rest`` (``""`` or ``".a.b"``) below the stand-in ``tree``; ModuleNotFoundError if none."""
    module = tree
    for part in filter(None, rest.split(".")):
        module = vars(module).get(part)
        if not isinstance(module, types.ModuleType):
            raise ModuleNotFoundError(f"No module named {tree.__name__ + rest!r} (not in its CPU stand-in)")
    return module


def _importable(root):
    try:
        return importlib.util.find_spec(root) is not None
    except ImportError:  # a parent package is missing or fails to import
        return False


def _stand_in_tree(name, tree, doc):
    """Module ``name`` with ``tree``'s attributes; a dict value is a submodule (built the same way).

    Any attribute not given raises AttributeError naming the stand-in."""
    module = types.ModuleType(name, doc)

    def missing(attribute):
        raise AttributeError(f"{name}.{attribute}: not installed here (test-bed CPU stand-in)")

    for key, value in tree.items():
        vars(module)[key] = _stand_in_tree(f"{name}.{key}", value, doc) if isinstance(value, dict) else value
    vars(module)["__getattr__"] = missing
    return module


def _bridge_training_stand_ins():
    """{dotted root: (the package the real one needs, stand-in module tree)} for
    `bridge_training_import_stand_ins`."""

    def placeholder(name):
        module, short = name.rsplit(".", 1)
        doc = f"CPU stand-in for {name} (test scaffolding, not installed here): never instantiated"
        return type(short, (), {"__doc__": doc, "__module__": module})

    def unavailable(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"{name}: not installed here (test-bed CPU stand-in)")

        module, call.__name__ = name.rsplit(".", 1)
        call.__qualname__, call.__module__ = call.__name__, module
        call.__doc__ = f"CPU stand-in for {name} (test scaffolding, not installed here): raises RuntimeError"
        return call

    trees = {
        "modelopt": {"torch": {"distill": {
            "DistillationModel": placeholder("modelopt.torch.distill.DistillationModel"),
            "plugins": {"megatron": {"DistillationConfig": placeholder(
                "modelopt.torch.distill.plugins.megatron.DistillationConfig")}},
        }}},
        "datasets": {
            "load_dataset": unavailable("datasets.load_dataset"),
            "concatenate_datasets": unavailable("datasets.concatenate_datasets"),
            "builder": {},  # gpt_sft.py:59 assigns builder.has_sufficient_disk_space
        },
        "megatron.energon": {
            "WorkerConfig": placeholder("megatron.energon.WorkerConfig"),
            "get_savable_loader": unavailable("megatron.energon.get_savable_loader"),
            "get_train_dataset": unavailable("megatron.energon.get_train_dataset"),
        },
        "torch.utils.tensorboard": {
            "writer": {"SummaryWriter": placeholder("torch.utils.tensorboard.writer.SummaryWriter")},
        },
    }
    # what must be importable for the real one to work (torch.utils.tensorboard is torch's, it needs tensorboard)
    needs = {"torch.utils.tensorboard": "tensorboard"}
    doc = "CPU stand-in for {} (test scaffolding: not installed here)"
    return {root: (needs.get(root, root), _stand_in_tree(root, tree, doc.format(root))) for root, tree in trees.items()}


def cpu_batch(batch):
    """``batch`` (a dict of tensors, None values kept) whose tensors answer ``.cuda(...)`` with themselves.

    Megatron-Bridge 0.6 ``get_batch_from_iterator`` (``training/gpt_step.py:266``) moves every
    tensor its data iterator yields with ``val.cuda(non_blocking=True)``. On a CPU machine the test
    bed's iterator yields tensors that carry their own ``cuda`` (an instance attribute, ahead of
    ``torch.Tensor.cuda``): it returns the tensor itself, as ``tensor.to("cpu", ...)`` would; every
    other tensor, and ``torch.Tensor.cuda`` itself, is untouched. The tensors are the caller's own
    (nothing is copied); the dict is new.
    """
    import torch

    def stays(tensor):
        def cuda(device=None, non_blocking=False, memory_format=torch.preserve_format):
            return tensor.to("cpu", non_blocking=non_blocking, memory_format=memory_format)

        tensor.cuda = cuda
        return tensor

    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict of tensors (None values allowed), got {type(batch).__name__}")
    for key, value in batch.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{key!r}] must be a tensor or None, got {type(value).__name__}")
    return {key: None if value is None else stays(value) for key, value in batch.items()}
