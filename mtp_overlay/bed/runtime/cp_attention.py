"""Exact causal attention on the CPU for context parallelism and packed (THD) rows, where megatron-core's
local ``DotProductAttention`` refuses both (it asserts CP needs TE, and refuses ``packed_seq_params``):
a per-sequence causal mask from the padded boundaries, the per-sequence 2*cp-chunk layout, K/V
all-gathered from the CP group, differentiable through the gather. `cpu_shims` installs it.
"""

import functools


def causal_mask(sq):
    import torch

    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
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


def exact_attention(
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
        boundaries = self_attention_boundaries(packed_seq_params)
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

    query_index = row_positions(boundaries, query.size(0), size, rank)  # positions in the full packed row
    key_index = torch.cat([row_positions(boundaries, query.size(0), size, r) for r in range(size)])
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


def row_positions(boundaries, local_length, cp_size, cp_rank):
    """Full-row positions of CP rank ``cp_rank``'s ``local_length`` slots (the 2*cp-chunk layout of
    ``mtp_overlay.mtp.cp_local_indices``), computed on the device without a host read, as TE's
    kernels do: the test bed's own checks stay its own in a sync count (`syncs`)."""
    from ...mtp.packing import slot_geometry

    geometry = slot_geometry(boundaries, local_length, cp_size, cp_rank)
    return boundaries[geometry.sequence] + geometry.position


def self_attention_boundaries(packed_seq_params):
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
