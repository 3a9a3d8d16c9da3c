"""Megatron-Bridge's own training step on the test bed, and the three Bridge MTP defects it shows.

Bridge's ``megatron.bridge.training.gpt_step.forward_step`` runs through Megatron's own schedule
(``megatron_step.MegatronStep.run``: DDP, ``get_forward_backward_func()``, ``finalize_model_grads``)
on tiny models built by Bridge's providers (``bed.models.bridge``: Qwen3 -> GPTModel, NemotronH ->
HybridModel). On a CPU machine its import needs `bridge_stand_ins.bridge_training_import_stand_ins` and its
``.cuda(non_blocking=True)`` `bridge_stand_ins.cpu_batch`; its ``state`` argument is `step_state`.

The defects (Megatron-Bridge 0.6), each a function a fix's test calls with the fix off or on:

* `sft_mtp_cases`: ``gpt_step._forward_step_common`` (``training/gpt_step.py:432-437``) never passes
  the batch's ``loss_mask`` to the model, so megatron-core's ``process_mtp_loss`` trains the MTP
  head on every position (``multi_token_prediction.py:825-826``: ``ones_like``), padding and
  prompts included (Bridge issue #6103, PR #6105). Compared with the positions the mask allows,
  counted here from the batch alone, and with a direct forward of the same model given the mask.
* `export_case` / `exported_drafters`: ``NemotronHBridge.megatron_to_hf_config``
  (``models/nemotronh/nemotron_h_bridge.py:322-370``, through ``CONFIG_MAPPING``'s
  ``("num_nextn_predict_layers", "mtp_num_layers")``, ``models/conversion/model_bridge.py:478``)
  exports a repeated-layer provider's ``mtp_num_layers`` (forward repetitions of one shared layer)
  as the HF depth; vLLM 0.33's ``NemotronHMTP`` refuses anything but 1
  (``model_executor/models/nemotron_h_mtp.py:246-249``). Bridge issue #5946, PR #5948.
* `mtp_off_cases` / `omni_finalize`: ``HybridModelProvider.finalize`` (``models/hybrid/
  hybrid_provider.py:199-208``) keeps ``max(1, mtp_num_layers or 0)`` copies of the MTP pattern
  for a repeated-layer provider, so ``mtp_num_layers=0`` still builds an MTP block, and
  ``HybridModel.forward`` asserts ``mtp_num_layers > 0`` (``models/hybrid/hybrid_model.py:555``)
  at the first step. NeMo-RL PR #4003.

Call the ``*_cases`` / ``*_case`` functions inside ``run_ranks`` workers (``fixes=[]`` for stock; a
Bridge fix's name to see it on); `exported_drafters` runs where vLLM's drafter can be built
(``vllm_drafter.drafter_environment``: a process without a torch.distributed group of its own).
"""

import dataclasses

# the SFT microbatch of the defect (Bridge issue #6103's shape, scaled down): 2 rows of 32 tokens,
# the first PROMPT_TOKENS label positions of each row masked (the prompt), row 1 ending in padding
BATCH_SIZE, SEQ_LENGTH, PROMPT_TOKENS, PADDING = 2, 32, 12, (0, 8)
VOCAB_SIZE, EOS_ID = 128, 0
# the repeated-layer recipe of the export defect: one shared MTP layer applied this many times
MTP_REPEATS = 2
# Bridge's step modules whose forward_step runs _forward_step_common: gpt_step's own, and
# DeepSeek-V4's (models/deepseek/deepseek_v4_step.py:45 binds it by name; its get_batch at :149)
STEPS = {"gpt_step": "megatron.bridge.training.gpt_step",
         "deepseek_v4_step": "megatron.bridge.models.deepseek.deepseek_v4_step"}


def import_gpt_step():
    """``megatron.bridge.training.gpt_step`` (its train_utils too), with the CPU import stand-ins
    where the optional packages are missing."""
    import importlib

    from ..models.bridge import import_bridge
    from ..runtime.bridge_stand_ins import bridge_training_import_stand_ins

    import_bridge()
    with bridge_training_import_stand_ins():
        gpt_step = importlib.import_module("megatron.bridge.training.gpt_step")
        importlib.import_module("megatron.bridge.training.utils.train_utils")
    return gpt_step


def import_step(step="gpt_step"):
    """The Bridge step module ``step`` (a key of `STEPS`), imported as `import_gpt_step` does."""
    import importlib

    if step not in STEPS:
        raise ValueError(f"step must be one of {sorted(STEPS)}, got {step!r}")
    import_gpt_step()
    return importlib.import_module(STEPS[step])


def step_state(provider, *, check_for_nan_in_loss=True):
    """What ``gpt_step.forward_step`` reads of its ``state`` (Bridge's ``GlobalState``), for one model.

    ``timers``: megatron-core's ``Timers`` at log level 0 (``forward_step``'s level-2 timer is its
    dummy); ``straggler_timer``: megatron-core's ``StragglerDetector``, not configured (off);
    ``cfg.model``: the model's provider (``get_batch`` reads its pipeline layout);
    ``cfg.dataset.skip_getting_attention_mask_from_dataset=True`` (causal mask, Bridge's default);
    ``cfg.rerun_state_machine``: Bridge's defaults, the NaN check on and the spiky-loss check off
    (``RerunStateMachineConfig``, ``training/config.py:181``, from Megatron's
    ``training/config/resilience_config.py:25,28``).
    ``accumulate_flops_metadata`` writes its ``_flops_*`` counters onto the namespace.
    """
    import types

    from megatron.core.timers import Timers
    from megatron.core.utils import StragglerDetector

    cfg = types.SimpleNamespace(
        model=provider,
        dataset=types.SimpleNamespace(skip_getting_attention_mask_from_dataset=True),
        rerun_state_machine=types.SimpleNamespace(
            check_for_nan_in_loss=check_for_nan_in_loss, check_for_spiky_loss=False
        ),
    )
    return types.SimpleNamespace(timers=Timers(0, "minmax"), straggler_timer=StragglerDetector(), cfg=cfg)


def sft_batch(seed=0):
    """One SFT microbatch as Bridge's ``GPTSFTDataset.collate_fn`` makes it, full length [2, 32].

    ``tokens`` = text[:-1], ``labels`` = text[1:] (label i is token i + 1), ``loss_mask``
    label-aligned and long like the dataset's: 0 on the first PROMPT_TOKENS labels of each row and
    on padding; padding (``PADDING`` slots at the end of each row) holds EOS_ID in tokens and labels;
    ``position_ids`` count 0..31 in every row; ``attention_mask`` None (causal).
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    batch = dict(
        tokens=torch.full((BATCH_SIZE, SEQ_LENGTH), EOS_ID, dtype=torch.long),
        labels=torch.full((BATCH_SIZE, SEQ_LENGTH), EOS_ID, dtype=torch.long),
        loss_mask=torch.zeros(BATCH_SIZE, SEQ_LENGTH, dtype=torch.long),
        position_ids=torch.arange(SEQ_LENGTH).repeat(BATCH_SIZE, 1),
        attention_mask=None,
    )
    for row, padding in enumerate(PADDING):
        real = SEQ_LENGTH - padding
        text = torch.randint(1, VOCAB_SIZE, (real + 1,), generator=generator)
        batch["tokens"][row, :real], batch["labels"][row, :real] = text[:-1], text[1:]
        batch["loss_mask"][row, PROMPT_TOKENS:real] = 1
    return batch


def mtp_positions(loss_mask, depth=1):
    """From the batch alone: ((row, position), ...) that MTP depth ``depth`` may train, and every
    position it can train at all.

    Position i's depth-d head predicts token i + d + 1, which is label i + d; it is a trained target
    exactly where the label-aligned ``loss_mask[i + d]`` is 1. Without a mask every i with i + d in
    the row would count.
    """
    rows, length = loss_mask.shape
    allowed = tuple((row, i) for row in range(rows) for i in range(length - depth) if loss_mask[row, i + depth])
    every = tuple((row, i) for row in range(rows) for i in range(length - depth))
    return allowed, every


@dataclasses.dataclass(frozen=True)
class SftMtpCase:
    """One SFT microbatch through Bridge's ``forward_step`` and through a direct forward, this layout.

    layout: "TP1", "CP2", "TP2xCP2"...; built: "<provider class> -> <model class>"; step: the Bridge
    step module whose ``forward_step`` ran (`STEPS`). allowed / every:
    `mtp_positions` of the batch (depth 1). trained / direct_trained: the (row, position) pairs MTP
    depth 1 back-propagated a loss from (``packed.record_mtp``), over the full rows (CP ranks
    gathered), in Bridge's step and in the direct one. bridge / direct: the two
    ``MegatronStepResult``: Megatron's step with Bridge's ``forward_step``, and with the test bed's
    forward step that calls the model with ``labels=`` and ``loss_mask=`` the batch's.
    """

    kind: str
    layout: str
    built: str
    step: str
    allowed: tuple
    every: tuple
    trained: tuple
    direct_trained: tuple
    bridge: object
    direct: object

    @property
    def lm_loss_relerr(self):
        return abs(self.bridge.lm_loss - self.direct.lm_loss) / abs(self.direct.lm_loss)

    @property
    def mtp_loss_relerr(self):
        return abs(self.bridge.mtp_loss - self.direct.mtp_loss) / abs(self.direct.mtp_loss)

    @property
    def mtp_grad_relerr(self):
        """``|g - g_direct| / |g_direct|`` of the MTP block's finalized gradient."""
        return self.bridge.relative_error(self.direct, "mtp")


def sft_mtp_cases(kinds=("qwen3", "nemotron_h"), *, seed=1234, step="gpt_step"):
    """Worker: `sft_mtp_case` of each kind in turn on this rank's layout; one SftMtpCase each."""
    return [sft_mtp_case(kind, seed=seed, step=step) for kind in kinds]


def sft_mtp_case(kind, *, seed=1234, step="gpt_step"):
    """`SftMtpCase` of ``kind`` (``bridge.KINDS``) on this rank's TP/CP layout (no optimizer step),
    Bridge's side through the ``forward_step`` of step module ``step`` (`STEPS`).

    Each path gets its own model, built alike from ``seed`` (identical weights), and the same batch.
    """
    from megatron.core import parallel_state

    from ..models.bridge import build_bridge_model
    from .megatron_step import MegatronStep
    from ..models.packed import record_mtp

    batch = sft_batch()
    model = build_bridge_model(kind, seed=seed)
    with record_mtp(model) as records:
        bridge = run_bridge_step(model, [batch], step=step)
    bridge_trained = _trained_positions(records)
    direct_model = build_bridge_model(kind, seed=seed)
    direct_batch = dict(input_ids=batch["tokens"], labels=batch["labels"], position_ids=batch["position_ids"],
                        loss_mask=batch["loss_mask"])
    with record_mtp(direct_model) as records:
        direct = MegatronStep(direct_model, optimizer=None).step([direct_batch], update=False)
    allowed, every = mtp_positions(batch["loss_mask"])
    tp, cp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size()
    return SftMtpCase(
        kind=kind, layout="x".join(([f"TP{tp}"] if tp > 1 or cp == 1 else []) + ([f"CP{cp}"] if cp > 1 else [])),
        built=f"{type(model.config).__name__} -> {type(model).__name__}", step=step,
        allowed=allowed, every=every, trained=bridge_trained, direct_trained=_trained_positions(records),
        bridge=bridge, direct=direct,
    )


def _trained_positions(records):
    """((row, position), ...) where MTP depth 1 back-propagated a loss, over the full rows (a CP
    collective: every rank's positions, on every rank)."""
    import torch

    from ..models.packed import to_global

    if not records:
        return ()
    full = to_global(records[0]["trained"], torch.tensor([0, SEQ_LENGTH]))  # [b, s]
    return tuple((int(row), int(i)) for row, i in full.nonzero().tolist())


def bridge_microbatch(batch):
    """``batch`` as Bridge's data iterator yields it here: on CPU through `bridge_stand_ins.cpu_batch`
    (``get_batch_from_iterator`` calls ``.cuda(non_blocking=True)`` on every tensor)."""
    from ..runtime.bridge_stand_ins import cpu_batch
    from ..runtime.device import rank_device

    return cpu_batch(dict(batch)) if rank_device().type == "cpu" else dict(batch)


def run_bridge_step(model, microbatches, *, update=False, step="gpt_step"):
    """One step of Megatron's schedule with Bridge's own ``forward_step`` on ``model``: gpt_step's,
    or that of another step module of `STEPS`.

    microbatches: full-length Bridge batches (`sft_batch`'s keys); Bridge's ``get_batch`` slices
    them for CP itself. update: with megatron-core's optimizer step. Returns the MegatronStepResult.
    """
    from .megatron_step import MegatronStep

    module = import_step(step)
    from megatron.bridge.training.utils.train_utils import prepare_forward_step_func

    megatron_step = MegatronStep(model, optimizer="megatron" if update else None)
    forward_step = prepare_forward_step_func(module.forward_step, step_state(model.config))
    shape = microbatches[0]["tokens"].shape
    return megatron_step.run(forward_step, iter([bridge_microbatch(batch) for batch in microbatches]),
                             num_microbatches=len(microbatches), micro_batch_size=shape[0],
                             seq_length=shape[1], update=update)


# --- mtp_num_layers: 0 on a repeated-layer NemotronH ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MtpOffCase:
    """A repeated-layer NemotronH provider (Bridge's import of an HF config with one MTP layer sets
    ``mtp_use_repeated_layer=True``) with a recipe's ``mtp_num_layers``, finalized, built, one step.

    requested: the recipe's ``mtp_num_layers`` (0: MTP off; None: "as the pattern says").
    pattern, mtp_num_layers: the finalized provider's ``hybrid_layer_pattern`` and ``mtp_num_layers``.
    mtp_block: whether the built HybridModel has an MTP block (``mtp_process``). Then either ``step``
    (the MegatronStepResult of Bridge's forward_step through Megatron's step, optimizer included) or
    ``error`` ("<type>: <message>") with ``error_at`` ("<file below megatron/>:<line>" of the
    innermost frame).
    """

    requested: object
    pattern: str
    mtp_num_layers: object
    mtp_block: bool
    step: object = None
    error: str | None = None
    error_at: str | None = None


def mtp_off_cases(requested=(0, None), *, seed=1234):
    """Worker: one `MtpOffCase` per recipe value of ``mtp_num_layers`` (TP1; each its own model)."""
    from ..models.bridge import build_bridge_model

    cases = []
    for value in requested:
        model = build_bridge_model("nemotron_h", seed=seed, recipe={"mtp_num_layers": value})
        built = dict(requested=value, pattern=model.config.hybrid_layer_pattern,
                     mtp_num_layers=model.config.mtp_num_layers, mtp_block=bool(getattr(model, "mtp_process", False)))
        try:
            step = run_bridge_step(model, [sft_batch()], update=True)
        except Exception as error:  # noqa: BLE001 - stock's crash is the result
            cases.append(MtpOffCase(**built, error=f"{type(error).__name__}: {error}", error_at=_where(error)))
        else:
            cases.append(MtpOffCase(**built, step=step))
    return cases


def _where(error):
    """"<path from megatron/ on>:<line>" of the innermost frame of ``error``'s traceback."""
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    path = frame.filename.replace("\\", "/")
    return f"{path[path.rfind('megatron/'):] if 'megatron/' in path else path}:{frame.lineno}"


def omni_finalize(requested=(0, None)):
    """{recipe mtp_num_layers: (hybrid_layer_pattern, mtp_num_layers)} of Bridge's
    ``NemotronOmniModelProvider.finalize`` (``nemotron_omni_provider.py:235``, which validates and
    calls ``super().finalize()``) on a tiny repeated-layer provider (pattern "*-*-", MTP "*-")."""
    import torch
    from megatron.bridge.models.nemotron_omni.nemotron_omni_provider import NemotronOmniModelProvider

    from ..models.bridge import import_bridge, local_overrides

    import_bridge()
    finalized = {}
    for value in requested:
        provider = NemotronOmniModelProvider(
            hybrid_layer_pattern="*-*-", mtp_hybrid_override_pattern="*-", mtp_use_repeated_layer=True,
            mtp_num_layers=value, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=VOCAB_SIZE,
            image_token_index=1,
        )
        provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=local_overrides(provider))
        finalized[value] = (provider.hybrid_layer_pattern, provider.mtp_num_layers)
    return finalized


# --- export of a repeated-layer NemotronH to the HF config vLLM's drafter reads ------------------------
@dataclasses.dataclass(frozen=True)
class ExportCase:
    """Bridge's HF export of a repeated-layer NemotronH provider.

    The provider is Bridge's import (``AutoBridge.from_hf_config``) of vLLM's tiny NemotronH target
    (``vllm_drafter.tiny_config``: one MTP layer, pattern "*"), with the recipe's
    ``mtp_num_layers = MTP_REPEATS`` (the one shared layer applied twice), finalized or not.
    provider: its ``mtp_num_layers``, ``mtp_use_repeated_layer``, ``hybrid_layer_pattern`` and
    ``mtp_hybrid_override_pattern`` as exported. exported: ``NemotronHBridge.megatron_to_hf_config``'s
    dict. config: the HF config (``to_dict()``) ``AutoBridge.from_auto_config`` makes of it, its only
    caller (``auto_bridge.py:401-406``: conformed to the reference config, read-only properties
    dropped, built as the reference's class). reference: that reference config's ``to_dict()``.
    """

    finalized: bool
    provider: dict
    exported: dict
    config: dict
    reference: dict


def export_case(*, finalize=True):
    """`ExportCase` (any process where Bridge imports; no distributed setup needed)."""
    import torch

    from ..models.bridge import import_bridge, local_overrides
    from .vllm_drafter import tiny_config

    import_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.auto_bridge import _drop_readonly_config_properties
    from megatron.bridge.models.conversion.utils import conform_config_to_reference

    reference = tiny_config("nemotron_h")
    bridge = AutoBridge.from_hf_config(reference)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.mtp_num_layers = MTP_REPEATS
    if finalize:  # as training does (fusions off: their TE checks run in finalize)
        provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=local_overrides(provider))
    exported = bridge._model_bridge.megatron_to_hf_config(provider)
    conformed = _drop_readonly_config_properties(conform_config_to_reference(exported, reference.to_dict()),
                                                 type(reference))
    fields = ("mtp_num_layers", "mtp_use_repeated_layer", "hybrid_layer_pattern", "mtp_hybrid_override_pattern")
    return ExportCase(
        finalized=finalize, provider={name: getattr(provider, name) for name in fields}, exported=dict(exported),
        config=type(reference)(**conformed).to_dict(), reference=reference.to_dict(),
    )


@dataclasses.dataclass(frozen=True)
class DrafterOutcome:
    """vLLM's ``NemotronHMTP`` built from an HF config: its ``num_mtp_layers``, ``pattern_str`` and
    layer classes, or the ``error`` ("<type>: <message>") its construction raised, at ``error_at``."""

    num_mtp_layers: int | None = None
    pattern: str | None = None
    layers: tuple = ()
    error: str | None = None
    error_at: str | None = None


def exported_drafters(configs):
    """vLLM 0.33's real MTP drafter built from each HF config dict of ``configs`` (`ExportCase.config`):
    one `DrafterOutcome` each. Runs `vllm_drafter.drafter_environment` itself (vLLM's own
    world-size-1 group: call it outside the test bed's ranks)."""
    import traceback

    from transformers import NemotronHConfig

    from .vllm_drafter import build_drafter_of, drafter_environment

    outcomes = []
    with drafter_environment():
        for index, config in enumerate(configs):
            try:
                model = build_drafter_of(NemotronHConfig.from_dict(config), f"exported-{index}")
            except Exception as error:  # noqa: BLE001 - stock's refusal is the result
                frame = traceback.extract_tb(error.__traceback__)[-1]
                where = f"{frame.filename[frame.filename.rfind('vllm/'):]}:{frame.lineno}"
                outcomes.append(DrafterOutcome(error=f"{type(error).__name__}: {error}", error_at=where))
                continue
            predictor = model.model
            outcomes.append(DrafterOutcome(num_mtp_layers=predictor.num_mtp_layers, pattern=predictor.pattern_str,
                                           layers=tuple(type(layer).__name__ for layer in predictor.layers.values())))
    return outcomes
