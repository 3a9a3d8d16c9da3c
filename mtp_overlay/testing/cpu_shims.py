"""CPU shims that let stock megatron-core run an MTP GPTModel forward+backward without a GPU.

TEST SCAFFOLDING ONLY: the test bed (``mtp_overlay.testing.launcher``) installs these in its worker
processes; ``import mtp_overlay`` never imports this module, and nothing here is product behaviour.
Each shim swaps one upstream attribute; ``uninstall()`` puts every original object back.

What needs a shim on a CPU machine (megatron-core 0.19.x, local spec), SPEC §4:

* ``torch.cuda.current_device()`` is used as a tensor device all over (RoPE, MTP tracker, CP roll
  buffers, sequence-parallel buffers): it returns the CPU device.
* Megatron's "CUDA" RNG tracker reads and writes CUDA generator states: it runs on the CPU generator.
* ``WrappedTorchNorm`` (the local-spec norm) asserts under sequence parallelism: it is built with
  sequence parallelism off and its parameters are tagged ``sequence_parallel=True``, so their
  partial gradients are all-reduced over TP like TE's norms'.
* The default causal mask is allocated on ``"cuda"``: it is built on the CPU.
* Context parallelism: ``DotProductAttention`` asserts that CP needs TE, so under CP > 1 it runs an
  exact causal attention over K/V all-gathered from the CP group (global positions of the
  load-balanced 2*cp-chunk layout), differentiable through the gather; RoPE's CP slicing uses
  ``pin_memory().cuda()`` and gets a CPU equivalent.

Megatron's own training step (``mtp_overlay.testing.megatron_step``):

* DistributedDataParallel's gradient sync orders itself against ``torch.cuda.current_stream()``:
  it gets a stream whose waits are no-ops (CPU work is synchronous).
* The pipeline schedules allocate their token counter with ``torch.zeros(..., device="cuda")``, the
  FP32 optimizer its loss scale with ``torch.tensor(..., device="cuda")``, the gradient-norm code its
  accumulators the same way: those three modules see a ``torch`` whose tensor factories build on the
  CPU when asked for ``"cuda"``; the gradient norm's multi-tensor L2 norm (megatron-core's local
  fallback returns it on "cuda") runs on the CPU. (Gradient clipping itself asserts CUDA tensor
  types: the test bed's optimizer does not clip.)
"""

import contextlib
import dataclasses
import functools
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

    def forward_attention(self, query, key, value, attention_mask, *args, **kwargs):
        if getattr(self, "cpu_shim_cp_group", None) is None:
            return attention_forward(self, query, key, value, attention_mask, *args, **kwargs)
        return _context_parallel_attention(self, query, key, value, attention_mask, *args, **kwargs)

    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    def set_rng_state(new_state, *args, **kwargs):
        torch.set_rng_state(new_state)

    return [
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


def load_balanced_positions(local_length, rank, size, device=None):
    """Global sequence positions of the ``local_length`` tokens CP rank ``rank`` holds.

    The load-balanced layout (megatron.core.utils.get_batch_on_this_cp_rank): the sequence is cut
    into 2*size chunks and rank r keeps chunks r and 2*size-1-r, in that order.
    """
    import torch

    if local_length % 2:
        raise ValueError(f"local_length must be even (two chunks per CP rank), got {local_length}")
    chunk = local_length // 2
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


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


def _context_parallel_attention(
    self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
):
    """Exact causal attention of this CP rank's queries over the whole sequence's keys/values.

    query/key/value: [s_local, b, heads, head_dim] in the load-balanced CP layout. Only causal
    self-attention without an explicit mask, bias or packed sequences is supported.
    """
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
        raise NotImplementedError(
            "CPU context-parallel attention shim: attention_mask, attention_bias and "
            "packed_seq_params must be None (causal self-attention only)"
        )
    if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal:
        raise NotImplementedError("CPU context-parallel attention shim supports causal attention only")
    group = self.cpu_shim_cp_group
    rank, size = group.rank(), group.size()

    key = _gather_sequence(key, group)
    value = _gather_sequence(value, group)
    repeat = query.size(2) // key.size(2)  # grouped-query attention
    if repeat > 1:
        key = key.repeat_interleave(repeat, dim=2)
        value = value.repeat_interleave(repeat, dim=2)

    local = query.size(0)
    query_positions = load_balanced_positions(local, rank, size, device=query.device)
    key_positions = torch.cat(
        [load_balanced_positions(local, r, size, device=query.device) for r in range(size)]
    )
    future = key_positions[None, :] > query_positions[:, None]  # [s_local, s]

    scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
    scores = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float()) * scale
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(query.dtype)
    probs = self.attention_dropout(probs)
    context = torch.einsum("bnst,tbnd->sbnd", probs, value)
    return context.reshape(local, query.size(1), self.hidden_size_per_partition)
