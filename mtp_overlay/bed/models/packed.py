"""Packed (THD) batches as NeMo-RL builds them, and what a test needs to check a packed forward.

Call the model-facing parts inside ``run_ranks`` workers (model parallelism initialised; on CPU the
shims installed, whose exact attention runs the packed sequences).

* `make_packed_row`: sequences of given lengths packed into one [1, T] row, each padded to
  ``pad_multiple`` (``mtp_overlay.mtp.padding_multiple``: 2*CP*TP under CP, TP under sequence
  parallelism), in one of NeMo-RL's two ``PackedSeqParams`` flavours:
  ``"padded"``: ``cu_seqlens_q == cu_seqlens_q_padded ==`` the padded boundaries (NeMo-RL's default
  path); ``"unpadded"``: ``cu_seqlens_q`` the real boundaries, ``cu_seqlens_q_padded`` the padded
  ones (the ``model_slices_context_parallel_inputs`` path, NeMo-RL PR #3494, Nemotron Omni).
* `cp_local`: this CP rank's part of the row, the per-sequence 2*CP-chunk layout of megatron-core's
  ``get_batch_on_this_cp_rank`` for THD (whose own implementation needs Transformer Engine's
  ``thd_get_partitioned_indices``), through ``mtp_overlay.mtp.cp_shard``.
* `SelfSlicingCP`: a model that takes the full row and slices CP itself (the Omni contract).
* `run_packed` / `run_reference`: one forward+backward of the packed row, or of each sequence
  alone (BSHD, unpadded, the reference), giving the same `PackedResult` in packed positions.
* `expected_mtp` : the MTP targets and weights each position must train, from the text alone.
"""

import contextlib
import dataclasses

import torch

FLAVOURS = ("padded", "unpadded")
ROW_TENSORS = ("input_ids", "labels", "position_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class PackedRow:
    """One packed row and the sequences it holds.

    input_ids, labels, position_ids, loss_mask: [1, T] (pad slots: token 0, mask 0; position ids
    count from 0 in each padded slot). loss_mask is 1 on each sequence's tokens past its prompt.
    packed_seq_params: megatron's PackedSeqParams (thd, global boundaries). texts: per sequence its
    ``length + 1`` tokens (input_ids = text[:-1], labels = text[1:]); prompts: per sequence its
    leading tokens that the loss mask leaves out.
    """

    input_ids: object
    labels: object
    position_ids: object
    loss_mask: object
    packed_seq_params: object
    cu_seqlens: object
    cu_seqlens_padded: object
    texts: tuple
    prompts: tuple
    flavour: str

    @property
    def lengths(self):
        return tuple(len(text) - 1 for text in self.texts)

    def sequences(self):
        """Each sequence alone, BSHD [1, L] and unpadded: input_ids, labels, position_ids, loss_mask."""
        return [
            dict(
                input_ids=text[None, :-1],
                labels=text[None, 1:],
                position_ids=torch.arange(len(text) - 1)[None, :],
                loss_mask=(torch.arange(len(text) - 1) >= prompt).float()[None, :],
            )
            for text, prompt in zip(self.texts, self.prompts)
        ]

    def microbatch(self, *, labels):
        """This row as one packed microbatch of ``megatron_step.MegatronStep`` (full row, its params).

        labels=True (SFT): ``loss_mask`` is the row's mask over the labels. labels=False (RL): the
        row's mask read as a token mask (token i is a response token) is ``mtp_loss_mask``
        (input_ids-aligned, what Megatron rolls into the MTP mask) and ``loss_mask`` the LM loss's
        label-aligned mask (label i is token i + 1: the mask shifted left within each sequence).
        """
        batch = dict(input_ids=self.input_ids, labels=self.labels, position_ids=self.position_ids,
                     packed_seq_params=self.packed_seq_params)
        masks = self._masks(labels)
        starts = self.cu_seqlens_padded.tolist()
        for key in masks[0]:
            batch[key] = torch.zeros(self.input_ids.shape)
            for start, mask in zip(starts, masks):
                batch[key][0, start : start + mask[key].shape[0]] = mask[key]
        return batch

    def reference_microbatch(self, *, labels):
        """Each sequence alone in its own row, unpacked: one BSHD microbatch [num_sequences, longest]
        (right-padded: causal attention keeps padding out of the real tokens, masks are zero on it),
        the keys of `microbatch`. One microbatch, so Megatron normalises the LM and MTP losses by the
        same token counts as for the packed row."""
        count, longest = len(self.texts), max(self.lengths)
        batch = {key: torch.zeros(count, longest, dtype=torch.int64) for key in ("input_ids", "labels")}
        batch["position_ids"] = torch.arange(longest).repeat(count, 1)
        masks = self._masks(labels)
        for key in masks[0]:
            batch[key] = torch.zeros(count, longest)
        for index, (text, mask) in enumerate(zip(self.texts, masks)):
            length = len(text) - 1
            batch["input_ids"][index, :length], batch["labels"][index, :length] = text[:-1], text[1:]
            for key, value in mask.items():
                batch[key][index, :length] = value
        return batch

    def _masks(self, labels):
        """Per sequence, the unpadded masks of a microbatch (see `microbatch`)."""
        masks = []
        for text, prompt in zip(self.texts, self.prompts):
            response = (torch.arange(len(text) - 1) >= prompt).float()
            if labels:
                masks.append(dict(loss_mask=response))
            else:
                masks.append(dict(loss_mask=torch.cat([response[1:], response.new_zeros(1)]), mtp_loss_mask=response))
        return masks

    def real_slots(self):
        """Boolean [T]: the slots holding a real token (not padding)."""
        padded = self.cu_seqlens_padded.long()
        slot = torch.arange(int(padded[-1]))
        sequence = torch.searchsorted(padded, slot, right=True) - 1
        return slot - padded[sequence] < torch.tensor(self.lengths)[sequence]


def random_lengths(count, low, high, seed=0):
    """``count`` sequence lengths drawn uniformly from [low, high] (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(low, high + 1, (count,), generator=generator).tolist())


def make_packed_row(lengths, *, pad_multiple=1, flavour="padded", prompts=None, vocab_size=128, seed=0):
    """Random sequences of ``lengths`` packed into one row the way NeMo-RL packs (see module doc).

    ``prompts``: per sequence, how many leading tokens the loss mask leaves out (default none).
    """
    from ... import mtp

    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    lengths = tuple(int(length) for length in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be one or more positive ints, got {lengths}")
    prompts = tuple(prompts) if prompts is not None else (0,) * len(lengths)
    if len(prompts) != len(lengths) or any(not 0 <= p <= n for p, n in zip(prompts, lengths)):
        raise ValueError(f"prompts must give one count in [0, length] per sequence {lengths}, got {prompts}")
    generator = torch.Generator().manual_seed(seed)
    texts = tuple(torch.randint(0, vocab_size, (length + 1,), generator=generator) for length in lengths)
    longest = max(lengths)
    rows = torch.zeros(3, len(lengths), longest, dtype=torch.int64)  # input_ids, labels, loss mask
    for index, (text, prompt) in enumerate(zip(texts, prompts)):
        rows[0, index, : len(text) - 1] = text[:-1]
        rows[1, index, : len(text) - 1] = text[1:]
        rows[2, index, prompt : len(text) - 1] = 1
    packed = mtp.pack_sequences(rows[0], lengths, rows[2].float(), pad_multiple=pad_multiple)
    labels = mtp.pack_sequences(rows[1], lengths, pad_multiple=pad_multiple).input_ids
    padded = packed.cu_seqlens_padded.long()
    slot = torch.arange(int(padded[-1]))
    position_ids = (slot - padded[torch.searchsorted(padded, slot, right=True) - 1])[None, :]
    params = mtp.packed_seq_params(packed, real_lengths=flavour == "unpadded")
    return PackedRow(
        input_ids=packed.input_ids,
        labels=labels,
        position_ids=position_ids,
        loss_mask=packed.loss_mask,
        packed_seq_params=params,
        cu_seqlens=packed.cu_seqlens,
        cu_seqlens_padded=packed.cu_seqlens_padded,
        texts=texts,
        prompts=prompts,
        flavour=flavour,
    )


def expected_mtp(row, *, labels, depth=1):
    """(weights [T], targets [T]) that MTP depth ``depth`` must train at each packed slot.

    Computed from the text alone, per sequence, as each sequence alone would train: slot i of a
    sequence predicts text[i + depth + 1]; with labels (SFT, label-aligned loss mask) it weighs
    loss_mask[i + depth], without (RL, input-aligned mask, labels derived from input_ids)
    loss_mask[i + depth + 1]; a slot whose weight index runs past the sequence trains nothing.
    """
    weights = torch.zeros(row.input_ids.shape[1])
    targets = torch.zeros(row.input_ids.shape[1], dtype=torch.int64)
    shift = depth if labels else depth + 1
    for start, text, prompt in zip(row.cu_seqlens_padded.tolist(), row.texts, row.prompts):
        length = len(text) - 1
        mask = (torch.arange(length) >= prompt).float()
        count = max(length - shift, 0)
        weights[start : start + count] = mask[shift : shift + count]
        targets[start : start + count] = text[depth + 1 : depth + 1 + count]
    return weights, targets


def cp_local(row_or_tensor, boundaries=None):
    """This CP rank's share of a packed row (dict of its [1, T] tensors) or of one [1, T] tensor."""
    from megatron.core import parallel_state

    from ...mtp import cp_shard

    size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if isinstance(row_or_tensor, PackedRow):
        row = row_or_tensor
        return {key: cp_shard(getattr(row, key), size, rank, row.cu_seqlens_padded) for key in ROW_TENSORS}
    return cp_shard(row_or_tensor, size, rank, boundaries)


def to_global(local, boundaries, dim=1):
    """A CP-local tensor (sequence along ``dim``) back in full-row order, on every rank (a collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ...mtp import cp_local_indices

    if local.dtype == torch.bool:
        return to_global(local.to(torch.int64), boundaries, dim).bool()
    size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    index = cp_local_indices(boundaries, size, rank)
    local = local.detach().movedim(dim, 0)
    full = local.new_zeros((int(boundaries[-1]),) + tuple(local.shape[1:]))
    full[index] = local
    if size > 1:
        dist.all_reduce(full, group=parallel_state.get_context_parallel_group())
    return full.movedim(0, dim)


class SelfSlicingCP(torch.nn.Module):
    """A model that takes the FULL packed (or BSHD) row and slices context parallelism itself.

    The contract of Megatron-Bridge's NemotronOmniModel and NeMo-RL PR #3494 (class attribute
    ``model_slices_context_parallel_inputs = True``): input_ids, position_ids, labels and loss_mask
    come as full rows with full-row ``packed_seq_params`` boundaries; each padded sequence is cut
    into the 2*CP-chunk layout here; the inner GPTModel/HybridModel (``language_model``, not
    ``.module``: it is the model, not a wrapper) gets the CP-local parts; with a loss_mask the
    result is ``(output, sliced_loss_mask)``.
    """

    model_slices_context_parallel_inputs = True

    def __init__(self, language_model):
        super().__init__()
        self.language_model = language_model
        self.config = language_model.config
        self.model_type = language_model.model_type  # what Megatron's schedule reads off a model

    def set_input_tensor(self, input_tensor):
        """Megatron's schedule hands pipeline inputs to the model (as LLaVAModel passes them on)."""
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None, *, loss_mask=None,
                packed_seq_params=None, **kwargs):
        from ...mtp import cp_shard

        group = self.language_model.pg_collection.cp
        boundaries = None
        if packed_seq_params is not None:
            boundaries = packed_seq_params.cu_seqlens_q_padded
            boundaries = packed_seq_params.cu_seqlens_q if boundaries is None else boundaries
        full = dict(input_ids=input_ids, position_ids=position_ids, labels=labels, loss_mask=loss_mask)
        for name, value in full.items():
            if value is not None and value.shape != input_ids.shape:
                raise ValueError(
                    f"{name} must be a full row of input_ids' shape {tuple(input_ids.shape)} (this model "
                    f"slices context parallelism itself), got {tuple(value.shape)}"
                )
        local = {
            name: None if value is None else cp_shard(value, group.size(), group.rank(), boundaries)
            for name, value in full.items()
        }
        output = self.language_model(
            local["input_ids"], local["position_ids"], attention_mask, labels=local["labels"],
            loss_mask=local["loss_mask"], packed_seq_params=packed_seq_params, **kwargs,
        )
        return output if loss_mask is None else (output, local["loss_mask"])


@contextlib.contextmanager
def record_mtp(model):
    """Observe megatron-core's MTP loss inside ``model``'s forward: one dict per MTP depth.

    Each: ``targets`` (the labels its cross entropy gets), ``losses`` (per-token cross entropy)
    and ``trained`` (bool: where the loss it back-propagates, loss_mask * loss / tokens, is nonzero,
    i.e. where the rolled loss mask is). Read by wrapping the model's ``compute_language_model_loss``
    and ``MTPLossAutoScaler.apply`` for the block.
    """
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    inner = getattr(model, "language_model", model)
    records, pending = [], []
    compute, apply = inner.compute_language_model_loss, MTPLossAutoScaler.apply

    def observed_loss(labels, logits):
        loss = compute(labels, logits)
        pending[:] = [(labels.detach().clone(), loss.detach().clone())]
        return loss

    def observed_apply(output, weighted):
        if pending:
            targets, losses = pending.pop()
            records.append(dict(targets=targets, losses=losses, trained=weighted.detach() != 0))
        return apply(output, weighted)

    own = vars(inner).get("compute_language_model_loss")  # an instance attribute to put back, if any
    inner.compute_language_model_loss = observed_loss
    MTPLossAutoScaler.apply = staticmethod(observed_apply)
    try:
        yield records
    finally:
        del MTPLossAutoScaler.apply
        del inner.compute_language_model_loss
        if own is not None:
            inner.compute_language_model_loss = own


@dataclasses.dataclass
class PackedResult:
    """One forward+backward, in packed-row positions (full row, identical on every rank).

    lm_losses: [T] per-token LM cross entropy. logits: [T, vocab] (TP-gathered) when the forward
    ran without labels, else None. mtp: per depth, dict of [T] ``targets``, ``losses`` and
    ``trained`` (see `record_mtp`). grads:
    full (TP-gathered) gradient of every parameter, in parameter order; names: their names.
    sliced_loss_mask: [T], the loss mask a self-slicing model handed back, put in row order.
    error: the exception text when the forward raised (everything else None then).
    """

    lm_losses: object = None
    logits: object = None
    mtp: tuple = ()
    grads: tuple = ()
    names: tuple = ()
    sliced_loss_mask: object = None
    error: str | None = None

    def portable(self):
        """A copy holding numpy arrays: what a rank can return (a tensor sent between processes
        travels through torch's shared-memory reduction, which dies with the sending rank)."""
        return _portable(self)

    def trained(self, real=None, depth=0):
        """{(slot, target)} MTP depth ``depth`` trained; with ``real`` (a [T] bool of the real slots)
        only those, numbered in sequence space as the unpadded reference numbers them."""
        import numpy as np

        mask, targets = np.asarray(self.mtp[depth]["trained"]), np.asarray(self.mtp[depth]["targets"])
        slots = np.nonzero(np.asarray(real))[0] if real is not None else np.arange(len(mask))
        return {(index, int(targets[slot])) for index, slot in enumerate(slots) if mask[slot]}


def _portable(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, PackedResult):
        fields = dataclasses.fields(value)
        return dataclasses.replace(value, **{field.name: _portable(getattr(value, field.name)) for field in fields})
    if isinstance(value, dict):
        return {key: _portable(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_portable(item) for item in value)
    return value


def run_packed(model, row, *, labels=True, loss_mask="explicit"):
    """One forward+backward of ``model`` on the packed ``row``, gradients reduced as in `_backward`.

    Tokens and mask reach the model in its layout (``mtp_overlay.mtp.shard_for_model``: the full row
    for a model that slices CP itself, else this CP rank's share). labels: pass the row's labels
    (SFT: the model returns per-token losses) or None (RL: it returns logits, the LM loss is
    computed here). loss_mask: "explicit" passes the mask as ``loss_mask``; "scoped" passes none
    and scopes it with ``mtp_overlay.mtp.loss_mask_scope`` (the mtp-loss-mask route); None passes
    none. A forward that raises gives ``PackedResult(error=...)``.
    """
    from megatron.core import parallel_state

    from ... import mtp

    size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    inputs = {
        key: mtp.shard_for_model(model, getattr(row, key), size, rank, row.cu_seqlens_padded) for key in ROW_TENSORS
    }
    call = dict(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], attention_mask=None,
                labels=inputs["labels"] if labels else None, packed_seq_params=row.packed_seq_params)
    if loss_mask == "explicit":
        call["loss_mask"] = inputs["loss_mask"]
    scope = mtp.loss_mask_scope(inputs["loss_mask"]) if loss_mask == "scoped" else contextlib.nullcontext()
    model.zero_grad(set_to_none=True)
    try:
        with scope, record_mtp(model) as records:
            output, sliced = mtp.split_output(model(**call))
    except Exception as exc:  # the caller compares the kind and text of the failure
        return PackedResult(error=f"{type(exc).__name__}: {exc}")
    local = cp_local(row)
    logits = None
    if not labels:
        # a copy: megatron's vocab-parallel cross entropy subtracts the max from its logits in place
        logits = output.detach().clone()
        output = _inner(model).compute_language_model_loss(local["labels"], output.transpose(0, 1))
    result = _backward(model, row, output, local["loss_mask"], records, logits)
    if sliced is not None:
        result.sliced_loss_mask = to_global(sliced, row.cu_seqlens_padded)[0]
    return result


def run_reference(model, row, *, labels=True):
    """Each sequence of ``row`` alone (BSHD [1, L], unpadded) through ``model`` (TP1, no CP): the
    reference a packed forward must equal. Gradients are those of the same objective as
    `run_packed`'s: LM and MTP token losses summed over all sequences, each divided by its global count."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    T = row.input_ids.shape[1]
    starts = row.cu_seqlens_padded.tolist()
    lm_losses, logits = torch.zeros(T), None
    passes = []
    model.zero_grad(set_to_none=True)
    for start, batch in zip(starts, row.sequences()):
        with record_mtp(model) as records:
            output = model(batch["input_ids"], batch["position_ids"], None, loss_mask=batch["loss_mask"],
                           labels=batch["labels"] if labels else None)
        length = batch["input_ids"].shape[1]
        if not labels:
            if logits is None:
                logits = torch.zeros(T, output.shape[-1])
            logits[start : start + length] = output[0].detach()
            output = model.compute_language_model_loss(batch["labels"], output.transpose(0, 1))
        lm_losses[start : start + length] = output[0].detach()
        passes.append((start, length, output, batch["loss_mask"], records))
    lm_count = sum(float(mask.sum()) for *_, mask, _ in passes)
    mtp_count = sum(float(records[0]["trained"].sum()) for *_, records in passes if records)
    mtp = [
        dict(targets=torch.zeros(T, dtype=torch.int64), losses=torch.zeros(T), trained=torch.zeros(T, dtype=torch.bool))
        for _ in passes[0][4]
    ]
    previous = MTPLossAutoScaler.main_loss_backward_scale
    try:
        for start, length, output, mask, records in passes:
            for depth, record in zip(mtp, records):
                for key in depth:
                    depth[key][start : start + length] = record[key][0]
            tokens = float(records[0]["trained"].sum()) if records else 0.0
            MTPLossAutoScaler.set_loss_scale(torch.tensor(tokens / max(mtp_count, 1.0)))
            ((output * mask).sum() / max(lm_count, 1.0)).backward()
    finally:
        MTPLossAutoScaler.set_loss_scale(previous)
    names, grads = full_grads(model)
    return PackedResult(lm_losses=lm_losses, logits=logits, mtp=tuple(mtp), grads=grads, names=names)


def _inner(model):
    return getattr(model, "language_model", model)


def _backward(model, row, token_losses, local_mask, records, logits):
    """Backward of sum(LM loss * mask) / global mask count, the MTP loss rescaled from this CP rank's
    token count (megatron-core divides each rank's MTP loss by its own) to the global one (depth 1's
    count: ``MTPLossAutoScaler`` has one scale for every depth), then gradients summed over
    data+context parallel ranks and sequence-parallel ones over TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from .tiny_gpt import finalize_grads

    cp_group = parallel_state.get_context_parallel_group()
    boundaries = row.cu_seqlens_padded
    local_mtp = torch.tensor(float(records[0]["trained"].sum()) if records else 0.0)
    counts = torch.stack([local_mask.float().sum().detach(), local_mtp])
    dist.all_reduce(counts, group=cp_group)
    previous = MTPLossAutoScaler.main_loss_backward_scale
    MTPLossAutoScaler.set_loss_scale(local_mtp / counts[1].clamp(min=1))
    try:
        ((token_losses * local_mask).sum() / counts[0].clamp(min=1)).backward()
    finally:
        MTPLossAutoScaler.set_loss_scale(previous)
    finalize_grads(_inner(model), parallel_state.get_data_parallel_group(with_context_parallel=True), 1.0)
    mtp = []
    for record in records:
        mtp.append({key: to_global(value, boundaries)[0] for key, value in record.items()})
    if logits is not None:
        logits = to_global(_gather_tensor_parallel(logits, dim=-1), boundaries)[0]
    names, grads = full_grads(_inner(model))
    return PackedResult(lm_losses=to_global(token_losses, boundaries)[0], logits=logits, mtp=tuple(mtp),
                        grads=grads, names=names)


def full_grads(model):
    """(names, gradients) of every parameter, TP shards gathered into the full tensor (zeros if None)."""
    names, grads = [], []
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if getattr(param, "tensor_model_parallel", False):
            grad = _gather_tensor_parallel(grad, dim=param.partition_dim, parameter=param)
        names.append(name)
        grads.append(grad.detach().clone())
    return tuple(names), tuple(grads)


def _gather_tensor_parallel(tensor, dim, parameter=None):
    """``tensor`` gathered over TP along ``dim``; a parameter's shard in its TP1 layout (`tp_layout`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..oracles.tp_layout import tp_unshard

    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return tensor.detach()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim) if parameter is None else tp_unshard(parts, parameter)
