"""The combined (text + image) token layout of a LLaVA batch, from first principles: what MTP must train.

megatron-core's ``LLaVAModel`` (``models/multimodal/llava_model.py``) replaces each image placeholder
in ``input_ids`` with that image's embeddings and hands its language model ``decoder_input`` (the
combined embeddings), ``labels`` and a loss mask in that combined layout, but ``input_ids=None``
(``:1267-1276``): the MTP block, which embeds the *token ids* of the next positions, has none. This
module says, without calling megatron-core, what the combined layout is and what the MTP head may
train in it, so a fix can be judged by "trained pairs == `mtp_pairs`; no image position is a target":

* `combine`: per sample, the input tokens are read left to right; a text token takes one slot, an
  image placeholder as many slots as that image has embeddings (images are consumed in reading
  order, sample after sample); shorter samples are padded at the end. In that layout: ``ids`` (the
  text id at text slots, one fixed id at image and padding slots: `mtp_fill_id`), ``labels`` and
  ``loss_mask``.
  A token's label and mask sit at its last slot, and only where the next input token is not an
  image (a label that names an image placeholder is no target); the last input token's label is
  always kept (its target lies beyond the window). The mask is the given one at text slots, 0 at
  image and padding slots. This is the convention of ``_preprocess_data`` (``:482``), derived here
  slot by slot; the test bed checks the two agree.
* `mtp_pairs`: megatron-core's MTP depth ``k`` at slot ``p`` reads the labels and the mask rolled
  ``k`` to the left (``transformer/multi_token_prediction.py`` ``process_mtp_loss``): it trains
  ``(p, labels[p + k])`` where ``loss_mask[p + k]`` is 1.
* `image_targets`: pairs whose label slot or predicted slot is an image slot (must be none).
* Without labels (RL), `input_aligned_mask` places the caller's input-aligned mask in the layout (0 at
  image and padding slots); `unlabelled_mtp_pairs`: Megatron derives the labels from the ids and
  rolls that mask with them, so depth ``k`` at slot ``p`` trains ``ids[p + 1 + k]`` where the mask
  allows; `unlabelled_image_targets`: those whose target slot is no text slot (must be none).
* `shard`: the layout sliced for the language model's ranks exactly as
  ``_process_embedding_token_parallel`` (``:749``) slices the combined embeddings: padded to a
  multiple of the shard factor (2*CP*TP with CP and SP, 2*CP with CP, TP with SP), then under CP
  the 2*CP-chunk load-balanced split (rank r keeps chunks r and 2*CP-1-r); sequence parallelism
  then scatters only the embeddings (`sequence_parallel_positions`), never ids, labels or mask.

Plain torch on CPU tensors; loops over tokens are kept on purpose (small batches, readable rules).
"""

import dataclasses

TEXT, IMAGE, PAD = 0, 1, 2
IGNORE_INDEX = -100  # llava_model.py IGNORE_INDEX: a label that is no target


@dataclasses.dataclass(frozen=True)
class CombinedLayout:
    """One batch in the combined layout; every tensor [batch, combined_length].

    ids: the token id of each slot (text id; ``fill_id`` at image and padding slots), int64.
    kinds: TEXT, IMAGE or PAD per slot, int64.
    labels: the label of each slot (IGNORE_INDEX where there is none), or None without labels.
    loss_mask: the label-aligned loss mask (0 at image and padding slots), or None without labels.
    image_rows: for an image slot, its row in the images' flattened embeddings (image after image in
      reading order, each image's tiles and tokens in order), else -1.
    lengths: per sample, the number of real (non-padding) slots.
    """

    ids: object
    kinds: object
    labels: object
    loss_mask: object
    image_rows: object
    lengths: tuple

    @property
    def length(self):
        return self.ids.shape[1]


def mtp_fill_id(image_token_index, vocab_size):
    """The id the MTP block embeds at image slots: the image token itself when it is a vocabulary id
    (Nemotron Omni's; vLLM 0.33 feeds a drafter without multimodal-embedding support, such as
    NemotronHMTP, the prompt's ids, placeholders included: ``v1/spec_decode/llm_base_proposer.py:1345-1352``),
    else 0, the id LLaVAModel embeds at placeholders for its own text embeddings (``llava_model.py:1224``).
    Never trained either way: image slots have mask 0."""
    return image_token_index if 0 <= image_token_index < vocab_size else 0


def image_tokens(img_h, img_w, patch_dim, *, class_token_len=1, drop_class_token=True, add_class_token=True):
    """Embeddings one image tile gives the language model: a CLIP ViT's patches plus its class
    tokens unless they are dropped (``LLaVAModel(drop_vision_class_token=...)``)."""
    for name, value in (("img_h", img_h), ("img_w", img_w), ("patch_dim", patch_dim)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if img_h % patch_dim or img_w % patch_dim:
        raise ValueError(f"img_h and img_w ({img_h}, {img_w}) must be multiples of patch_dim {patch_dim}")
    patches = (img_h // patch_dim) * (img_w // patch_dim)
    return patches + (class_token_len if add_class_token and not drop_class_token else 0)


def combine(input_ids, *, image_token_index, tokens_per_image, labels=None, loss_mask=None, fill_id=0,
            max_length=None):
    """The CombinedLayout of a batch (see the module docstring for the rules).

    input_ids: [batch, text_length] with ``image_token_index`` at image placeholders.
    tokens_per_image: the number of embeddings of each image, in reading order (an int for all, or a
      sequence: one per placeholder; an image of n tiles has n * tokens-per-tile).
    labels, loss_mask: [batch, text_length], label-aligned (``labels[j]`` is the target after token
      ``j``), both or neither.
    fill_id: the id at image and padding slots (never trained: their mask is 0).
    max_length: the language model's maximum sequence length: longer layouts are cut there.
    """
    import torch

    input_ids = _batch_tensor(input_ids, "input_ids")
    if (labels is None) != (loss_mask is None):
        raise ValueError("labels and loss_mask must be given together (or neither)")
    for name, value in (("labels", labels), ("loss_mask", loss_mask)):
        if value is not None and tuple(_batch_tensor(value, name).shape) != tuple(input_ids.shape):
            raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(value.shape)}")
    placeholders = int((input_ids == image_token_index).sum())
    if isinstance(tokens_per_image, int):
        counts = [tokens_per_image] * placeholders
    else:
        counts = [int(count) for count in tokens_per_image]
    if len(counts) != placeholders or any(count < 1 for count in counts):
        raise ValueError(
            f"tokens_per_image must be a positive int or one positive count per image placeholder "
            f"({placeholders} in input_ids), got {tokens_per_image!r}"
        )

    rows, next_image, next_row = [], 0, 0
    for sample in input_ids.tolist():
        slots = []  # (kind, id, image row, index of the input token)
        for index, token in enumerate(sample):
            if token == image_token_index:
                count = counts[next_image]
                slots += [(IMAGE, fill_id, next_row + t, index) for t in range(count)]
                next_image, next_row = next_image + 1, next_row + count
            else:
                slots.append((TEXT, token, -1, index))
        rows.append(slots)
    length = max(len(slots) for slots in rows)
    if max_length is not None:
        length = min(length, max_length)

    batch = input_ids.shape[0]
    ids = torch.full((batch, length), fill_id, dtype=torch.int64)
    kinds = torch.full((batch, length), PAD, dtype=torch.int64)
    image_rows = torch.full((batch, length), -1, dtype=torch.int64)
    combined_labels = combined_mask = None
    if labels is not None:
        combined_labels = torch.full((batch, length), IGNORE_INDEX, dtype=labels.dtype)
        combined_mask = torch.zeros((batch, length), dtype=loss_mask.dtype)
    for b, slots in enumerate(rows):
        last_token = input_ids.shape[1] - 1
        for p, (kind, token, row, index) in enumerate(slots[:length]):
            ids[b, p], kinds[b, p], image_rows[b, p] = token, kind, row
            if labels is None:
                continue
            is_last_slot_of_token = p + 1 == len(slots) or slots[p + 1][3] != index
            next_is_image = index < last_token and input_ids[b, index + 1] == image_token_index
            if is_last_slot_of_token and (index == last_token or not next_is_image):
                combined_labels[b, p] = labels[b, index]
                if kind == TEXT:
                    combined_mask[b, p] = loss_mask[b, index]
    lengths = tuple(min(len(slots), length) for slots in rows)
    return CombinedLayout(ids, kinds, combined_labels, combined_mask, image_rows, lengths)


def mtp_pairs(layout, depth):
    """{(sample, slot p, target id)}: what MTP depth ``depth`` (1-based) trains in ``layout``.

    Megatron rolls the labels and the loss mask ``depth`` slots to the left (zeros enter at the
    end): slot p is trained on ``labels[p + depth]`` where ``loss_mask[p + depth]`` is 1.
    """
    _check_depth(depth)
    if layout.labels is None:
        raise ValueError("layout has no labels: combine(..., labels=..., loss_mask=...) first")
    pairs = set()
    batch, length = layout.labels.shape
    for b in range(batch):
        for p in range(length - depth):
            if layout.loss_mask[b, p + depth] != 0:
                pairs.add((b, p, int(layout.labels[b, p + depth])))
    return pairs


def input_aligned_mask(input_ids, loss_mask, layout, *, image_token_index):
    """[batch, combined_length]: an input-aligned mask (``loss_mask[j]`` weights input token ``j``
    itself, the RL convention) in ``layout``: a text token's value at its slot, 0 at image and
    padding slots. The text tokens of a sample fill its TEXT slots in reading order."""
    import torch

    input_ids, loss_mask = _batch_tensor(input_ids, "input_ids"), _batch_tensor(loss_mask, "loss_mask")
    if tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"loss_mask must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(loss_mask.shape)}")
    combined = torch.zeros(layout.ids.shape, dtype=loss_mask.dtype)
    for b in range(input_ids.shape[0]):
        values = [loss_mask[b, j] for j in range(input_ids.shape[1]) if input_ids[b, j] != image_token_index]
        slots = [p for p in range(layout.length) if layout.kinds[b, p] == TEXT]
        for p, value in zip(slots, values):
            combined[b, p] = value
    return combined


def unlabelled_mtp_pairs(layout, mask, depth):
    """{(sample, slot p, target id)}: what MTP depth ``depth`` trains in ``layout`` without labels.

    Megatron derives the labels from the ids rolled one slot left and rolls the input-aligned
    ``mask`` with them, then both ``depth`` more: slot p is trained on ``ids[p + 1 + depth]`` where
    ``mask[p + 1 + depth]`` is nonzero.
    """
    _check_depth(depth)
    pairs = set()
    batch, length = layout.ids.shape
    for b in range(batch):
        for p in range(length - 1 - depth):
            if mask[b, p + 1 + depth] != 0:
                pairs.add((b, p, int(layout.ids[b, p + 1 + depth])))
    return pairs


def unlabelled_image_targets(layout, pairs, depth):
    """The pairs of `unlabelled_mtp_pairs` whose target slot ``p + 1 + depth`` is not a real text slot
    (an image or padding slot): must be none."""
    _check_depth(depth)
    return {(b, p, target) for b, p, target in pairs
            if p + 1 + depth >= layout.lengths[b] or int(layout.kinds[b, p + 1 + depth]) != TEXT}


def image_targets(layout, pairs, depth):
    """The pairs (sample, slot, target) of MTP depth ``depth`` whose label slot ``p + depth`` or
    predicted slot ``p + depth + 1`` is an image slot, or lies outside the sample's real slots
    (except the last label's target, beyond the window): must be none."""
    _check_depth(depth)
    wrong = set()
    for b, p, target in pairs:
        label_slot, predicted = p + depth, p + depth + 1
        real = layout.lengths[b]
        if label_slot >= real or int(layout.kinds[b, label_slot]) != TEXT:
            wrong.add((b, p, target))
        elif predicted < real and int(layout.kinds[b, predicted]) != TEXT:
            wrong.add((b, p, target))
    return wrong


def shard_factor(tp, cp, sequence_parallel):
    """The multiple LLaVAModel pads the combined sequence to (``_process_embedding_token_parallel``)."""
    if cp > 1:
        return 2 * cp * (tp if sequence_parallel else 1)
    return tp if sequence_parallel else 1


def cp_positions(length, cp, rank):
    """Slots (of a padded length) CP rank ``rank`` keeps: chunks ``rank`` and ``2*cp-1-rank`` of ``2*cp``."""
    import torch

    if cp == 1:
        return torch.arange(length)
    if length % (2 * cp):
        raise ValueError(f"length {length} must be a multiple of 2*cp={2 * cp}")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def shard(tensor, *, tp, cp, sequence_parallel, cp_rank, pad_value):
    """``tensor`` ([batch, combined_length, ...]) padded with ``pad_value`` to the shard factor, then
    this CP rank's slots: the ids, labels and mask the language model's rank sees."""
    import torch

    factor = shard_factor(tp, cp, sequence_parallel)
    missing = -tensor.shape[1] % factor
    if missing:
        pad = torch.full((tensor.shape[0], missing, *tensor.shape[2:]), pad_value, dtype=tensor.dtype)
        tensor = torch.cat([tensor, pad.to(tensor.device)], dim=1)
    return tensor.index_select(1, cp_positions(tensor.shape[1], cp, cp_rank).to(tensor.device))


def sequence_parallel_positions(local_length, tp, tp_rank):
    """Slots (of this CP rank's local sequence) whose embeddings TP rank ``tp_rank`` holds under
    sequence parallelism: the ``tp_rank``-th of ``tp`` equal parts."""
    import torch

    if local_length % tp:
        raise ValueError(f"local_length {local_length} must be a multiple of tp={tp}")
    part = local_length // tp
    return torch.arange(tp_rank * part, (tp_rank + 1) * part)


def _batch_tensor(value, name):
    import torch

    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        raise ValueError(f"{name} must be a [batch, text_length] tensor, got {value!r:.80}")
    return value


def _check_depth(depth):
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"depth must be a positive int (1 is the first MTP depth), got {depth!r}")
