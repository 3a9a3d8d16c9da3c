"""MTP training on megatron-core from an RL trainer: the loss mask, its layout, grad scale, metrics.

From megatron-core 0.19.0 a forward without ``labels`` (RL losses live outside Megatron) derives
the MTP labels from ``input_ids`` and weights the MTP loss by ``loss_mask`` rolled with them; no
``loss_mask`` means all ones, so prompt tokens, padding and filtered samples train the MTP head
(Megatron-LM PR #3457, NeMo-RL PR #3494). Importing this package is cheap: torch and megatron load
inside the functions.

Mask (``mask``)
    build_mtp_loss_mask(token_mask, sample_mask, model_or_config) -> Tensor [B, S] | None
        ``token_mask * sample_mask[:, None]`` (float32, unshifted: Megatron rolls it); None unless
        ``mtp_num_layers`` > 0 (NeMo-RL issue #2869). token_mask must be binary, sample_mask finite,
        both on one device, checked even when MTP is off; TypeError for a ``model_or_config``
        without ``mtp_num_layers`` (on itself or on the unwrapped model's ``.config``).
    global_valid_tokens(token_mask, sample_mask, group=None) -> float
        ``sum(token_mask[:, 1:] * sample_mask[:, None])``, all-reduced over data-parallel ranks.
    mtp_num_layers(model_or_config), mtp_enabled(model_or_config), unwrap_model(model)

Packing and CP sharding (``packing``), vectorised, no Python loop over sequences
    padding_multiple(cp_size=1, tp_size=1, sequence_parallel=False) -> int
        ``2*cp_size`` under CP (else 1), times ``tp_size`` under sequence parallelism.
    pack_sequences(input_ids, lengths, loss_mask=None, *, pad_multiple=1, pad_token_id=0) -> PackedBatch
        Tokens and mask packed through one index: same boundaries, same per-sequence padding
        (mask pad slots 0; pad_token_id an int in [0, dtype max]). PackedBatch(input_ids [1,T], loss_mask [1,T], cu_seqlens,
        cu_seqlens_padded, max_seqlen).
    unpack_sequences(packed, cu_seqlens, cu_seqlens_padded, seq_len, fill=0) -> [B, seq_len]
    cp_shard(tensor, cp_size, cp_rank, cu_seqlens_padded=None) -> CP-local tensor
        Load-balanced layout of ``get_batch_on_this_cp_rank``: each (padded) sequence in
        ``2*cp_size`` chunks, rank r keeps chunks r and ``2*cp_size-1-r``. Without
        ``cu_seqlens_padded`` each row is one sequence.
    cp_local_indices(cu_seqlens_padded, cp_size, cp_rank) -> positions rank keeps
    packed_seq_params(packed, real_lengths=False) -> megatron PackedSeqParams (thd). The tensors sit
        on the padded boundaries; cu_seqlens_q holds them too (NeMo-RL's default), or with
        real_lengths=True the real ones (the model_slices_context_parallel_inputs path: the MTP roll
        then needs fix mtp-packed-roll); ``total_tokens`` set where megatron-core has it, so its
        ``seq_idx`` tells Mamba layers where each sequence starts

Layout (``layout``)
    model_slices_context_parallel(model) -> bool
        ``model_slices_context_parallel_inputs = True`` on the model under ``.module`` wrappers.
    shard_for_model(model, tensor, cp_size, cp_rank, cu_seqlens_padded=None)
        Full row for a model that slices CP itself, else the CP-local shard; use it for tokens
        and mask alike.
    split_output(output) -> (output, sliced_loss_mask | None); unwrap_output(output) -> output
        A CP-slicing model returns ``(output, sliced_loss_mask)`` when given a full loss_mask.
    loss_mask_scope(loss_mask, *, aligned=None)  (context manager, contextvars: thread and asyncio
        safe; Tensor or None). With ``import mtp_overlay`` (fix ``mtp-loss-mask``),
        GPTModel/HybridModel.forward calls made without a loss_mask inside the block get this one
        (MTP models; with labels only when ``aligned="label"``, else a ValueError). ``aligned``:
        "input" (unshifted: what an RL forward takes), "label" (``mask[i]`` weighs token i + 1: the
        hook shifts it for an RL forward at CP=1), None (not said: the first packed RL forward's
        mask is checked for the label-aligned off-by-one). Every loss_mask reaching those forwards
        is checked: shape and device equal to input_ids', finite weights >= 0, for packed input
        zeros in every padding slot (on the device by default, ValueErrors under
        ``MTP_OVERLAY_CHECKS=full``), and (MTP on, mtp-packed-roll off) cu_seqlens_q equal to
        cu_seqlens_q_padded. A model that slices CP itself gets its full-row mask as an explicit
        ``loss_mask`` instead.
    check_loss_mask_layout(input_ids, loss_mask, packed_seq_params=None, cp_size=1, cp_rank=0)
        The rules on the host, ValueError naming the argument; assert_loss_mask_layout(...) the
        same without a host read (device asserts).
    input_aligned_mask(label_mask, cu_seqlens_padded=None): full rows, label- to input-aligned.
    label_aligned_signature(loss_mask, packed_seq_params, cp_group=None, cp_rank=0) -> int | None
        Whether every weighted packed sequence is 0 on its last real token (real boundaries known).
    checks.mode() -> "default" | "full" (``MTP_OVERLAY_CHECKS``): how the hooks check (module doc).

MTP block (``block``)
    mtp_block_scope(run)  (context manager, contextvars) With ``import mtp_overlay`` (fix
        ``mtp-logprob-skip``) GPTModel/HybridModel forwards under ``torch.no_grad()`` skip their MTP
        block (logits bit-identical, no MTP metric recorded); ``run=False`` skips it with grad
        enabled too, ``run=True`` runs it under no_grad (the opt-out). scoped_mtp_block() -> bool | None.

Gradient scale (``scaling``)
    mtp_grad_scale(model_or_config, token_mask, sample_mask, group=None)  (context manager)
        Sets ``config.mtp_grad_scale_func`` to ``1/max(global_valid_tokens, 1)`` for the block and
        resets it to None on exit, exceptions included. Needs calculate_per_token_loss=True.

Metrics (``metrics``)
    mtp_metrics(num_microbatches) -> {"mtp_{i}_loss", "mtp_{i}_acceptance_rate"} (i from 1)
        From MTPLossLoggingHelper's tracker (megatron-core 0.19+): reduce (a collective: every
        rank of the last stage), read, clean; loss scaled by 1/num_microbatches,
        rate = 100*correct/max(total, 1); empty tracker -> {}.
    with_prefix(metrics, prefix="mtp/")
    rollout_mtp_metrics(worker_stats, *, drafter_refits_behind=None)
            -> {"rollout_acceptance_pos_{k}", "rollout_mean_acceptance_length", "rollout_drafter_refits_behind"}
        From vLLM's ``SpecDecodingStats`` of every rollout worker (one per worker, or a list of a
        worker's steps), summed: position-k acceptance in percent (100 * accepted_per_pos / drafts),
        mean acceptance length 1 + accepted / drafts; no drafts -> no acceptance keys; ValueError on
        mismatched positions, negative or inconsistent counts, an empty list. ``drafter_refits_behind``
        (per worker, from vllm-mtp-drafter-load's ``refits_behind``): the largest, beside acceptance.
    acceptance_gap(train_metrics, rollout_metrics) -> {"acceptance_gap_1": train - rollout, depth 1}

Refit freshness (``refit``)
    fingerprint(named_tensors, keep=None, dtype=None) -> {name: TensorDigest(shape, dtype, size, checksum, format)}
        Per-tensor checksums on the tensors' own devices (format 2: two reductions over the bytes, the
        row and column sums of their 64-bit words, then two polynomial hashes of each, all tensors of
        a device in one batch; order-sensitive across the whole tensor, exact integers: equal bytes
        give equal digests on any device; any change to one element of up to 4 bytes is caught; what
        is guaranteed: ``refit``'s docstring; ``dtype`` casts first, for a bf16 wire).
    record_fingerprints(named_tensors, into, keep=None, dtype=None)  (generator: pairs unchanged)
        The receiving side: wrap what the drafter's load_weights consumes.
    compare_fingerprints(expected, received) -> {name: why}; check_fresh(...) raises StaleDrafterError
        A digest of another format (an older mtp-overlay's) is a ValueError, never compared.
    mtp_layer_of(name, num_hidden_layers, num_mtp_layers) -> ("mtp.*" | "positional", layer) | None
    mtp_name_filter(num_hidden_layers, num_mtp_layers) -> predicate (keep= of fingerprint)

Config (``config``)
    apply_mtp_config(config, mtp_config) -> config
        Sets the keys present among mtp_num_layers, mtp_loss_scaling_factor,
        mtp_use_repeated_layer, mtp_detach_heads; ValueError naming the key and the installed
        megatron-core version when its TransformerConfig has no such field.

Typical RL step (TP/CP ranks, no packing)::

    mask = build_mtp_loss_mask(token_mask, sample_mask, model)
    with mtp_grad_scale(model, token_mask, sample_mask):
        for mb in microbatches:
            ids = shard_for_model(model, mb.input_ids, cp_size, cp_rank)
            mb_mask = None if mask is None else shard_for_model(model, mask[mb.rows], cp_size, cp_rank)
            with loss_mask_scope(mb_mask):
                logits = unwrap_output(model(ids, position_ids, attention_mask))
            ...
    train = mtp_metrics(num_microbatches)
    behind = llm.collective_rpc(refits_behind)  # vllm-mtp-drafter-load, in the rollout workers
    rollout = rollout_mtp_metrics([stats_of(worker) for worker in rollout_workers], drafter_refits_behind=behind)
    log(with_prefix({**train, **rollout, **acceptance_gap(train, rollout)}))

Refit freshness (trainer -> vLLM drafter)::

    expected = fingerprint(model_state, keep=mtp_name_filter(num_hidden_layers, 1), dtype=torch.bfloat16)
    # rollout worker: drafter.load_weights(record_fingerprints(chunk, received)) per received chunk
    check_fresh(expected, received)   # StaleDrafterError naming the tensors
"""

from . import checks
from .block import mtp_block_scope, scoped_mtp_block
from .config import MTP_CONFIG_KEYS, apply_mtp_config
from .layout import (
    ALIGNMENTS,
    INPUT,
    LABEL,
    assert_loss_mask_layout,
    check_loss_mask_layout,
    input_aligned_mask,
    label_aligned_signature,
    loss_mask_scope,
    model_slices_context_parallel,
    scoped_alignment,
    scoped_loss_mask,
    shard_for_model,
    split_output,
    unwrap_output,
)
from .mask import build_mtp_loss_mask, global_valid_tokens, mtp_enabled, mtp_num_layers, unwrap_model
from .metrics import METRICS_PREFIX, acceptance_gap, mtp_metrics, rollout_mtp_metrics, with_prefix
from .packing import (
    PackedBatch,
    cp_local_indices,
    cp_shard,
    pack_sequences,
    packed_seq_params,
    padding_multiple,
    unpack_sequences,
)
from .refit import (
    StaleDrafterError,
    TensorDigest,
    check_fresh,
    compare_fingerprints,
    fingerprint,
    mtp_layer_of,
    mtp_name_filter,
    record_fingerprints,
)
from .scaling import mtp_grad_scale

__all__ = [
    "ALIGNMENTS",
    "INPUT",
    "LABEL",
    "MTP_CONFIG_KEYS",
    "METRICS_PREFIX",
    "PackedBatch",
    "StaleDrafterError",
    "TensorDigest",
    "acceptance_gap",
    "apply_mtp_config",
    "assert_loss_mask_layout",
    "build_mtp_loss_mask",
    "check_fresh",
    "check_loss_mask_layout",
    "checks",
    "compare_fingerprints",
    "cp_local_indices",
    "cp_shard",
    "fingerprint",
    "global_valid_tokens",
    "input_aligned_mask",
    "label_aligned_signature",
    "loss_mask_scope",
    "model_slices_context_parallel",
    "mtp_enabled",
    "mtp_grad_scale",
    "mtp_layer_of",
    "mtp_metrics",
    "mtp_name_filter",
    "mtp_num_layers",
    "pack_sequences",
    "packed_seq_params",
    "padding_multiple",
    "record_fingerprints",
    "rollout_mtp_metrics",
    "scoped_alignment",
    "scoped_loss_mask",
    "shard_for_model",
    "split_output",
    "unpack_sequences",
    "unwrap_model",
    "unwrap_output",
    "with_prefix",
    "mtp_block_scope",
    "scoped_mtp_block",
]
