"""Independent references for the packed MTP roll: per-sequence Python loops, no product code.

What the roll must produce, written the slow obvious way so tests (and model-level test beds) can
compare megatron-core's installed roll against it position by position:

* a packed row is laid out on padded boundaries: sequence i occupies ``padded[i]`` slots, its first
  ``real[i]`` are tokens, the rest padding;
* rolled left by one, slot j of sequence i holds the element at j + 1 of the same sequence while
  j + 1 is a real token (j < real[i] - 1), else 0 (Megatron-LM #7278: no label exists there);
* under context parallelism rank r holds chunks r and 2*cp-1-r of every padded sequence (each cut
  into 2*cp chunks), sequence after sequence.
"""


def packed_params(real, padded=None):
    """megatron-core PackedSeqParams (THD) for real lengths ``real`` laid out on ``padded`` lengths.

    ``padded=None``: no ``cu_seqlens_q_padded`` (the tensor is laid out on the real boundaries).
    """
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    def cumulative(lengths):
        return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)

    cu = cumulative(real)
    cu_padded = None if padded is None else cumulative(padded)
    longest = max(padded if padded is not None else real, default=0)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest,
    )


def reference_roll(row, real, padded):
    """``row`` ([..., sum(padded)]) rolled left by one within each sequence, zero from each
    sequence's last real token on (padding included)."""
    import torch

    out = []
    for values in row.reshape(row[..., 0:1].numel(), row.shape[-1]).tolist():
        rolled, start = [], 0
        for length, slots in zip(real, padded):
            for j in range(slots):
                rolled.append(values[start + j + 1] if j < length - 1 else 0)
            start += slots
        out.append(rolled)
    return torch.tensor(out, dtype=row.dtype).reshape(row.shape)


def cp_local(row, padded, cp_size, cp_rank):
    """CP rank ``cp_rank``'s slots of a full packed ``row``: chunks r and 2*cp-1-r of each sequence."""
    if cp_size == 1:
        return row.clone()
    index, start = [], 0
    for slots in padded:
        chunk = slots // (2 * cp_size)
        for piece in (cp_rank, 2 * cp_size - 1 - cp_rank):
            index.extend(range(start + piece * chunk, start + (piece + 1) * chunk))
        start += slots
    return row[..., index]


def mtp_targets(roll, input_ids, loss_mask, depth, **roll_kwargs):
    """(labels, loss_mask, token count) the depth-``depth`` MTP loss uses when ``labels`` is None, by
    the order of rolls of megatron-core 0.19's ``process_mtp_loss``: labels from ``input_ids`` rolled
    once, ``loss_mask`` rolled with them, then both rolled once per depth; the count is what the last
    roll of ``loss_mask`` returns (the MTP loss of that depth is divided by it)."""
    labels, _ = roll(input_ids, shifts=-1, dims=-1, **roll_kwargs)
    mask, count = roll(loss_mask, shifts=-1, dims=-1, **roll_kwargs)
    for _ in range(depth):
        labels, _ = roll(labels, shifts=-1, dims=-1, **roll_kwargs)
        mask, count = roll(mask, shifts=-1, dims=-1, **roll_kwargs)
    return labels, mask, count


def trained_pairs(input_ids, labels, mask):
    """{(position, input token, target)} the MTP loss trains (mask nonzero), for a [1, T] row."""
    return {
        (position, int(input_ids[0, position]), int(labels[0, position]))
        for position in range(input_ids.shape[-1])
        if float(mask[0, position]) != 0
    }
