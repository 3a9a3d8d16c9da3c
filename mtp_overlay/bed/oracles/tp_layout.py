"""How a tensor-parallel parameter's shards make up its full tensor, both ways.

megatron-core shards a TP parameter (``tensor_model_parallel``) along ``partition_dim`` in
contiguous blocks, one per rank, except where several components are packed into one parameter
and each is sharded on its own: there the parameter carries ``partition_sizes``, the per-rank
size of every component along that dimension (0.19: Mamba's in_proj [z, x, B, C, dt] and conv1d
[x, B, C], ``ssm/mamba_mixer.py:304,341``; its resharding planner reads the same attribute,
``resharding/planner.py:146``), or ``partition_stride`` > 1, that many equal components (a gated
MLP's (SwiGLU) ``linear_fc1``: stride 2, each rank holds [gate_r; up_r], ``transformer/mlp.py:206-233``,
as ``tensor_parallel/layers.py:214-216`` draws it). Comparing gradients across TP sizes, or drawing
TP-independent weights, needs the full tensor in the TP1 layout.
"""


def _sizes(parameter, shard_length):
    """The per-rank size of each component of ``parameter`` along its ``partition_dim``."""
    sizes = getattr(parameter, "partition_sizes", None)
    if sizes:
        return list(sizes)
    stride = getattr(parameter, "partition_stride", 1) or 1
    if shard_length % stride:
        raise ValueError(f"a shard of {shard_length} along the partition dim does not hold {stride} equal components "
                         "(partition_stride)")
    return [shard_length // stride] * stride


def tp_shard(full, parameter, tp_size, tp_rank):
    """TP rank ``tp_rank``'s shard of ``full`` along ``parameter``'s ``partition_dim`` (default 0):
    its contiguous block, or its block of every component (``partition_sizes``, ``partition_stride``),
    in order."""
    import torch

    dim = getattr(parameter, "partition_dim", 0)
    sizes = _sizes(parameter, parameter.shape[dim])
    expected = list(parameter.shape)
    expected[dim] = sum(sizes) * tp_size
    if list(full.shape) != expected:
        raise ValueError(
            f"full tensor of shape {tuple(full.shape)} does not shard into {tp_size} ranks of "
            f"{tuple(parameter.shape)} along dim {dim} (partition sizes {sizes}): expected {tuple(expected)}"
        )
    components = full.split([size * tp_size for size in sizes], dim=dim)
    return torch.cat([component.chunk(tp_size, dim=dim)[tp_rank] for component in components], dim=dim)


def tp_unshard(shards, parameter):
    """The full tensor from every TP rank's shard (``shards`` in rank order), inverse of `tp_shard`."""
    import torch

    dim = getattr(parameter, "partition_dim", 0)
    sizes = _sizes(parameter, shards[0].shape[dim])
    pieces = [shard.split(sizes, dim=dim) for shard in shards]
    return torch.cat([piece[component] for component in range(len(sizes)) for piece in pieces], dim=dim)
