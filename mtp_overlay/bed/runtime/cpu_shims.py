"""CPU shims that let stock megatron-core run an MTP GPTModel forward+backward without a GPU.

TEST SCAFFOLDING ONLY: the test bed (``mtp_overlay.bed.runtime.launcher``) installs these in its worker
processes; ``import mtp_overlay`` never imports this module, and nothing here is product behaviour.
Each shim swaps one upstream attribute; ``uninstall()`` puts every original object back.

What needs a shim on a CPU machine (megatron-core 0.19.x, local spec):

* ``torch.cuda.current_device()`` is used as a tensor device all over (RoPE, MTP tracker, CP roll
  buffers, sequence-parallel buffers): it returns the CPU device.
* Megatron's "CUDA" RNG tracker reads and writes CUDA generator states: it runs on the CPU generator.
* ``WrappedTorchNorm`` (the local-spec norm) asserts under sequence parallelism: it is built with
  sequence parallelism off and its parameters are tagged ``sequence_parallel=True``, so their
  partial gradients are all-reduced over TP like TE's norms'.
* ``HybridStack`` builds its final norm as ``TENorm`` whatever the layer spec
  (``models/hybrid/hybrid_block.py``, ``self.final_norm = TENorm(...)``): it gets ``WrappedTorchNorm``.
* The default causal mask is allocated on ``"cuda"``: it is built on the CPU.
* Megatron-LM main (d98e8a64, 2026-08-22; megatron-core 0.20.0): ``MultiTokenPredictionLayer`` asks
  ``is_inference_column_parallel_linear`` of its ``eh_proj`` (``transformer/multi_token_prediction.py:1193``),
  whose isinstance against TE-derived classes raises without TE
  (``tensor_parallel/inference_layers.py:564``): the same test over what are classes (none: False).
  Skipped on releases without that check (the pinned 0.19 and every earlier one).
* Context parallelism and packed (THD) sequences: ``DotProductAttention`` asserts that CP needs TE
  (``transformer/dot_product_attention.py`` ``__init__``) and refuses ``packed_seq_params``
  (``forward``), so under CP > 1 or with packed input it runs an exact causal attention
  (``_exact_attention``: per-sequence causal mask from the padded boundaries, the per-sequence
  2*cp-chunk layout, K/V all-gathered from the CP group, differentiable through the gather);
  RoPE's CP slicing uses ``pin_memory().cuda()`` and gets a CPU equivalent. THD RoPE
  (``rope_utils._apply_rotary_pos_emb_thd``) is plain torch and runs as it is.

Mamba ('M') layers (``mamba_shims``): megatron-core's ``MambaMixer`` needs ``mamba_ssm``'s Triton
kernels, which do not run on a CPU, and refuses to build without them (``ssm/mamba_mixer.py:202``).
Pure-torch stand-ins, each checked against a reference written from the equations
(tests/testbed/test_mamba_stand_ins.py), take the names ``mamba_mixer`` looks the kernels up by:
``mamba_split_conv1d_scan_combined`` (the training step's fused depthwise causal conv + Mamba-2 SSD
chunked scan, with per-sequence resets from ``seq_idx``), ``mamba_chunk_scan_combined`` (the unfused
path's scan), the gated ``RMSNormGated``; plus the version answers a packed step asks for and, for
packed rows under CP, TE's ``thd_get_partitioned_indices``. No module is faked in ``sys.modules``.

MoE's alltoall token dispatcher (megatron-core 0.19 ``transformer/moe/token_dispatcher.py``; the
allgather dispatcher needs none of these):

* ``MoEAlltoAllTokenDispatcher.__init__`` creates the class attribute ``cuda_dtoh_stream`` with
  ``torch.cuda.Stream()`` when it is None (``token_dispatcher.py:468-469``): it is set beforehand to a
  host stream whose ``wait_stream`` and ``record_event().synchronize()`` do nothing (CPU copies are
  synchronous).
* ``_maybe_dtoh_and_synchronize`` enters ``torch.cuda.stream(self.cuda_dtoh_stream)``
  (``token_dispatcher.py:925``): no stand-in, torch's ``StreamContext`` already does nothing where
  no CUDA device is available (torch 2.14 ``torch/cuda/__init__.py``, ``StreamContext.__enter__``
  returns at device index -1).
* It then moves the all-to-all split sizes to the host with
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts CUDA tensors only
  (``moe_utils.py:1184-1187``): a split tensor already on the host stays a tensor, and gloo's
  ``all_to_all_single`` refuses tensors as split sizes (TypeError). The dispatcher's name for it
  (``token_dispatcher.maybe_move_tensor_to_cpu``) converts host tensors too, as upstream converts
  device ones; every other call is upstream's function.

Megatron-Bridge 0.6 on a machine without Transformer Engine (scoped, used by ``bed.models.bridge``):

* ``transformer_engine_import_stand_in()``: ``megatron/bridge/peft/lora_layers.py`` imports
  ``transformer_engine.pytorch`` unguarded, so ``import megatron.bridge`` fails without TE. While the
  block runs, that one import statement of that one module gets a stand-in object; every other
  importer, megatron-core's own ``HAVE_TE`` probes included, still finds no TE, and nothing enters
  ``sys.modules``.
* ``bridge_vl_clip_vision(substituted)``: the RADIO ViT those providers build runs images only through
  its dynamic-resolution packed (THD, non-causal) attention, which has no CPU stand-in: inside the
  block their ``LLaVAModel(...)`` call gets a one-layer CLIP ViT instead (`CLIP_VISION`), every other
  argument as Bridge passes it (used by ``bed.models.tiny_llava.build_bridge_vl``).
* ``bridge_local_mtp_spec()``: ``GPTModelProvider.provide()`` builds its MTP block through
  ``gpt_provider.mtp_block_spec``, which calls ``get_gpt_mtp_block_spec(..., use_transformer_engine=True)``
  whatever the layer spec: inside the block that call builds the local (non-TE) MTP spec.
* ``bridge_training_import_stand_ins()``: ``import megatron.bridge.training.gpt_step`` needs ModelOpt,
  ``datasets``, Energon and TensorBoard at six unguarded import statements; scoped the same way.
* ``cpu_batch(batch)``: ``gpt_step.get_batch_from_iterator`` moves each batch tensor with
  ``.cuda(non_blocking=True)``: the test bed's batch tensors answer it with themselves.

megatron-core's LLaVAModel (scoped to its construction, used by ``bed.models.tiny_llava``):

* ``llava_construction_stand_ins()``: CLIPViTModel's norm fallback without TE
  (``models/vision/clip_vit_model.py:20-22``) gets ``WrappedTorchNorm``, its ``.cuda()`` (``:124``)
  stays on the CPU, and LLaVAModel's TE-version assert for CP (``models/multimodal/llava_model.py:211``)
  is answered as TE 1.10 would (the exact CP attention below stands in for TE's).

Megatron's own training step (``mtp_overlay.bed.steps.megatron_step``):

* DistributedDataParallel's gradient sync orders itself against ``torch.cuda.current_stream()``:
  it gets a stream whose waits are no-ops (CPU work is synchronous).
* The pipeline schedules allocate their token counter with ``torch.zeros(..., device="cuda")``, the
  FP32 optimizer its loss scale with ``torch.tensor(..., device="cuda")``, the gradient-norm code its
  accumulators the same way: those three modules see a ``torch`` whose tensor factories build on the
  CPU when asked for ``"cuda"``; the gradient norm's multi-tensor L2 norm (megatron-core's local
  fallback returns it on "cuda") runs on the CPU. (Gradient clipping itself asserts CUDA tensor
  types: the test bed's optimizer does not clip.)

Pipeline parallelism (PP > 1, ``mtp_overlay.bed.models.pipeline``):

* The pipeline schedule's point-to-point exchanges call ``torch.cuda.synchronize()`` after their
  requests completed (``pipeline_parallel/p2p_communication.py:263`` after the shape exchange of
  ``variable_seq_lengths``, ``:419`` after every exchange with ``batch_p2p_comm`` and
  ``batch_p2p_sync``, the defaults): that module sees a ``torch.cuda`` whose ``synchronize`` returns
  at once (gloo's requests were waited on; CPU work is synchronous).
* A stage that holds a copy of the word embeddings (the last one, for MTP or tied output weights)
  zeroes it and all-reduces the first stage's values into it after ``weight.data.cuda()``
  (``models/common/language_module/language_module.py:307``, in ``setup_embeddings_and_output_layer``):
  during that method ``Tensor.cuda`` leaves a tensor where it is.

vLLM's weight-transfer engines (scoped, used by ``bed.steps.vllm_worker``):

* ``accelerator_synchronize_stand_in()``: ``WeightTransferEngine.update_weights`` ends with
  ``torch.accelerator.synchronize()`` (vLLM 0.33 ``distributed/weight_transfer/base.py:598``,
  0.25.1 ``:182``), which raises "Found no NVIDIA driver" on a machine without one: inside the block
  it returns at once (host copies are done when they return), and only while no accelerator exists.
"""

import builtins
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import types

from .device import rank_device

_saved = []  # (owner, attribute, original vars() entry), in install order


@dataclasses.dataclass(frozen=True)
class Shim:
    owner: object
    attribute: str
    replacement: object


def installed():
    """Whether the CPU shims are installed in this process."""
    return bool(_saved)


def install():
    """Install every CPU shim (idempotent). Imports torch and megatron-core."""
    if _saved:
        return
    for shim in shims():
        _saved.append((shim.owner, shim.attribute, vars(shim.owner)[shim.attribute]))
        setattr(shim.owner, shim.attribute, shim.replacement)


def uninstall():
    """Restore every original object the shims replaced (idempotent)."""
    while _saved:
        owner, attribute, original = _saved.pop()
        setattr(owner, attribute, original)


def original(owner, attribute):
    """The upstream object an installed shim replaced at ``owner.attribute`` (KeyError if none did):
    what a test puts back (`swapped`) to show that a stand-in is needed."""
    for saved_owner, saved_attribute, value in _saved:
        if saved_owner is owner and saved_attribute == attribute:
            return value
    raise KeyError(f"no installed CPU shim replaces {getattr(owner, '__name__', owner)}.{attribute}")


@contextlib.contextmanager
def cpu_shims():
    """``with cpu_shims(): ...`` runs the block with the shims installed, restoring them after."""
    already = installed()
    install()
    try:
        yield
    finally:
        if not already:
            uninstall()


def shims():
    """The list of Shim (owner, attribute, replacement); each call builds fresh replacements."""
    import torch
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import dot_product_attention, torch_norm, utils

    norm_new = vars(torch_norm.WrappedTorchNorm)["__new__"].__func__
    attention = dot_product_attention.DotProductAttention
    attention_init = vars(attention)["__init__"]
    attention_forward = vars(attention)["forward"]

    def new_norm(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return norm_new(cls, config, hidden_size, eps, **kwargs)
        config.sequence_parallel = False
        try:
            norm = norm_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    def init_attention(self, config, *args, **kwargs):
        cp_size = config.context_parallel_size
        config.context_parallel_size = 1  # the upstream assert: CP needs TEDotProductAttention
        try:
            attention_init(self, config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp_size
        self.cpu_shim_cp_group = None
        if cp_size > 1:
            from megatron.core import parallel_state

            group = getattr(kwargs.get("pg_collection"), "cp", None)
            if group is None:
                group = parallel_state.get_context_parallel_group()
            self.cpu_shim_cp_group = group

    def forward_attention(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        arguments = (query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if getattr(self, "cpu_shim_cp_group", None) is None and packed_seq_params is None:
            return attention_forward(self, *arguments)
        return _exact_attention(self, *arguments)

    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    def set_rng_state(new_state, *args, **kwargs):
        torch.set_rng_state(new_state)

    hybrid = [Shim(module, "TENorm", torch_norm.WrappedTorchNorm) for module in _hybrid_block()]
    moe = _alltoall_dispatcher_shims()
    main = [
        Shim(module, "is_inference_column_parallel_linear", _is_inference_column_parallel_linear)
        for module in _having("megatron.core.transformer.multi_token_prediction", "is_inference_column_parallel_linear")
    ]
    return hybrid + main + moe + mamba_shims() + [
        Shim(torch.cuda, "current_device", _cpu_device),
        Shim(random, "_get_cuda_rng_state", get_rng_state),
        Shim(random, "_set_cuda_rng_state", set_rng_state),
        Shim(random.CudaRNGStatesTracker, "add", _add_cpu_rng_state),
        Shim(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new_norm)),
        Shim(utils, "get_default_causal_mask", _causal_mask),
        Shim(fused_softmax, "get_default_causal_mask", _causal_mask),
        Shim(attention, "__init__", init_attention),
        Shim(attention, "forward", forward_attention),
        Shim(rope_utils, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank),
        Shim(rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank),
        Shim(yarn_rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank),
        Shim(torch.cuda, "current_stream", _cpu_stream),
        Shim(schedules, "torch", _CpuTensorFactories()),
        Shim(optimizer, "torch", _CpuTensorFactories()),
        Shim(clip_grads, "torch", _CpuTensorFactories()),
        Shim(clip_grads, "l2_norm_impl", _cpu_l2_norm),
        Shim(p2p_communication, "torch", _CpuSynchronizeTorch()),
        Shim(LanguageModule, "setup_embeddings_and_output_layer",
             _cuda_keeps_tensors_in_place(vars(LanguageModule)["setup_embeddings_and_output_layer"])),
    ]


def _alltoall_dispatcher_shims():
    """The two stand-ins of MoE's alltoall dispatcher (module docstring), or [] on releases whose
    dispatcher lacks the attributes they replace."""
    dispatcher = _having("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu")
    if not dispatcher or "cuda_dtoh_stream" not in vars(dispatcher[0].MoEAlltoAllTokenDispatcher):
        return []
    module = dispatcher[0]
    return [
        Shim(module.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _CpuStream()),
        Shim(module, "maybe_move_tensor_to_cpu", functools.partial(_to_host, module.maybe_move_tensor_to_cpu)),
    ]


def _to_host(upstream, tensor, as_numpy=False, record_stream=False):
    """``moe_utils.maybe_move_tensor_to_cpu`` where tensors already live on the host.

    Upstream (``moe_utils.py:1184-1187``) converts a CUDA tensor to a host tensor, or with
    ``as_numpy=True`` to its numpy array, and returns anything else as it is. On a CPU the split
    sizes of the alltoall dispatcher are host tensors from the start, so a host tensor asked for
    ``as_numpy`` becomes its numpy array here, as a device tensor would upstream; everything else is
    ``upstream``'s call.
    """
    import torch

    if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
        return tensor.numpy()
    return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)


def _hybrid_block():
    """[megatron.core.models.hybrid.hybrid_block], or [] on releases without HybridModel (< 0.18)."""
    try:
        from megatron.core.models.hybrid import hybrid_block
    except ImportError:
        return []
    return [hybrid_block]


def _having(module_name, attribute):
    """[module ``module_name``] if it imports and has ``attribute``, else []: a shim for one upstream
    line is skipped on the releases that lack that line."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    return [module] if attribute in vars(module) else []


def _is_inference_column_parallel_linear(module):
    """Megatron-LM main (d98e8a64) ``is_inference_column_parallel_linear`` without Transformer Engine.

    ``tensor_parallel/inference_layers.py:564`` calls ``isinstance(module, (InferenceColumnParallelLinear,
    InferenceLayerNormColumnParallelLinear))``; without TE those subclass ``extensions/transformer_engine.py``'s
    ``te = MagicMock()`` (line 84), so they are MagicMock instances, not classes, and the isinstance raises
    TypeError. ``MultiTokenPredictionLayer.__init__`` (``transformer/multi_token_prediction.py:1193``, and
    line 1243) asks it of every MTP layer. The same test over the two names that are classes: no module is
    an instance of a TE layer that does not exist, so here it answers False.
    """
    from megatron.core.tensor_parallel import inference_layers

    names = ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear")
    classes = tuple(found for found in (getattr(inference_layers, name) for name in names) if isinstance(found, type))
    return isinstance(module, classes)


def _cpu_device():
    import torch

    return torch.device("cpu")


class _CpuStream:
    """The current "CUDA" stream on a CPU: work is synchronous, so there is nothing to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _CpuEvent()


class _CpuEvent:
    """An event recorded on a `_CpuStream`: already complete."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _cpu_stream(device=None):
    return _CpuStream()


class _CpuTensorFactories(types.ModuleType):
    """``torch`` as one upstream module sees it: a factory asked for device "cuda" builds on the CPU.

    Everything else is torch's own attribute (looked up on each access).
    """

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def _on_cpu(factory, args, kwargs):
        import torch

        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return factory(*args, **kwargs)

    def zeros(self, *args, **kwargs):
        import torch

        return self._on_cpu(torch.zeros, args, kwargs)

    def ones(self, *args, **kwargs):
        import torch

        return self._on_cpu(torch.ones, args, kwargs)

    def empty(self, *args, **kwargs):
        import torch

        return self._on_cpu(torch.empty, args, kwargs)

    def tensor(self, *args, **kwargs):
        import torch

        return self._on_cpu(torch.tensor, args, kwargs)


class _CpuSynchronizeTorch(types.ModuleType):
    """``torch`` as ``pipeline_parallel/p2p_communication.py`` sees it: its ``cuda`` is `_CpuSynchronizeCuda`.

    Everything else is torch's own attribute (looked up on each access).
    """

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuSynchronizeCuda()

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)


class _CpuSynchronizeCuda(types.ModuleType):
    """``torch.cuda`` whose ``synchronize()`` returns at once: on the CPU there is no device queue to
    drain, and p2p_communication.py waits on every gloo request before it synchronizes."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        import torch

        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device=None):
        pass


def _cuda_keeps_tensors_in_place(method):
    """``method`` run with ``Tensor.cuda`` returning the tensor itself (see the module docstring)."""

    @functools.wraps(method)
    def run_on_cpu(self, *args, **kwargs):
        import torch

        def stay(tensor, *args, **kwargs):
            return tensor

        own = vars(torch.Tensor).get("cuda")  # None: torch.Tensor inherits torch._C.TensorBase's
        torch.Tensor.cuda = stay
        try:
            return method(self, *args, **kwargs)
        finally:
            if own is None:
                del torch.Tensor.cuda
            else:
                torch.Tensor.cuda = own

    return run_on_cpu


def _cpu_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's multi-tensor L2 norm contract: (norm of all tensors as a [1] tensor, None)."""
    import torch

    norms = [torch.linalg.vector_norm(tensor.float()) for tensors in tensor_lists for tensor in tensors]
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    return total.reshape(1), None


def _add_cpu_rng_state(self, name, seed):
    """CudaRNGStatesTracker.add on the CPU: a named generator state seeded with ``seed``."""
    import torch

    if seed in self.seeds_:
        raise ValueError(f"RNG seed {seed} already exists")
    if name in self.states_:
        raise ValueError(f"RNG state {name!r} already exists")
    self._is_initialized = True
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def _causal_mask(sq):
    import torch

    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """RoPE slice of this CP rank: chunks r and 2*cp-1-r of 2*cp, on the embedding's own device."""
    import torch

    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    size, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * size, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=seq_dim)


def _gather_sequence(tensor, group):
    """All-gather ``tensor`` along dim 0 over ``group`` (rank order), differentiably."""
    return _gather_function().apply(tensor, group)


@functools.cache
def _gather_function():
    import torch
    import torch.distributed as dist

    class GatherSequence(torch.autograd.Function):
        @staticmethod
        def forward(ctx, local, group):
            ctx.group = group
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            return torch.cat(parts, dim=0)

        @staticmethod
        def backward(ctx, grad):
            # every rank's loss saw every rank's slice: sum the gradients, keep our own slice
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad.chunk(dist.get_world_size(ctx.group), dim=0)[dist.get_rank(ctx.group)], None

    return GatherSequence


def _exact_attention(
    self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
):
    """Exact causal attention for what the local DotProductAttention refuses: CP > 1 and packed THD.

    Stands in for TEDotProductAttention's CP ring and varlen (THD) kernels. Every token gets a
    sequence id and a position in the full (CP-gathered) row: from the padded boundaries
    ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) of packed input, or one sequence per BSHD row,
    and under CP from the per-sequence 2*cp-chunk layout (``mtp_overlay.mtp.cp_local_indices``). A
    query attends to the keys of its own sequence at or before its position, over K/V all-gathered
    from the CP group (differentiably), in one masked softmax. Padding slots form the tail of their
    sequence, so real tokens never attend to them. query/key/value: BSHD [s, b, heads, dim], THD
    [t, heads, dim]; grouped-query attention repeats K/V heads.
    """
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    if attention_mask is not None or attention_bias is not None:
        raise NotImplementedError("CPU attention shim: attention_mask and attention_bias must be None (causal only)")
    if (attn_mask_type or self.attn_mask_type) not in (AttnMaskType.causal, AttnMaskType.padding_causal):
        raise NotImplementedError("CPU attention shim supports causal self-attention only")
    group = self.cpu_shim_cp_group
    rank, size = (0, 1) if group is None else (group.rank(), group.size())
    thd = packed_seq_params is not None
    if thd:
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(
                f"CPU attention shim: packed qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}"
            )
        boundaries = _self_attention_boundaries(packed_seq_params)
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)  # [t, 1, heads, dim]
    else:
        boundaries = torch.tensor([0, query.size(0) * size])
    boundaries = boundaries.to(device=query.device, dtype=torch.int64)
    if int(boundaries[-1]) != query.size(0) * size:
        raise ValueError(
            f"packed_seq_params: the (padded) boundaries end at {int(boundaries[-1])}, but this CP rank holds "
            f"{query.size(0)} of {size} ranks' tokens ({query.size(0) * size} in all)"
        )

    if group is not None:
        key, value = _gather_sequence(key, group), _gather_sequence(value, group)
    repeat = query.size(2) // key.size(2)  # grouped-query attention
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)

    query_index = _row_positions(boundaries, query.size(0), size, rank)  # positions in the full packed row
    key_index = torch.cat([_row_positions(boundaries, query.size(0), size, r) for r in range(size)])
    query_sequence = torch.searchsorted(boundaries, query_index, right=True)
    key_sequence = torch.searchsorted(boundaries, key_index, right=True)
    allowed = (key_sequence[None, :] == query_sequence[:, None]) & (key_index[None, :] <= query_index[:, None])

    scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
    scores = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float()) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1).to(query.dtype)
    probs = self.attention_dropout(probs)
    context = torch.einsum("bnst,tbnd->sbnd", probs, value)
    if thd:  # TE's THD output: [t, heads * dim]
        return context.reshape(query.size(0), self.hidden_size_per_partition)
    return context.reshape(query.size(0), query.size(1), self.hidden_size_per_partition)


def _row_positions(boundaries, local_length, cp_size, cp_rank):
    """Full-row positions of CP rank ``cp_rank``'s ``local_length`` slots (the 2*cp-chunk layout of
    ``mtp_overlay.mtp.cp_local_indices``), computed on the device without a host read, as TE's
    kernels do: the test bed's own checks stay its own in a sync count (`syncs`)."""
    from ...mtp.packing import slot_geometry

    geometry = slot_geometry(boundaries, local_length, cp_size, cp_rank)
    return boundaries[geometry.sequence] + geometry.position


def _self_attention_boundaries(packed_seq_params):
    """The padded query boundaries of packed self-attention (ValueError if K/V's differ)."""
    import torch

    def pick(padded, real):
        return padded if padded is not None else real

    query = pick(packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q)
    key = pick(packed_seq_params.cu_seqlens_kv_padded, packed_seq_params.cu_seqlens_kv)
    if query is None:
        raise ValueError("packed_seq_params: cu_seqlens_q (or cu_seqlens_q_padded) is required for THD attention")
    if key is not None and not torch.equal(torch.as_tensor(key).long(), torch.as_tensor(query).long()):
        raise ValueError(
            f"packed_seq_params: self-attention needs the same K/V and query boundaries, got "
            f"{torch.as_tensor(query).tolist()} and {torch.as_tensor(key).tolist()}"
        )
    return torch.as_tensor(query)


# --- Mamba ('M') layers: pure-torch stand-ins for the mamba_ssm / causal_conv1d kernels ----------------

MAMBA_MIXER = "megatron.core.ssm.mamba_mixer"
MAMBA_CONTEXT_PARALLEL = "megatron.core.ssm.mamba_context_parallel"
# the releases the stand-ins answer for in megatron-core's version checks: the first mamba_ssm and
# causal_conv1d whose kernels take ``seq_idx`` (what ``_check_mamba_sequence_packing_support`` asks
# of a packed training step, ``ssm/mamba_mixer.py:1500-1501``); its inference minimums are higher
MAMBA_STAND_IN_VERSIONS = {"mamba_ssm": "2.0.0", "causal_conv1d": "1.4.0"}
# the names a training step looks up in mamba_mixer; a release that does not define them all without
# mamba_ssm (0.16.1 leaves the scan functions undefined) gets no Mamba stand-in at all
MAMBA_KERNEL_NAMES = ("HAVE_MAMBA_SSM", "mamba_split_conv1d_scan_combined", "RMSNormGated", "ExtendedRMSNorm")
# Transformer Engine release whose ``thd_get_partitioned_indices`` the THD CP stand-in answers for
# (``ssm/mamba_context_parallel.py:377,415`` ask for at least this one)
TE_THD_STAND_IN_VERSION = "1.10.0"


def mamba_shims():
    """The Shims that let megatron-core's own MambaMixer/MambaLayer train without mamba_ssm.

    megatron-core's ``ssm/mamba_mixer.py`` imports the kernels inside ``try`` (lines 61-93): without
    ``mamba_ssm`` it sets ``HAVE_MAMBA_SSM = False``, the kernel names to None, ``RMSNormGated`` to a
    MagicMock and builds ``ExtendedRMSNorm`` on that mock (line 111); ``MambaMixer.__init__`` then
    raises ImportError (line 202). The stand-ins are put on those module attributes while the shims
    are installed, and only there: no ``mamba_ssm`` or ``causal_conv1d`` module is created, nothing
    enters ``sys.modules``, and ``uninstall()`` restores every original (flag, None, mock). Replaced:

    * ``HAVE_MAMBA_SSM`` (line 75/93, read at line 202): True.
    * ``mamba_split_conv1d_scan_combined`` (line 72; the training step calls it, line 755):
      `mamba_split_conv1d_scan_combined` below.
    * ``mamba_chunk_scan_combined`` (line 71; the unfused path, ``use_mamba_mem_eff_path=False``,
      line 1063): `mamba_chunk_scan_combined`.
    * ``RMSNormGated`` / ``ExtendedRMSNorm`` (lines 69, 111; built at line 417, called at 779 and
      1093): `rms_norm_gated` (upstream's ExtendedRMSNorm only adds a checkpoint sharding method).
    * ``is_mamba_min_version`` / ``is_causal_conv1d_min_version`` as mamba_mixer sees them (lines
      1502-1505, packed rows): answer for ``MAMBA_STAND_IN_VERSIONS``.
    * THD under context parallelism, ``ssm/mamba_context_parallel.py``: its ``tex`` (line 24, TE's
      torch extension) gets `thd_get_partitioned_indices` alone, its ``is_te_min_version`` answers
      for ``TE_THD_STAND_IN_VERSION``.

    Left as they are: ``causal_conv1d_fn`` (None: the unfused path runs upstream's own
    ``F.conv1d``, line 914 through ``mamba_context_parallel.py:213``), the dynamic-inference
    kernels (megatron-core's own Triton ops) and ``MAMBA_HAS_STATE_DTYPE`` (False: no
    ``state_dtype`` argument). [] where the module does not import or real mamba_ssm kernels are
    installed (``HAVE_MAMBA_SSM`` already True), and where megatron-core leaves one of
    ``MAMBA_KERNEL_NAMES`` undefined without mamba_ssm (a half stand-in would build a mixer that fails
    mid-step; stock's refusal is clearer).
    """
    try:
        mixer = importlib.import_module(MAMBA_MIXER)
    except ImportError:
        return []
    defined = vars(mixer)
    if defined.get("HAVE_MAMBA_SSM", True) or not all(name in defined for name in MAMBA_KERNEL_NAMES):
        return []
    norm = rms_norm_gated()
    wanted = {
        "HAVE_MAMBA_SSM": True,
        "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
        "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
        "RMSNormGated": norm,
        "ExtendedRMSNorm": norm,
        "is_mamba_min_version": functools.partial(_stand_in_version_at_least, MAMBA_STAND_IN_VERSIONS["mamba_ssm"]),
        "is_causal_conv1d_min_version": functools.partial(
            _stand_in_version_at_least, MAMBA_STAND_IN_VERSIONS["causal_conv1d"]
        ),
    }
    shims = [Shim(mixer, name, value) for name, value in wanted.items() if name in defined]
    for context_parallel in _having(MAMBA_CONTEXT_PARALLEL, "tex"):
        if vars(context_parallel)["tex"] is None and "is_te_min_version" in vars(context_parallel):
            shims += [
                Shim(context_parallel, "tex", _thd_partitioning_stand_in()),
                Shim(context_parallel, "is_te_min_version",
                     functools.partial(_stand_in_version_at_least, TE_THD_STAND_IN_VERSION)),
            ]
    return shims


def _stand_in_version_at_least(stand_in, version, check_equality=True):
    """megatron-core's ``is_*_min_version(version, check_equality)`` for a stand-in of release ``stand_in``."""
    from packaging.version import Version

    return Version(stand_in) >= Version(version) if check_equality else Version(stand_in) > Version(version)


def _thd_partitioning_stand_in():
    """``transformer_engine_torch`` as ``mamba_context_parallel`` uses it: `thd_get_partitioned_indices`
    only; any other attribute raises AttributeError naming the stand-in."""
    stand_in = types.ModuleType("transformer_engine_torch", "CPU stand-in: thd_get_partitioned_indices only")

    def missing(attribute):
        raise AttributeError(
            f"transformer_engine_torch.{attribute}: Transformer Engine is not installed (CPU stand-in)"
        )

    vars(stand_in).update(thd_get_partitioned_indices=thd_get_partitioned_indices, __getattr__=missing)
    return stand_in


def thd_get_partitioned_indices(cu_seqlens, total_tokens, cp_size, cp_rank):
    """Stand-in for TE's ``tex.thd_get_partitioned_indices`` (``ssm/mamba_context_parallel.py:392,430``).

    The positions of a packed row of ``total_tokens`` slots that CP rank ``cp_rank`` holds: chunks r
    and 2*cp-1-r of each padded sequence (``cu_seqlens``, each length a multiple of 2*cp), in that
    order: the layout the test bed's CP sharding uses (``mtp_overlay.mtp.cp_local_indices``).
    """
    import torch

    if total_tokens % cp_size:
        raise ValueError(f"total_tokens={total_tokens} is not a multiple of cp_size={cp_size}")
    cu = torch.as_tensor(cu_seqlens).to(torch.int64)
    return _row_positions(cu, total_tokens // cp_size, cp_size, cp_rank)


def mamba_split_conv1d_scan_combined(
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
    dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
    rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
):
    """Stand-in for ``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined``.

    What megatron-core's training step calls (``ssm/mamba_mixer.py:755``): ``zxbcdt`` [b, l,
    2*d + 2*g*n + h] (d = h * headdim) splits into the gate z [b, l, d], the conv input xBC [b, l,
    d + 2*g*n] and dt [b, l, h]; xBC goes through the depthwise causal conv (`causal_conv1d_fn`,
    ``conv1d_weight`` [d + 2*g*n, w], its activation) and splits into x, B, C; the SSD scan
    (`mamba_chunk_scan_combined`, ``dt_softplus=True``, ``D``, ``dt_bias``, ``seq_idx``) gives y,
    gated by silu(z). Returns y [b, l, d]. ``D``: [h] (``headdim`` given) or [h, headdim].
    ``norm_before_gate`` only matters with ``rmsnorm_weight``; megatron-core never passes that,
    ``outproj_*`` or ``return_final_states`` (it applies its own norm and out_proj): refused.
    """
    import torch

    for name, value in (("rmsnorm_weight", rmsnorm_weight), ("outproj_weight", outproj_weight),
                        ("outproj_bias", outproj_bias)):
        if value is not None:
            raise NotImplementedError(f"mamba_split_conv1d_scan_combined stand-in: {name} is not supported "
                                      "(megatron-core's training step passes None)")
    if return_final_states:
        raise NotImplementedError("mamba_split_conv1d_scan_combined stand-in: return_final_states is not supported")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError(f"mamba_split_conv1d_scan_combined: D of shape {tuple(D.shape)} (per head) needs headdim")
        heads = D.shape[0]
    elif D.dim() == 2:
        heads, headdim = D.shape
    else:
        raise ValueError(
            f"mamba_split_conv1d_scan_combined: D must be [heads] or [heads, headdim], got {tuple(D.shape)}"
        )
    dim = heads * headdim
    batch, length, width = zxbcdt.shape
    state_width = conv1d_weight.shape[0] - dim  # 2 * ngroups * d_state
    if state_width <= 0 or state_width % (2 * ngroups):
        raise ValueError(
            f"mamba_split_conv1d_scan_combined: conv1d_weight has {conv1d_weight.shape[0]} channels, expected "
            f"{dim} (heads * headdim) + 2 * ngroups({ngroups}) * d_state"
        )
    d_state = state_width // (2 * ngroups)
    if width != 2 * dim + state_width + heads:
        raise ValueError(
            f"mamba_split_conv1d_scan_combined: zxbcdt's last dimension must be 2*{dim} + 2*{ngroups}*{d_state} + "
            f"{heads} = {2 * dim + state_width + heads} (z, xBC, dt), got {width}"
        )
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + state_width, heads], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation)
    x, B, C = torch.split(xbc.transpose(1, 2), [dim, state_width // 2, state_width // 2], dim=-1)
    y = mamba_chunk_scan_combined(
        x.reshape(batch, length, heads, headdim), dt, A, B.reshape(batch, length, ngroups, d_state),
        C.reshape(batch, length, ngroups, d_state), chunk_size, D=D, z=z.reshape(batch, length, heads, headdim),
        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
    )
    return y.reshape(batch, length, dim)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
    """Stand-in for ``causal_conv1d.causal_conv1d_fn`` (the conv inside the fused scan above).

    Depthwise causal convolution: ``out[b, c, t] = bias[c] + sum_k weight[c, k] * x[b, c, t - w + 1 + k]``
    over the taps inside the row and, with ``seq_idx`` [b, l], inside token t's own sequence (a
    packed row's sequences do not see each other). x: [b, channels, l]; weight: [channels, w];
    activation None, "silu" or "swish" (silu).
    """
    import torch
    import torch.nn.functional as F

    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_fn: activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"causal_conv1d_fn: x must be [batch, channels, length] and weight [channels, width], got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    width = weight.shape[1]
    windows = F.pad(x, (width - 1, 0)).unfold(-1, width, 1)  # [b, c, l, w]: tap k reads t - w + 1 + k
    if seq_idx is not None:
        sequence = _check_seq_idx(seq_idx, x.shape[0], x.shape[2])
        tap_sequence = F.pad(sequence, (width - 1, 0), value=-1).unfold(-1, width, 1)  # [b, l, w]
        windows = windows * (tap_sequence == sequence[..., None])[:, None].to(windows.dtype)
    out = torch.einsum("bclw,cw->bcl", windows, weight)
    if bias is not None:
        out = out + bias[:, None]
    return out if activation is None else F.silu(out)


def mamba_chunk_scan_combined(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False,
):
    """Stand-in for ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``: Mamba-2's SSD scan.

    Per head h, with A[h] < 0 and dt = softplus(dt + dt_bias) (``dt_softplus``; clamped to
    ``dt_limit`` when one is set), the selective state-space recurrence over time t
    ``state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T``, ``y_t = state_t C_t + D x_t``, gated by
    silu(z_t) when ``z`` is given, computed chunk by chunk as the paper's state-space duality
    prescribes: within a chunk of ``chunk_size`` steps, the masked "attention" form (the decay between
    two steps is exp of the difference of their cumulative dt*A); across chunks, each chunk's final
    state carried into the next. With ``seq_idx`` [b, l] (non-decreasing sequence ids of a packed
    row) the state starts from zero at every new sequence: steps of different sequences never
    interact, within a chunk or across. ``initial_states`` [b, h, headdim, n] is the state before
    step 0 (its sequence: the row's first). Shapes: x [b, l, h, headdim], dt [b, l, h], A [h], B/C
    [b, l, g, n] (g groups of heads share them), D [h] or [h, headdim], z like x. Returns y like x
    (and the final state [b, h, headdim, n] with ``return_final_states``). Computed in float32 (float64
    inputs stay float64), y cast to x's dtype. ``cu_seqlens`` / ``return_varlen_states`` (inference)
    are refused.
    """
    import torch
    import torch.nn.functional as F

    if cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("mamba_chunk_scan_combined stand-in: cu_seqlens / return_varlen_states "
                                  "(varlen inference states) are not supported")
    batch, length, heads, headdim = _check_scan_shapes(x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size)
    groups, d_state = B.shape[2], B.shape[3]
    compute = torch.promote_types(x.dtype, torch.float32)
    dt = dt.to(compute)
    if dt_bias is not None:
        dt = dt + dt_bias.to(compute)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    sequence = (torch.zeros(batch, length, dtype=torch.int64, device=x.device) if seq_idx is None
                else _check_seq_idx(seq_idx, batch, length))

    # pad to whole chunks: a padded step has dt = 0 (no decay, no input) and the last step's sequence
    pad = -length % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(tensor, repeat_last=False):
        """[b, l, ...] -> [b, chunks, chunk_size, ...]; padded steps are zeros, or repeat the last step."""
        tail = tensor[:, -1:] if repeat_last else torch.zeros_like(tensor[:, :1])
        tensor = torch.cat([tensor, tail.expand(-1, pad, *tensor.shape[2:])], dim=1)
        return tensor.reshape(batch, chunks, chunk_size, *tensor.shape[2:])

    x_c = chunked(x.to(compute))  # [b, c, q, h, p]
    dt_c = chunked(dt)  # [b, c, q, h]
    per_group = heads // groups  # head h reads group h // per_group
    B_c = chunked(B.to(compute).repeat_interleave(per_group, dim=2))  # [b, c, q, h, n]
    C_c = chunked(C.to(compute).repeat_interleave(per_group, dim=2))
    seq_c = chunked(sequence, repeat_last=True)  # [b, c, q]
    log_decay = (dt_c * A.to(compute)).cumsum(dim=2)  # [b, c, q, h]: sum of dt*A up to step t of its chunk

    # within each chunk: y_t += sum_{s <= t, same sequence} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    together = causal & (seq_c[:, :, :, None] == seq_c[:, :, None, :])  # [b, c, t, s]
    gap = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # [b, c, t, s, h]
    decay = gap.masked_fill(~together[..., None], float("-inf")).exp()
    scores = torch.einsum("bcthn,bcshn->bctsh", C_c, B_c) * decay
    y = torch.einsum("bctsh,bcsh,bcshp->bcthp", scores, dt_c, x_c)

    # each chunk's own contribution to the state at its end: its steps in its last step's sequence
    last_sequence = seq_c[:, :, -1]  # [b, c]
    to_end = (log_decay[:, :, -1:, :] - log_decay).exp() * (seq_c == last_sequence[..., None])[..., None]
    chunk_states = torch.einsum("bcsh,bcsh,bcshn,bcshp->bchpn", to_end, dt_c, B_c, x_c)

    # across chunks: the state entering chunk c reaches its steps that are still in its sequence
    state = (x.new_zeros(batch, heads, headdim, d_state, dtype=compute) if initial_states is None
             else initial_states.to(compute))
    state_sequence = seq_c[:, 0, 0]  # the initial state belongs to the row's first sequence
    carried = []
    for c in range(chunks):
        reaches = (seq_c[:, c] == state_sequence[:, None]).to(compute)  # [b, q]
        from_state = torch.einsum("bthn,bhpn->bthp", C_c[:, c], state)
        carried.append(from_state * (log_decay[:, c].exp() * reaches[..., None])[..., None])
        survives = (last_sequence[:, c] == state_sequence).to(compute)  # [b]: no new sequence in chunk c
        state = state * (log_decay[:, c, -1].exp() * survives[:, None])[..., None, None] + chunk_states[:, c]
        state_sequence = last_sequence[:, c]
    y = (y + torch.stack(carried, dim=1)).reshape(batch, chunks * chunk_size, heads, headdim)[:, :length]

    if D is not None:
        y = y + x.to(compute) * (D.to(compute)[:, None] if D.dim() == 1 else D.to(compute))
    if z is not None:
        y = y * F.silu(z.to(compute))
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def _check_scan_shapes(x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size):
    """(batch, length, heads, headdim) of a scan's arguments; ValueError naming the one that does not fit."""
    if x.dim() != 4 or x.shape[1] < 1:
        raise ValueError(
            f"mamba_chunk_scan_combined: x must be [batch, length >= 1, heads, headdim], got {tuple(x.shape)}"
        )
    batch, length, heads, headdim = x.shape
    if B.dim() != 4 or B.shape[:2] != (batch, length) or heads % B.shape[2]:
        raise ValueError(
            f"mamba_chunk_scan_combined: B must be [batch, length, groups, d_state] with groups dividing "
            f"heads={heads}, got {tuple(B.shape)} for x {tuple(x.shape)}"
        )
    groups, d_state = B.shape[2], B.shape[3]
    expected = {
        "dt": (dt, (batch, length, heads)), "A": (A, (heads,)), "C": (C, (batch, length, groups, d_state)),
        "z": (z, tuple(x.shape)), "dt_bias": (dt_bias, (heads,)),
        "initial_states": (initial_states, (batch, heads, headdim, d_state)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"mamba_chunk_scan_combined: {name} must have shape {shape}, got {tuple(tensor.shape)}")
    if D is not None and tuple(D.shape) not in ((heads,), (heads, headdim)):
        raise ValueError(
            f"mamba_chunk_scan_combined: D must be [{heads}] or [{heads}, {headdim}], got {tuple(D.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"mamba_chunk_scan_combined: chunk_size must be a positive int, got {chunk_size!r}")
    return batch, length, heads, headdim


def _check_seq_idx(seq_idx, batch, length):
    """``seq_idx`` as int64 [batch, length]; ValueError unless that shape and non-decreasing along each row."""
    import torch

    if tuple(seq_idx.shape) != (batch, length):
        raise ValueError(f"seq_idx must have shape ({batch}, {length}) (batch, length), got {tuple(seq_idx.shape)}")
    sequence = seq_idx.to(torch.int64)
    if bool((sequence.diff(dim=-1) < 0).any()):
        raise ValueError("seq_idx must be non-decreasing along each row (the sequence index of each packed token)")
    return sequence


@functools.cache
def rms_norm_gated():
    """Stand-in class for ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` (RMSNormGated in megatron-core).

    ``RMSNormGated(hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None,
    dtype=None)``, weight initialised to ones, no bias; ``forward(x, z=None)``: with ``z`` and not
    ``norm_before_gate`` the input is first gated by silu(z); then each group of ``group_size``
    features (all of them when None) is divided by its root mean square (plus ``eps`` inside the
    root) and scaled by the weight; with ``z`` and ``norm_before_gate`` the output is gated after.
    Computed in float32, returned in x's dtype. megatron-core builds it per TP rank over the local
    d_inner with one group per local Mamba group (``ssm/mamba_mixer.py:417``).
    """
    import torch
    import torch.nn.functional as F

    class RMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
            super().__init__()
            group_size = hidden_size if group_size is None else group_size
            if hidden_size % group_size:
                raise ValueError(f"RMSNormGated: group_size {group_size} must divide hidden_size {hidden_size}")
            self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            self.register_parameter("bias", None)

        def forward(self, x, z=None):
            compute = torch.promote_types(x.dtype, torch.float32)
            out = x.to(compute)
            if z is not None and not self.norm_before_gate:
                out = out * F.silu(z.to(compute))
            grouped = out.reshape(*out.shape[:-1], -1, self.group_size)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + self.eps)
            out = grouped.reshape(out.shape) * self.weight.to(compute)
            if z is not None and self.norm_before_gate:
                out = out * F.silu(z.to(compute))
            return out.to(x.dtype)

    RMSNormGated.__module__ = __name__
    RMSNormGated.__qualname__ = "RMSNormGated"
    return RMSNormGated


@contextlib.contextmanager
def swapped(replacements):
    """``with swapped([Shim, ...]): ...`` sets each attribute for the block, restoring the originals."""
    saved = []
    try:
        for shim in replacements:
            saved.append((shim.owner, shim.attribute, vars(shim.owner)[shim.attribute]))
            setattr(shim.owner, shim.attribute, shim.replacement)
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


LORA_LAYERS = "megatron.bridge.peft.lora_layers"


@contextlib.contextmanager
def transformer_engine_import_stand_in(importer=LORA_LAYERS):
    """While the block runs, ``import transformer_engine[.pytorch]`` in module ``importer`` gets a stand-in.

    The pinned Megatron-Bridge (0.6) ``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch``
    unguarded (its line 20), so ``import megatron.bridge`` fails without Transformer Engine. The
    stand-in is scoped by importer, not only by time: ``builtins.__import__`` hands it to that one
    module's import statements and to nobody else, and it never enters ``sys.modules``; so
    megatron-core's own ``HAVE_TE`` probes, some of which first run inside the same ``import
    megatron.bridge``, still find no TE. Where TE is installed this does nothing.
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        yield
        return
    real_import = builtins.__import__
    package = _transformer_engine_stand_in()

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and globals is not None and globals.get("__name__") == importer:
            module = _stand_in_module(package, name)
            if module is not None:
                # `import a.b as c` takes the top package and then its attribute; `from a.b import x` the module
                return module if fromlist else package
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped_import
    try:
        yield
    finally:
        if builtins.__import__ is scoped_import:
            builtins.__import__ = real_import


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


@contextlib.contextmanager
def llava_construction_stand_ins():
    """Inside the block, megatron-core 0.19's ``LLaVAModel`` with a CLIP ViT constructs on a CPU
    without Transformer Engine: ``swapped(llava_stand_ins())``. Construction only
    (``bed.models.tiny_llava`` builds inside the block); the forward needs none of them."""
    with swapped(llava_stand_ins()):
        yield


def llava_stand_ins():
    """The Shims of `llava_construction_stand_ins`, one per upstream line (fresh replacements each call):

    * ``models/vision/clip_vit_model.py:20-22``: without Transformer Engine the default norm
      ``NORM_IMPL`` falls back to ``torch.nn.LayerNorm``, which ``build_module`` then calls with
      ``config=`` (TypeError). ``CLIPViTModel`` takes ``ln_pre_impl`` / ``ln_post_impl``, but
      ``LLaVAModel`` never passes them (``models/multimodal/llava_model.py:289``): a CLIPViTModel
      built in the block gets megatron-core's ``WrappedTorchNorm`` (the local spec's norm, a
      ``torch.nn.LayerNorm`` for ``normalization="LayerNorm"``) where its caller names none.
    * ``clip_vit_model.py:124``: ``torch.arange(seq_length).expand(1, -1).cuda()``; the ``torch``
      that module sees in the block makes that ``arange`` answer ``.cuda()`` with itself (CPU).
    * ``llava_model.py:211``: a language model with context parallelism asserts
      ``is_te_min_version("1.10.0")`` (TE's CP attention); on a CPU the test bed's exact attention
      (``_exact_attention``) stands in for it, so the check is answered as TE 1.10.0 would answer it.
    """
    from megatron.core.models.multimodal import llava_model
    from megatron.core.models.vision import clip_vit_model

    clip = clip_vit_model.CLIPViTModel
    clip_init = vars(clip)["__init__"]

    @functools.wraps(clip_init)
    def init_with_torch_norm(self, transformer_config, transformer_layer_spec, *args, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        for index, name in enumerate(("ln_pre_impl", "ln_post_impl")):
            if len(args) <= index:
                kwargs.setdefault(name, WrappedTorchNorm)
        clip_init(self, transformer_config, transformer_layer_spec, *args, **kwargs)

    return [
        Shim(clip, "__init__", init_with_torch_norm),
        Shim(clip_vit_model, "torch", _HostArangeTorch()),
        Shim(llava_model, "is_te_min_version", _te_1_10_min_version),
    ]


class _HostArangeTorch(types.ModuleType):
    """``torch`` as ``clip_vit_model`` sees it in `llava_construction_stand_ins`: ``arange`` returns a
    tensor whose ``.cuda()`` is itself (on the CPU); everything else is torch's own attribute."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    def arange(self, *args, **kwargs):
        import torch

        return torch.arange(*args, **kwargs).as_subclass(_host_tensor_class())


@functools.cache
def _host_tensor_class():
    import torch

    class HostTensor(torch.Tensor):
        """A CPU tensor (and what is computed from it) whose ``.cuda()`` answers a plain CPU tensor."""

        def cuda(self, *args, **kwargs):
            return self.as_subclass(torch.Tensor)

    return HostTensor


def _te_1_10_min_version(version, check_equality=True):
    """``megatron.core.utils.is_te_min_version`` answered for Transformer Engine 1.10.0."""
    from packaging.version import Version

    stand_in, asked = Version("1.10.0"), Version(version)
    return stand_in >= asked if check_equality else stand_in > asked


# the vision tower ``bridge_vl_clip_vision`` builds: LLaVAModel arguments, then the ViT's config fields
# (heads of 16 channels; at TP > 2 one head per TP rank), and the projector's FFN cap
CLIP_VISION = dict(img_h=32, img_w=32, patch_dim=16, pixel_shuffle=False, dynamic_resolution=False)
CLIP_LAYERS, CLIP_HEAD_DIM, CLIP_HEADS, PROJECTOR_FFN = 1, 16, 2, 128
CLIP_WHY = {
    "vision_model_type": "RADIO runs images only through its dynamic-resolution packed (THD, non-causal) vision "
                         "attention, which has no CPU stand-in: megatron-core's CLIPViTModel (local spec) instead",
    "img_h": "CPU size: 2 x 2 patches of 16", "img_w": "CPU size: 2 x 2 patches of 16", "patch_dim": "CPU size",
    "dynamic_resolution": "CLIP tiles have one fixed size (no imgs_sizes, no vision packed_seq_params)",
    "pixel_shuffle": "off: a shuffle of 2 x 2 patches would leave one embedding per image",
    "vision": "CPU size", "projector": "CPU size",
}


@contextlib.contextmanager
def bridge_vl_clip_vision(substituted):
    """Inside the block, the Nemotron VL / Omni providers' ``LLaVAModel(...)`` gets a CLIP ViT for RADIO.

    Megatron-Bridge 0.6 builds the vision tower of Nemotron VL and Omni as RADIO ViT-H
    (``nemotron_omni_provider.py:333-372``, ``nemotron_vl_provider.py:327-354``: 32 layers, hidden 1280,
    512 x 512 dynamic-resolution images, pixel shuffle). RADIO takes images only as packed
    dynamic-resolution rows through non-causal THD attention (``llava_model.py:1081-1100``), which the
    test bed's exact attention does not stand in for. In the block, ``LLaVAModel`` as those two provider
    modules see it is megatron-core's own class called with Bridge's arguments except: the vision config
    a copy of Bridge's with ``vision_model_type="clip"``, `CLIP_LAYERS` layer(s) of `CLIP_HEADS` heads
    of `CLIP_HEAD_DIM` (at TP > 2 one head per TP rank), the `CLIP_VISION` arguments, and the
    projector's FFN at most `PROJECTOR_FFN`. Bridge's class-token drop (``drop_vision_class_token=True``)
    stays: a 32 x 32 image gives 4 embeddings. ``substituted`` (a list) gets one dict per changed value:
    ``name``, ``bridge`` (what Bridge passed), ``built``, ``why``.
    """
    import copy

    from megatron.bridge.models.nemotron_omni import nemotron_omni_provider
    from megatron.bridge.models.nemotron_vl import nemotron_vl_provider
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    def record(name, bridge, built, why):
        if bridge != built:
            substituted.append(dict(name=name, bridge=bridge, built=built, why=why))

    def with_clip(**arguments):
        vision = copy.deepcopy(arguments["vision_transformer_config"])
        tp = vision.tensor_model_parallel_size
        heads = max(CLIP_HEADS, tp)
        sizes = dict(vision_model_type="clip", num_layers=CLIP_LAYERS, num_attention_heads=heads,
                     num_query_groups=heads, kv_channels=CLIP_HEAD_DIM, hidden_size=heads * CLIP_HEAD_DIM,
                     ffn_hidden_size=2 * heads * CLIP_HEAD_DIM)
        for name, value in sizes.items():
            record(f"vision.{name}", getattr(vision, name), value,
                   CLIP_WHY["vision_model_type" if name == "vision_model_type" else "vision"])
            setattr(vision, name, value)
        projection = copy.deepcopy(arguments["vision_projection_config"])
        ffn = min(projection.ffn_hidden_size, PROJECTOR_FFN)
        record("vision_projection.ffn_hidden_size", projection.ffn_hidden_size, ffn, CLIP_WHY["projector"])
        projection.ffn_hidden_size = ffn
        for name, value in CLIP_VISION.items():
            record(name, arguments.get(name), value, CLIP_WHY[name])
        return LLaVAModel(**{**arguments, **CLIP_VISION, "vision_transformer_config": vision,
                             "vision_projection_config": projection})

    with swapped([Shim(module, "LLaVAModel", with_clip) for module in (nemotron_omni_provider, nemotron_vl_provider)]):
        yield


# --- Megatron-Bridge 0.6's training step (gpt_step) on a machine without its optional packages ---------

# importer module -> the dotted roots its import statements get stand-ins for (only those it imports
# unguarded; the upstream lines are in `bridge_training_import_stand_ins`)
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
    real_import = builtins.__import__

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
        importer = globals.get("__name__") if level == 0 and globals is not None else None
        for root, tree in scoped.get(importer, {}).items():
            if name == root or name.startswith(root + "."):
                module = _stand_in_submodule(tree, name[len(root) :])
                if fromlist:  # `from a.b import x`: the module itself
                    return module
                if "." not in root:  # `import a.b.c [as d]`: the top package, then its attributes
                    return tree
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped_import
    try:
        yield
    finally:
        if builtins.__import__ is scoped_import:
            builtins.__import__ = real_import


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


@contextlib.contextmanager
def accelerator_synchronize_stand_in():
    """Inside the block ``torch.accelerator.synchronize`` returns at once when no accelerator exists.

    vLLM's ``WeightTransferEngine.update_weights`` synchronizes the device after every chunk so the
    next step reads the new weights (0.33 ``distributed/weight_transfer/base.py:598``); the CUDA
    build of torch raises there without a driver. On the host every copy into a parameter has
    finished when it returns, so there is nothing to wait for. With an accelerator the real function
    stays.
    """
    import torch

    if rank_device().type == "cuda":
        yield
        return

    def synchronize(device=None):
        return None

    with swapped([Shim(torch.accelerator, "synchronize", synchronize)]):
        yield
