"""Megatron-Bridge's own training step (``gpt_step.forward_step``) on the test bed, and its three MTP
defects shown on stock Bridge 0.6 (``mtp_overlay.bed.steps.bridge_step``).

The fast tests check the CPU stand-ins this needs against their references: the scoped import
stand-ins on throwaway importers and against Bridge's own import statements (read from its source),
and the ``.cuda(non_blocking=True)`` stand-in against ``Tensor.to("cpu")``. The slow ones run Bridge:
one TP1 rank run (Bridge imported once: the import facts, the SFT cases, ``mtp_num_layers: 0``, the
Omni provider's finalize, the export) and one CP2 run of the SFT cases, in the shared rank pools; the
exported config goes to vLLM's real ``NemotronHMTP`` in this process.
"""

import ast
import builtins
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from mtp_overlay.bed.steps import bridge_step
from mtp_overlay.bed.models.bridge import BRIDGE_MISSING, bridge_installed
from mtp_overlay.bed.runtime.bridge_stand_ins import (
    BRIDGE_GUARDED_IMPORTS,
    BRIDGE_TRAINING_IMPORTERS,
    bridge_training_import_stand_ins,
    cpu_batch,
)
from mtp_overlay.bed.runtime.launcher import run_ranks_checked

ROOTS = ("modelopt", "datasets", "megatron.energon", "torch.utils.tensorboard")
NEEDS = ("modelopt", "datasets", "megatron.energon", "tensorboard")  # what the real ones need
KINDS = ("qwen3", "nemotron_h")
BUILT = {"qwen3": "GPTModelProvider -> GPTModel", "nemotron_h": "HybridModelProvider -> HybridModel"}
needs_missing = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is not None for name in NEEDS if "." not in name),
    reason="an optional package the stand-ins replace is installed here",
)
needs_bridge = pytest.mark.skipif(not bridge_installed(), reason=BRIDGE_MISSING)


def under(name, roots):
    return any(name == root or name.startswith(root + ".") for root in roots)


# --- the scoped import stand-ins, on throwaway importers ------------------------------------------
IMPORTER = """
import modelopt.torch.distill as mtd
import modelopt.torch.distill.plugins.megatron as mtd_mcore
import datasets
from datasets import load_dataset
from megatron.energon import WorkerConfig, get_savable_loader
from torch.utils.tensorboard.writer import SummaryWriter

datasets.builder.has_sufficient_disk_space = lambda needed_bytes, directory=".": True


class DistillConfig(mtd_mcore.DistillationConfig):
    pass


def summary_writer() -> SummaryWriter:
    pass
"""


@pytest.fixture
def importers(tmp_path, monkeypatch):
    (tmp_path / "bridge_stand_in_importer.py").write_text(IMPORTER)
    (tmp_path / "bridge_stand_in_bystander.py").write_text("import datasets\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bridge_stand_in_importer", "bridge_stand_in_bystander"
    for name in ("bridge_stand_in_importer", "bridge_stand_in_bystander"):
        sys.modules.pop(name, None)


@needs_missing
def test_only_the_named_importers_get_the_stand_ins_and_nothing_stays(importers):
    importer, bystander = importers
    original_import = builtins.__import__
    with bridge_training_import_stand_ins(importers={importer: ROOTS}):
        module = importlib.import_module(importer)
        with pytest.raises(ModuleNotFoundError, match="datasets"):
            importlib.import_module(bystander)  # any other module still finds nothing
    assert module.mtd.__name__ == "modelopt.torch.distill"
    assert module.mtd_mcore is module.mtd.plugins.megatron
    assert not isinstance(object(), module.mtd.DistillationModel)  # no ModelOpt model exists
    assert issubclass(module.DistillConfig, module.mtd_mcore.DistillationConfig)
    assert "stand-in" in module.SummaryWriter.__doc__  # a class: the return annotation evaluated
    assert module.datasets.builder.has_sufficient_disk_space(1) is True  # gpt_sft.py:59's assignment took
    for function in (module.load_dataset, module.get_savable_loader):
        with pytest.raises(RuntimeError, match="stand-in"):
            function("anything")
    with pytest.raises(AttributeError, match="stand-in"):
        module.datasets.Dataset  # noqa: B018 - anything not given says what it is
    assert builtins.__import__ is original_import
    assert not [name for name in sys.modules if under(name, ROOTS)]
    with pytest.raises(ModuleNotFoundError, match="modelopt"):
        importlib.reload(module)  # after the block, the importer itself finds nothing


def test_an_unknown_root_is_refused_and_the_hook_goes_when_the_block_raises(importers):
    with pytest.raises(ValueError, match="no stand-in for \\['apex'\\]"):
        with bridge_training_import_stand_ins(importers={importers[0]: ("apex",)}):
            pass
    original_import = builtins.__import__
    with pytest.raises(RuntimeError, match="boom"):
        with bridge_training_import_stand_ins(importers={importers[0]: ROOTS}):
            raise RuntimeError("boom")
    assert builtins.__import__ is original_import


def top_level_imports(path):
    """{dotted module imported at the top of ``path``: guarded by a try}, from its source."""
    found = {}
    for node in ast.parse(Path(path).read_text()).body:
        guarded = isinstance(node, ast.Try)
        for statement in node.body if guarded else [node]:
            if isinstance(statement, ast.Import):
                found.update({alias.name: guarded for alias in statement.names})
            elif isinstance(statement, ast.ImportFrom) and statement.level == 0:
                found[statement.module] = guarded
    return found


@needs_bridge
def test_the_stand_in_table_is_bridges_own_unguarded_optional_imports():
    """The reference: Bridge's installed source. Each named importer imports its roots unguarded at
    module level; the two guarded importers guard theirs (so they get no stand-in)."""
    root = Path(importlib.util.find_spec("megatron.bridge").submodule_search_locations[0])

    def source(module):
        return root.joinpath(*module.split(".")[2:]).with_suffix(".py")

    for module, roots in BRIDGE_TRAINING_IMPORTERS.items():
        imports = top_level_imports(source(module))
        for stand_in in roots:
            mine = {name: guarded for name, guarded in imports.items() if under(name, [stand_in])}
            assert mine and not any(mine.values()), (module, stand_in, imports)
    guarded_roots = {"megatron.bridge.training.comm_overlap": "transformer_engine",
                     "megatron.bridge.training.nvrx_straggler": "nvidia_resiliency_ext"}
    assert set(guarded_roots) == set(BRIDGE_GUARDED_IMPORTS)
    for module, package in guarded_roots.items():
        flags = [guarded for name, guarded in top_level_imports(source(module)).items() if under(name, [package])]
        assert flags and all(flags), (module, flags)


# --- the .cuda(non_blocking=True) stand-in ---------------------------------------------------------
def test_cpu_batch_tensors_answer_cuda_as_to_cpu_does_and_nothing_else_changes():
    original = vars(torch._C.TensorBase)["cuda"]
    tensors = dict(tokens=torch.arange(8).reshape(2, 4), loss_mask=torch.ones(2, 4)[:, ::2], attention_mask=None)
    batch = cpu_batch(tensors)
    assert set(batch) == set(tensors) and batch["attention_mask"] is None
    for key in ("tokens", "loss_mask"):
        moved = batch[key].cuda(non_blocking=True)
        reference = tensors[key].to("cpu", non_blocking=True)
        assert moved is batch[key] is tensors[key] and reference is tensors[key]  # already there: itself
        assert moved.device.type == "cpu" and torch.equal(moved, reference) and moved.dtype == reference.dtype
    assert vars(torch._C.TensorBase)["cuda"] is original
    assert "cuda" not in vars(batch["tokens"][:1])  # tensors made from them are ordinary
    with pytest.raises(TypeError, match="batch\\['x'\\] must be a tensor"):
        cpu_batch(dict(x=[1, 2]))
    with pytest.raises(TypeError, match="batch must be a dict"):
        cpu_batch(torch.ones(1))


# --- the SFT batch and what its mask allows, from the batch alone ----------------------------------
def test_sft_batch_and_the_positions_its_mask_allows():
    batch = bridge_step.sft_batch()
    mask = batch["loss_mask"]
    length, prompt = bridge_step.SEQ_LENGTH, bridge_step.PROMPT_TOKENS
    assert batch["tokens"].shape == mask.shape == (bridge_step.BATCH_SIZE, length)
    for row, padding in enumerate(bridge_step.PADDING):
        real = length - padding
        assert torch.equal(batch["labels"][row, : real - 1], batch["tokens"][row, 1:real])  # label i is token i + 1
        assert mask[row].tolist() == [0] * prompt + [1] * (real - prompt) + [0] * padding
        assert set(batch["tokens"][row, real:].tolist()) <= {bridge_step.EOS_ID}
    allowed, every = bridge_step.mtp_positions(mask)
    # depth 1 at position i trains label i + 1: allowed from position prompt - 1 up to the last real label
    paddings = bridge_step.PADDING
    expected = {(row, i) for row, padding in enumerate(paddings) for i in range(prompt - 1, length - padding - 1)}
    assert set(allowed) == expected and len(allowed) == sum(length - padding - prompt for padding in paddings)
    assert len(every) == bridge_step.BATCH_SIZE * (length - 1)
    assert (len(allowed), len(every)) == (32, 62)  # the setup: 2x32 tokens, 12 prompt, 8 padding


# --- Bridge's gpt_step through Megatron's step: one TP1 run, one CP2 run ---------------------------
def tp1_worker():
    """Rank worker (TP1): Bridge's gpt_step imported here, what that left behind, and every case."""
    original_import = builtins.__import__
    gpt_step = bridge_step.import_gpt_step()
    modules = sys.modules
    stand_ins = {
        "gpt_step.mtd": gpt_step.mtd,
        "distillation.mtd_mcore": modules["megatron.bridge.training.post_training.distillation"].mtd_mcore,
        "gpt_sft.datasets": modules["megatron.bridge.data.datasets.gpt_sft"].datasets,
        "sources.hf.concatenate_datasets": modules["megatron.bridge.data.sources.hf"].concatenate_datasets,
        "energon.WorkerConfig": modules["megatron.bridge.data.energon.base_energon_datamodule"].WorkerConfig,
        "state.SummaryWriter": modules["megatron.bridge.training.state"].SummaryWriter,
    }
    later = {}
    for name in ROOTS:
        try:
            importlib.import_module(name)
            later[name] = "imported"
        except ImportError as error:
            later[name] = type(error).__name__
    facts = dict(
        left=sorted(name for name in modules if under(name, ROOTS + ("tensorboard", "transformer_engine"))),
        import_restored=builtins.__import__ is original_import,
        stand_ins={key: (getattr(value, "__module__", None) or value.__name__, "stand-in" in (value.__doc__ or ""))
                   for key, value in stand_ins.items()},
        guarded={module: getattr(modules[module], flag) for module, flag in BRIDGE_GUARDED_IMPORTS.items()},
        core_have_te=[module.HAVE_TE for name, module in list(modules.items())
                      if name.startswith("megatron.core.") and isinstance(getattr(module, "HAVE_TE", None), bool)],
        later_imports=later,
    )
    return dict(facts=facts, sft=bridge_step.sft_mtp_cases(KINDS), off=bridge_step.mtp_off_cases((0, None)),
                omni=bridge_step.omni_finalize((0, None)),
                export={finalize: bridge_step.export_case(finalize=finalize) for finalize in (True, False)})


@pytest.fixture(scope="module")
def tp1_bridge():
    return run_ranks_checked(tp1_worker, 1, fixes=[], timeout=900)[0]


@pytest.fixture(scope="module")
def cp2_bridge():
    return run_ranks_checked(bridge_step.sft_mtp_cases, 2, cp=2, args=(KINDS,), fixes=[], timeout=900)


@pytest.mark.slow
@needs_bridge
@needs_missing
def test_gpt_step_imports_through_the_scoped_stand_ins_and_leaves_no_trace(tp1_bridge):
    facts = tp1_bridge["facts"]
    assert facts["left"] == [] and facts["import_restored"]
    assert facts["stand_ins"] == {
        "gpt_step.mtd": ("modelopt.torch.distill", True),
        "distillation.mtd_mcore": ("modelopt.torch.distill.plugins.megatron", True),
        "gpt_sft.datasets": ("datasets", True),
        "sources.hf.concatenate_datasets": ("datasets", True),
        "energon.WorkerConfig": ("megatron.energon", True),
        "state.SummaryWriter": ("torch.utils.tensorboard.writer", True),
    }
    assert facts["guarded"] == dict.fromkeys(BRIDGE_GUARDED_IMPORTS, False)  # their own guards: no TE, no NVRx
    assert facts["core_have_te"] and not any(facts["core_have_te"])  # megatron-core still finds no TE
    assert facts["later_imports"] == dict.fromkeys(ROOTS, "ModuleNotFoundError")


def sft_cases(request, layout):
    """The SFT cases of a layout's run (CP: rank 0's, after checking every rank saw the same)."""
    ranks = [request.getfixturevalue(layout)["sft"]] if layout == "tp1_bridge" else request.getfixturevalue(layout)

    def seen(cases):
        return [(case.trained, case.direct_trained, case.bridge.lm_loss, case.bridge.mtp_losses) for case in cases]

    assert all(seen(rank) == seen(ranks[0]) for rank in ranks)
    return ranks[0]


@pytest.mark.slow
@needs_bridge
@needs_missing
@pytest.mark.parametrize("layout", ["tp1_bridge", "cp2_bridge"])
def test_stock_sft_step_trains_mtp_on_every_position(request, layout):
    """Bridge's forward_step never passes the batch's loss_mask (gpt_step.py:432-437): megatron-core's
    MTP loss then trains all 62 positions, prompts and padding included, where the mask allows 32;
    a direct forward of the same model with the mask trains exactly those 32. The LM loss is right."""
    cases = sft_cases(request, layout)
    assert [case.kind for case in cases] == list(KINDS)
    allowed, every = bridge_step.mtp_positions(bridge_step.sft_batch()["loss_mask"])
    for case in cases:
        assert case.layout == {"tp1_bridge": "TP1", "cp2_bridge": "CP2"}[layout]
        assert case.built == BUILT[case.kind]
        assert (case.allowed, case.every) == (allowed, every)
        assert case.direct_trained == allowed  # megatron-core with the mask: what the batch alone says
        assert case.trained == every != allowed  # stock Bridge: every position
        assert case.bridge.mtp_tokens == (len(every),) and case.direct.mtp_tokens == (len(allowed),)
        assert case.lm_loss_relerr <= 1e-6
        assert case.mtp_loss_relerr > 1e-4, case.mtp_loss_relerr
        assert case.mtp_grad_relerr > 0.1, case.mtp_grad_relerr


def assert_line(relative, text, where):
    """``where`` is "<relative>:<line>" and that line of the installed file holds ``text``."""
    path, line = where.rsplit(":", 1)
    assert path == relative, where
    package = importlib.util.find_spec(relative.split("/")[0]).submodule_search_locations[0]
    source = Path(package).parent.joinpath(relative).read_text().splitlines()
    assert text in source[int(line) - 1], (where, source[int(line) - 1])


@pytest.mark.slow
@needs_bridge
@needs_missing
def test_mtp_num_layers_0_on_a_repeated_layer_provider_builds_mtp_and_the_first_step_raises(tp1_bridge):
    """HybridModelProvider.finalize keeps max(1, mtp_num_layers or 0) copies of the MTP pattern for a
    repeated-layer provider: at 0 the model still has an MTP block and HybridModel.forward asserts
    mtp_num_layers > 0 at the first step. None means one copy (the intent of max(1, ...)) and trains."""
    off, none = tp1_bridge["off"]
    with_mtp = "*-*-" + "/" + "*-"  # bridge.tiny_hf_config's main and MTP patterns, one copy
    assert (off.requested, off.pattern, off.mtp_num_layers, off.mtp_block) == (0, with_mtp, 0, True)
    assert off.step is None and off.error.startswith("AssertionError")
    assert_line("megatron/core/models/hybrid/hybrid_model.py", "assert self.config.mtp_num_layers > 0", off.error_at)
    assert (none.requested, none.pattern, none.mtp_num_layers, none.mtp_block) == (None, with_mtp, 1, True)
    assert none.error is None and len(none.step.mtp_losses) == 1 and none.step.mtp_tokens[0] > 0
    assert none.step.update_norm > 0 and none.step.zero_grad_params == ()
    # the Omni provider's finalize validates, then runs the same HybridModelProvider.finalize
    assert tp1_bridge["omni"] == {0: (with_mtp, 0), None: (with_mtp, 1)}


@pytest.mark.slow
@needs_bridge
@needs_missing
def test_export_of_a_repeated_layer_provider_writes_the_repeats_as_the_depth(tp1_bridge):
    """megatron_to_hf_config maps mtp_num_layers to num_nextn_predict_layers whatever
    mtp_use_repeated_layer says: one shared layer applied twice is exported as two layers. Side
    finding: a provider that was not finalized has no MTP section in hybrid_layer_pattern, so the
    export drops mtp_hybrid_override_pattern (from_auto_config's conform step refills it from the
    reference config; a config built from the dict alone gets transformers' default pattern)."""
    from transformers import NemotronHConfig

    finalized, raw = tp1_bridge["export"][True], tp1_bridge["export"][False]
    reference = NemotronHConfig.from_dict(finalized.reference)
    main, mtp = reference.hybrid_override_pattern, reference.mtp_hybrid_override_pattern
    assert reference.num_nextn_predict_layers == 1
    assert finalized.provider == dict(mtp_num_layers=bridge_step.MTP_REPEATS, mtp_use_repeated_layer=True,
                                      hybrid_layer_pattern=main + f"/{mtp}" * bridge_step.MTP_REPEATS,
                                      mtp_hybrid_override_pattern=mtp)
    for case in (finalized, raw):
        assert case.exported["num_nextn_predict_layers"] == bridge_step.MTP_REPEATS
        assert case.config["num_nextn_predict_layers"] == bridge_step.MTP_REPEATS
        assert NemotronHConfig.from_dict(case.config).mtp_hybrid_override_pattern == mtp
    assert finalized.exported["mtp_hybrid_override_pattern"] == mtp
    assert raw.provider["hybrid_layer_pattern"] == main and "mtp_hybrid_override_pattern" not in raw.exported
    default = NemotronHConfig().mtp_hybrid_override_pattern
    assert default != mtp and NemotronHConfig(**raw.exported).mtp_hybrid_override_pattern == default


@pytest.mark.slow
@needs_bridge
@needs_missing
def test_vllm_nemotron_h_drafter_refuses_the_exported_config(tp1_bridge):
    """vLLM 0.33's real NemotronHMTP asserts one MTP layer (nemotron_h_mtp.py:246-249): the exported
    config of the repeated-layer model does not build; the same config with depth 1, and the
    reference it was imported from, build its one shared layer."""
    pytest.importorskip("vllm")
    finalized = tp1_bridge["export"][True]
    exported, one, reference = bridge_step.exported_drafters(
        [finalized.config, dict(finalized.config, num_nextn_predict_layers=1), finalized.reference])
    assert exported.error == "AssertionError: Only one MTP layer is supported for NemotronH-MTP"
    assert_line("vllm/model_executor/models/nemotron_h_mtp.py", "assert self.num_mtp_layers == 1", exported.error_at)
    mtp = finalized.provider["mtp_hybrid_override_pattern"]
    for built in (one, reference):
        assert built.error is None and (built.num_mtp_layers, built.pattern) == (1, mtp)
        assert built.layers == ("NemotronHMTPAttentionDecoderLayer",) * len(mtp)
