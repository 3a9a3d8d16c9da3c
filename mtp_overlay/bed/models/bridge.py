"""Tiny models built through real Megatron-Bridge providers, and training cases run on them.

The path Nemotron-class RL trainers take: a Hugging Face config goes through
``AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)`` and the provider's
``provide()`` builds the megatron-core model. Here the configs are tiny and written in code (no hub,
no files), the weights random from one seed on the CPU (``use_cpu_initialization``), so TP1, TP2+SP and
TP2xCP2+SP runs hold identical full weights and their losses compare.

Kinds:
* ``"qwen3"``: ``Qwen3Config`` -> ``Qwen3Bridge`` -> ``GPTModelProvider`` -> ``GPTModel``.
* ``"nemotron_h"``: ``NemotronHConfig`` -> ``NemotronHBridge`` -> ``HybridModelProvider`` ->
  ``HybridModel``, pattern ``"*-*-"`` with MTP pattern ``"*-"`` (attention and MLP layers).
* ``"nemotron_h_zoo"``: the same path for the zoo model's layers (``tiny_hybrid.ZOO_PATTERN``): Mamba
  ('M') layers through ``mamba_num_heads`` / ``mamba_head_dim`` / ``n_groups`` / ``ssm_state_size`` /
  ``chunk_size`` (the tiny mixer of ``tiny_hybrid.MAMBA_SETTINGS``, its kernels the test bed's
  stand-ins, its weights TP-independent: ``tiny_hybrid.tp_independent_mamba_weights``), MoE ('E')
  layers through the HF keys ``n_routed_experts`` (4), ``num_experts_per_tok`` (2),
  ``moe_intermediate_size`` and one shared expert (``n_shared_experts``,
  ``moe_shared_expert_intermediate_size``), and the Super recipe's MTP: MTP pattern ``"*E"`` at 2
  depths, ``mtp_use_repeated_layer`` (NemotronHBridge's default). The router is NemotronHBridge's
  (``provider_bridge``: sigmoid scores, expert bias, ``seq_aux_loss``, fp32 routing, alltoall
  dispatcher); without TE its grouped GEMM, permute fusion and shared-expert overlap (CUDA streams)
  are off, so the experts are megatron-core's SequentialMLP (``tiny_hybrid.experts_of_every_rank``).

All carry MTP through the HF key ``num_nextn_predict_layers`` (Bridge maps it to ``mtp_num_layers``).

``scatter_embedding_sequence_parallel=False`` is the setting of Bridge's multimodal models, whose
outer forward scatters the embeddings (Nemotron VL / Omni: ``NemotronVLModelProvider`` declares the
field, megatron-core's ``LLaVAModel`` builds ``HybridModel(..., scatter_embedding_sequence_parallel=False)``).
``GPTModelProvider`` has the field and passes it to ``GPTModel``; ``HybridModelProvider`` (0.6, pinned) has
no such field and builds ``HybridModel`` with its default (True), so for ``nemotron_h`` the provider is
re-declared as ``HybridModelProviderWithScatterOption``,
a subclass that adds the field the way the VL provider does and passes it to ``HybridModel`` the way
LLaVAModel does, running Bridge's own ``HybridModelProvider.provide()`` for everything else.

Without Transformer Engine (on CPU), ``provide()`` runs with local specs
(`local_gpt_layer_spec`: Bridge's ``gpt_provider.local_layer_spec``, every expert drawn on every rank; a
local hybrid stack spec), ``AttnBackend.local``, fusions off,
and the MTP spec built without TE (``bridge_stand_ins.bridge_local_mtp_spec``); with TE the providers keep
their own specs.

Importable without megatron-bridge: Bridge is imported inside the functions (``import_bridge``);
``BRIDGE_MISSING`` is the reason to skip with when ``bridge_installed()`` is False.
"""

import contextlib
import dataclasses
import functools
import importlib.util

from ..runtime.shim import Shim, swapped
from ..runtime.device import rank_device
from .tiny_hybrid import (
    ZOO_PATTERN,
    local_hybrid_stack_spec,
    tp_independent_mamba_weights,
    with_experts_of_every_rank,
)

KINDS = ("qwen3", "nemotron_h")  # dense: the kinds `Case` / `run_cases` train (tiny_gpt.train_step)
MOE_KINDS = ("nemotron_h_zoo",)  # MoE: trained through megatron_step.MegatronStep (expert-parallel grads)
BUILDABLE = KINDS + MOE_KINDS
# MTP depths when not asked for: one, or the zoo pattern's ("*E" at 2 depths, one repeated layer)
MTP_LAYERS = {"qwen3": 1, "nemotron_h": 1, "nemotron_h_zoo": ZOO_PATTERN.count("/")}
BRIDGE_MISSING = "megatron-bridge is not installed (scripts/setup.sh installs the pinned one, --no-deps)"
MTP_SCATTER_FIX = "mtp-sp-scatter"
# a fixed case's MTP loss under CP equals TP1's only with the CP loss scale fixed too
FIXES = (MTP_SCATTER_FIX, "mtp-cp-loss-scale")


def bridge_installed():
    """Whether ``megatron.bridge`` can be imported here (without importing it: that takes ~15 s)."""
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:  # no megatron namespace at all
        return False


def import_bridge():
    """``import megatron.bridge``; without Transformer Engine through the scoped TE import stand-in."""
    from ..runtime.bridge_stand_ins import transformer_engine_import_stand_in

    with transformer_engine_import_stand_in():
        import megatron.bridge
    return megatron.bridge


@contextlib.contextmanager
def import_stand_ins():
    """While the block runs, Bridge's modules import on a machine without its optional packages:
    ``import megatron.bridge`` through the scoped TE stand-in, its training step (``gpt_step``)
    through the scoped stand-ins of its optional imports (both in `bridge_stand_ins`). Where the packages
    are installed it does nothing. For code that imports Bridge's modules by name, such as a fix's
    targets (``mtp-overlay check``, the contract test)."""
    from ..runtime.bridge_stand_ins import bridge_training_import_stand_ins, transformer_engine_import_stand_in

    with transformer_engine_import_stand_in(), bridge_training_import_stand_ins():
        yield


def tiny_hf_config(kind, *, mtp_num_layers=None, vocab_size=128, hidden_size=64, max_position_embeddings=64):
    """A tiny Hugging Face config of ``kind`` (one of BUILDABLE) with ``mtp_num_layers`` MTP layers
    (None: the kind's, `MTP_LAYERS`)."""
    if kind not in BUILDABLE:
        raise ValueError(f"kind must be one of {BUILDABLE}, got {kind!r}")
    if mtp_num_layers is None:
        mtp_num_layers = MTP_LAYERS[kind]
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(
            architectures=["Qwen3ForCausalLM"],
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden_size // 4,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            num_nextn_predict_layers=mtp_num_layers,
        )
    from transformers import NemotronHConfig

    common = dict(
        architectures=["NemotronHForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_position_embeddings,
        num_nextn_predict_layers=mtp_num_layers,
    )
    if kind == "nemotron_h":
        return NemotronHConfig(**common, hybrid_override_pattern="*-*-", mtp_hybrid_override_pattern="*-")
    main, mtp = ZOO_PATTERN.split("/")[:2]
    return NemotronHConfig(
        **common,
        hybrid_override_pattern=main,
        mtp_hybrid_override_pattern=mtp,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=2 * hidden_size,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=hidden_size,
        mtp_use_repeated_layer=True,
        # the tiny Mamba mixer of tiny_hybrid.MAMBA_SETTINGS: 8 heads of 16 (d_inner 2 x hidden), 2 groups
        mamba_num_heads=2 * hidden_size // 16,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        chunk_size=8,
    )


def bridge_provider(kind, *, mtp_num_layers=None, **config_kwargs):
    """The provider Bridge makes of ``tiny_hf_config(kind, ...)``, offline, weights not loaded."""
    import_bridge()
    from megatron.bridge import AutoBridge

    config = tiny_hf_config(kind, mtp_num_layers=mtp_num_layers, **config_kwargs)
    return AutoBridge.from_hf_config(config).to_megatron_provider(load_weights=False)


def build_bridge_model(
    kind, *, seed=1234, mtp_num_layers=None, sequence_parallel=False, scatter_embedding_sequence_parallel=True,
    recipe=None,
):
    """The megatron-core model Bridge's provider builds for ``kind``, for this rank.

    Call inside ``run_ranks`` workers: TP, CP (and for MoE kinds expert) parallel sizes come from
    ``parallel_state``. fp32, no dropout. ``scatter_embedding_sequence_parallel=False`` builds a model
    whose embedding does not scatter to the sequence-parallel region (the multimodal setting, see the
    module docstring). ``recipe``: provider fields a training recipe sets after the HF import
    (``{"mtp_num_layers": 0}``, ``{"moe_aux_loss_coeff": 0.0}``), applied with the test bed's own
    overrides before ``finalize()``. The model's ``config`` is the provider.
    """
    provider = bridge_provider(kind, mtp_num_layers=mtp_num_layers)
    return build_provided(provider, seed=seed, sequence_parallel=sequence_parallel,
                          scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel, recipe=recipe)


def build_provided(provider, *, seed=1234, sequence_parallel=False, scatter_embedding_sequence_parallel=True,
                   recipe=None):
    """The model a Bridge ``provider`` (not finalized: straight from ``to_megatron_provider`` or a
    recipe) builds for this rank, with the test bed's overrides (`build_bridge_model`): this rank's
    TP / CP / PP (its stage; and, with MoE layers, expert) parallel sizes, CPU initialisation, no
    dropout, without TE local specs; ``recipe`` fields on top. A HybridModelProvider without the scatter field is
    re-declared with it (`HybridModelProviderWithScatterOption`) when the embedding must not scatter.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.process_groups_config import ProcessGroupCollection

    from ..runtime.bridge_stand_ins import bridge_local_mtp_spec

    if not isinstance(scatter_embedding_sequence_parallel, bool):
        raise TypeError(
            f"scatter_embedding_sequence_parallel must be a bool, got {scatter_embedding_sequence_parallel!r}"
        )
    overrides = dict(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages > 1:  # this rank's stage (the provider reads pre/post_process from the pipeline group)
        overrides.update(pipeline_model_parallel_size=stages, pipeline_dtype=torch.float32)
    if getattr(provider, "num_moe_experts", None):
        overrides.update(
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )
    if not scatter_embedding_sequence_parallel:
        if "scatter_embedding_sequence_parallel" not in {field.name for field in dataclasses.fields(provider)}:
            provider = _with_scatter_option(provider)
        overrides["scatter_embedding_sequence_parallel"] = False
    if not HAVE_TE:
        overrides.update(local_overrides(provider))
    clash = sorted(set(recipe or {}) & set(overrides))
    if clash:
        raise ValueError(f"recipe must not set what the test bed sets for this layout: {clash}")
    overrides.update(recipe or {})
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=overrides)
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(seed)
    with contextlib.nullcontext() if HAVE_TE else bridge_local_mtp_spec():
        model = provider.provide()
    tp_independent_mamba_weights(model, seed)  # Mamba's weights otherwise depend on the TP size
    return model.to(rank_device())


def local_overrides(provider):
    """Provider settings for a build without TE: local specs and attention, every fusion off."""
    from megatron.bridge.models import gpt_provider
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.core.transformer.enums import AttnBackend

    fusions = (
        "masked_softmax_fusion",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "cross_entropy_loss_fusion",
        "gradient_accumulation_fusion",
        "persist_layer_norm",
        "moe_permute_fusion",
        "moe_grouped_gemm",  # TE's grouped linear: megatron-core's SequentialMLP instead
        "moe_shared_expert_overlap",  # a CUDA side stream
    )
    overrides = {name: False for name in fusions}
    overrides["attention_backend"] = AttnBackend.local
    if isinstance(provider, HybridModelProvider):
        overrides["hybrid_stack_spec"] = local_hybrid_stack_spec
        overrides["first_last_layers_bf16"] = False
    else:
        overrides["transformer_layer_spec"] = local_gpt_layer_spec
    return overrides


def local_gpt_layer_spec(config):
    """Bridge's ``gpt_provider.local_layer_spec`` of ``config``, its MoE experts (if any) built by
    ``tiny_hybrid.experts_of_every_rank``: at EP2 the model holds the EP1 model's weights (the MTP
    block's layers too: Bridge builds them from this spec)."""
    import dataclasses

    from megatron.bridge.models import gpt_provider

    spec = gpt_provider.local_layer_spec(config)
    if not config.num_moe_experts:
        return spec
    mlp = with_experts_of_every_rank(spec.submodules.mlp)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


@functools.cache
def _scatter_option_provider_class():
    from megatron.bridge.models.hybrid import hybrid_provider

    @dataclasses.dataclass
    class HybridModelProviderWithScatterOption(hybrid_provider.HybridModelProvider):
        """HybridModelProvider with the ``scatter_embedding_sequence_parallel`` field of Bridge's VL
        providers, passed to ``HybridModel`` as megatron-core's LLaVAModel passes it."""

        scatter_embedding_sequence_parallel: bool = True

        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            hybrid_model = hybrid_provider.MCoreHybridModel
            hybrid_provider.MCoreHybridModel = functools.partial(
                hybrid_model, scatter_embedding_sequence_parallel=self.scatter_embedding_sequence_parallel
            )
            try:
                return super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
            finally:
                hybrid_provider.MCoreHybridModel = hybrid_model

    return HybridModelProviderWithScatterOption


def _with_scatter_option(provider):
    """``provider`` (a HybridModelProvider, not finalized) re-declared with the scatter option."""
    cls = _scatter_option_provider_class()
    names = {field.name for field in dataclasses.fields(provider)}
    extra = set(vars(provider)) - names
    if extra:
        raise ValueError(f"provider carries attributes outside its dataclass fields: {sorted(extra)}")
    return cls(**{field.name: getattr(provider, field.name) for field in dataclasses.fields(provider) if field.init})


@dataclasses.dataclass(frozen=True)
class Case:
    """One training case: ``kind`` (KINDS) on a ``tp`` x ``cp`` layout (the rest of the spawned ranks
    are data parallel, fed the same batch), sequence parallelism, the embedding's scatter setting, and
    whether the mtp-sp-scatter fix (with mtp-cp-loss-scale) is installed for it."""

    kind: str
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    scatter_embedding_sequence_parallel: bool = True
    fix: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("tp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tp > 1")

    @property
    def layout(self):
        """``"TP1"``, ``"TP2+SP"``, ``"TP2xCP2+SP"``..."""
        cp = f"xCP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}{cp}{'+SP' if self.sequence_parallel else ''}"


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """What one case gave on this rank.

    built: ``"<provider class> -> <model class>"``; embedding_scatters: the built model's
    ``embedding.scatter_to_sequence_parallel``; then either ``step`` (a ``tiny_gpt.StepResult``) or
    ``error`` (``"<type>: <message>"``) with ``error_where``, the innermost Python function it came from.
    """

    case: Case
    built: str | None = None
    embedding_scatters: bool | None = None
    step: object = None
    error: str | None = None
    error_where: str | None = None


def run_cases(cases, *, seed=1234):
    """Worker: build and train one step of each case in turn, on this rank; one CaseResult each.

    Run with ``run_ranks(fn, world_size, fixes=[])`` (its own tp/cp are replaced case by case: the
    world size must be a multiple of every case's ``tp * cp``). Each case sets up its layout's model
    parallelism, installs (``fix=True``) or removes the mtp-sp-scatter fix and is seeded alike, so the
    cases of one spawn are as independent as separate spawns while Bridge's import (~15 s a process)
    is paid once. A case that raises is recorded with its error: every rank of a layout fails at the
    same point, so the next case starts in step.
    """
    import traceback

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    import mtp_overlay

    from .tiny_gpt import make_batch, train_step

    world_size = dist.get_world_size()
    for case in cases:
        if not isinstance(case, Case):
            raise TypeError(f"cases must be Case objects, got {case!r}")
        if world_size % (case.tp * case.cp):
            raise ValueError(f"{case}: world size {world_size} is not a multiple of tp * cp = {case.tp * case.cp}")
    results = []
    for case in cases:
        if (case.tp, case.cp) != (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
        ):
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=1, context_parallel_size=case.cp
            )
        mtp_overlay.uninstall(only=FIXES)
        if case.fix:
            mtp_overlay.install(only=FIXES)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        model = build_bridge_model(
            case.kind,
            seed=seed,
            sequence_parallel=case.sequence_parallel,
            scatter_embedding_sequence_parallel=case.scatter_embedding_sequence_parallel,
        )
        built = dict(
            case=case,
            built=f"{type(model.config).__name__} -> {type(model).__name__}",
            embedding_scatters=model.embedding.scatter_to_sequence_parallel,
        )
        try:
            results.append(CaseResult(**built, step=train_step(model, make_batch())))
        except Exception as error:  # noqa: BLE001 - the stock crash is a result, not a failure
            where = traceback.extract_tb(error.__traceback__)[-1].name
            results.append(CaseResult(**built, error=f"{type(error).__name__}: {error}", error_where=where))
    return results


NVTE_BACKEND_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextlib.contextmanager
def own_attention_backend():
    """Build a model whose attention backend differs from the tiny models' in the same process.

    megatron-core records a model's attention backend in the process-wide NVTE_* variables and refuses
    a later model with another one (``LanguageModule._set_attention_backend``); Bridge's CPU build
    uses ``AttnBackend.local``, the tiny models ``auto``. The variables are put back after the build.
    """
    import os

    saved = {name: os.environ.pop(name, None) for name in NVTE_BACKEND_VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@contextlib.contextmanager
def bridge_vl_local_specs():
    """Inside the block, Megatron-Bridge 0.6's Nemotron VL and Omni providers build local specs.

    ``megatron/bridge/models/nemotron_omni/nemotron_omni_provider.py`` imports megatron-core's TE
    ``hybrid_stack_spec`` (line 23) and ``get_vit_layer_with_transformer_engine_spec`` (line 26) and
    uses them whatever the provider says (lines 309-310); the dense VL provider does the same
    (``nemotron_vl/nemotron_vl_provider.py:20,22``, used at :323-324): in the block those names are the
    test bed's local hybrid stack spec (``tiny_hybrid.local_hybrid_stack_spec()``) and megatron-core's
    ``get_vit_layer_with_local_spec``.
    """
    from megatron.bridge.models.nemotron_omni import nemotron_omni_provider
    from megatron.bridge.models.nemotron_vl import nemotron_vl_provider
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    spec = local_hybrid_stack_spec()
    with swapped([shim for module in (nemotron_omni_provider, nemotron_vl_provider) for shim in (
        Shim(module, "hybrid_stack_spec", spec),
        Shim(module, "get_vit_layer_with_transformer_engine_spec", get_vit_layer_with_local_spec),
    )]):
        yield
