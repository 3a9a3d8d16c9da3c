"""CPU shims that let stock megatron-core run an MTP GPTModel forward+backward without a GPU.

TEST SCAFFOLDING ONLY: the test bed (``mtp_overlay.testing.launcher``) installs these in its worker
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
  Skipped on releases without that check (0.19.2 and earlier).
* Context parallelism and packed (THD) sequences: ``DotProductAttention`` asserts that CP needs TE
  (``transformer/dot_product_attention.py`` ``__init__``) and refuses ``packed_seq_params``
  (``forward``), so under CP > 1 or with packed input it runs an exact causal attention
  (``_exact_attention``: per-sequence causal mask from the padded boundaries, the per-sequence
  2*cp-chunk layout, K/V all-gathered from the CP group, differentiable through the gather);
  RoPE's CP slicing uses ``pin_memory().cuda()`` and gets a CPU equivalent. THD RoPE
  (``rope_utils._apply_rotary_pos_emb_thd``) is plain torch and runs as it is.

Megatron-Bridge 0.6 on a machine without Transformer Engine (scoped, used by ``testing.bridge``):

* ``transformer_engine_import_stand_in()``: ``megatron/bridge/peft/lora_layers.py`` imports
  ``transformer_engine.pytorch`` unguarded, so ``import megatron.bridge`` fails without TE. While the
  block runs, that one import statement of that one module gets a stand-in object; every other
  importer, megatron-core's own ``HAVE_TE`` probes included, still finds no TE, and nothing enters
  ``sys.modules``.
* ``bridge_local_mtp_spec()``: ``GPTModelProvider.provide()`` builds its MTP block through
  ``gpt_provider.mtp_block_spec``, which calls ``get_gpt_mtp_block_spec(..., use_transformer_engine=True)``
  whatever the layer spec: inside the block that call builds the local (non-TE) MTP spec.

Megatron's own training step (``mtp_overlay.testing.megatron_step``):

* DistributedDataParallel's gradient sync orders itself against ``torch.cuda.current_stream()``:
  it gets a stream whose waits are no-ops (CPU work is synchronous).
* The pipeline schedules allocate their token counter with ``torch.zeros(..., device="cuda")``, the
  FP32 optimizer its loss scale with ``torch.tensor(..., device="cuda")``, the gradient-norm code its
  accumulators the same way: those three modules see a ``torch`` whose tensor factories build on the
  CPU when asked for ``"cuda"``; the gradient norm's multi-tensor L2 norm (megatron-core's local
  fallback returns it on "cuda") runs on the CPU. (Gradient clipping itself asserts CUDA tensor
  types: the test bed's optimizer does not clip.)

vLLM's weight-transfer engines (scoped, used by ``testing.vllm_worker``):

* ``accelerator_synchronize_stand_in()``: ``WeightTransferEngine.update_weights`` ends with
  ``torch.accelerator.synchronize()`` (vLLM 0.33.0 ``distributed/weight_transfer/base.py:598``,
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
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
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
    main = [
        Shim(module, "is_inference_column_parallel_linear", _is_inference_column_parallel_linear)
        for module in _having("megatron.core.transformer.multi_token_prediction", "is_inference_column_parallel_linear")
    ]
    return hybrid + main + [
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
    ]


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

    from ..mtp.packing import cp_local_indices

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

    query_index = cp_local_indices(boundaries, size, rank)  # positions in the full packed row
    key_index = torch.cat([cp_local_indices(boundaries, size, r) for r in range(size)])
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

    Megatron-Bridge 0.6.2 ``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch``
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

    Megatron-Bridge 0.6.2 ``GPTModelProvider.provide()`` gets its MTP spec from
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
def accelerator_synchronize_stand_in():
    """Inside the block ``torch.accelerator.synchronize`` returns at once when no accelerator exists.

    vLLM's ``WeightTransferEngine.update_weights`` synchronizes the device after every chunk so the
    next step reads the new weights (0.33.0 ``distributed/weight_transfer/base.py:598``); the CUDA
    build of torch raises there without a driver. On the host every copy into a parameter has
    finished when it returns, so there is nothing to wait for. With an accelerator the real function
    stays.
    """
    import torch

    if torch.accelerator.is_available():
        yield
        return

    def synchronize(device=None):
        return None

    with swapped([Shim(torch.accelerator, "synchronize", synchronize)]):
        yield
