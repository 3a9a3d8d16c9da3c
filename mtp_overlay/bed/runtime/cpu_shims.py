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
  (`cp_attention.exact_attention`: per-sequence causal mask from the padded boundaries, the per-sequence
  2*cp-chunk layout, K/V all-gathered from the CP group, differentiable through the gather);
  RoPE's CP slicing uses ``pin_memory().cuda()`` and gets a CPU equivalent. THD RoPE
  (``rope_utils._apply_rotary_pos_emb_thd``) is plain torch and runs as it is.

Mamba ('M') layers: `mamba_kernels` (``mamba_shims``, in the table). The scoped stand-ins live beside
it: `bridge_stand_ins`, `multimodal_stand_ins`, and vLLM's in `streams`; `shim` holds `Shim`, `swapped` and
`scoped_import`.

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
* With expert tensor parallelism (ETP > 1: ``--etp`` defaults to TP) it gathers the tokens routed to
  its experts over the expert-TP group with a different count per rank
  (``tensor_parallel/mappings.py`` ``_gather_along_first_dim(output_split_sizes=...)``: ``all_gather``
  of a list of unequal tensors), which NCCL takes and gloo refuses (its uneven ``reduce_scatter`` on
  the way back gloo takes): `_gather_uneven` pads each rank's rows to the largest count for an even
  ``all_gather``. Calls without split sizes are upstream's.

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
"""

import contextlib
import functools
import types

from .cp_attention import causal_mask, exact_attention, pos_emb_on_this_cp_rank
from .mamba_kernels import mamba_shims
from .shim import Shim, having
from .streams import HostStream


_saved = []  # (owner, attribute, original vars() entry), in install order


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
        return exact_attention(self, *arguments)

    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    def set_rng_state(new_state, *args, **kwargs):
        torch.set_rng_state(new_state)

    hybrid = [Shim(module, "TENorm", torch_norm.WrappedTorchNorm) for module in _hybrid_block()]
    moe = _alltoall_dispatcher_shims()
    main = [
        Shim(module, "is_inference_column_parallel_linear", _is_inference_column_parallel_linear)
        for module in having("megatron.core.transformer.multi_token_prediction", "is_inference_column_parallel_linear")
    ]
    return hybrid + main + moe + mamba_shims() + [
        Shim(torch.cuda, "current_device", _cpu_device),
        Shim(random, "_get_cuda_rng_state", get_rng_state),
        Shim(random, "_set_cuda_rng_state", set_rng_state),
        Shim(random.CudaRNGStatesTracker, "add", _add_cpu_rng_state),
        Shim(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new_norm)),
        Shim(utils, "get_default_causal_mask", causal_mask),
        Shim(fused_softmax, "get_default_causal_mask", causal_mask),
        Shim(attention, "__init__", init_attention),
        Shim(attention, "forward", forward_attention),
        Shim(rope_utils, "get_pos_emb_on_this_cp_rank", pos_emb_on_this_cp_rank),
        Shim(rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", pos_emb_on_this_cp_rank),
        Shim(yarn_rotary_pos_embedding, "get_pos_emb_on_this_cp_rank", pos_emb_on_this_cp_rank),
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
    dispatcher = having("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu")
    if not dispatcher or "cuda_dtoh_stream" not in vars(dispatcher[0].MoEAlltoAllTokenDispatcher):
        return []
    module = dispatcher[0]
    from megatron.core.tensor_parallel import mappings

    return [
        Shim(module.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", HostStream()),
        Shim(module, "maybe_move_tensor_to_cpu", functools.partial(_to_host, module.maybe_move_tensor_to_cpu)),
        Shim(mappings, "_gather_along_first_dim", functools.partial(_gather_uneven, mappings._gather_along_first_dim)),
    ]


def _gather_uneven(upstream, input_, group, output_split_sizes=None, use_global_buffer=False):
    """``mappings._gather_along_first_dim`` with ``output_split_sizes`` on gloo: rank r's
    ``output_split_sizes[r]`` rows, padded to the largest count, gathered evenly, the padding dropped
    (upstream ``all_gather``s the unequal tensors themselves, which gloo refuses)."""
    import torch

    if output_split_sizes is None or group.size() == 1:
        return upstream(input_, group, output_split_sizes, use_global_buffer)
    padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
    padded[:len(input_)] = input_
    gathered = [torch.empty_like(padded) for _ in output_split_sizes]
    torch.distributed.all_gather(gathered, padded, group=group)
    return torch.cat([rows[:count] for rows, count in zip(gathered, output_split_sizes)])


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


def _cpu_stream(device=None):
    return HostStream()


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
